"""A checkpoint file's bytes in file order, and the writers that put them on disk.

A ``FileImage`` is what a file will hold: runs of header bytes (small, in memory) and runs
of tensor bytes (the tensors' own storages), covering the file from 0 to its size without
gaps. Some header bytes are the CRC-32 of a tensor run (zip's data descriptors and central
directory); they are filled in once that run's bytes have gone by.

Note [streamed checkpoint writes]: a synchronous save never holds a second copy of the
state. The image is cut into chunks at 4096-aligned file offsets; each chunk is copied
into one buffer of a small ring of locked buffers (the CRC taken from the copy), written
from there without a further copy, and the buffer is reused once its write is done. The
copy of chunk k+1 overlaps the write of chunk k, so a save costs about the larger of one
memcpy and one device write of the state, and locks only the ring. The CRCs of runs of
1 MiB or more (THREAD_CRC_BYTES) are taken from the tensors themselves on a thread of
their own, running ahead of the copy; a header run that holds one waits for it before it
is copied. A smaller run's CRC is taken from the ring right after its copy (some 7 us
for 64 KiB): handing each of 2000 such runs to the thread and waiting for it took longer
than the CRCs (a save of 2000 tensors of 64 KiB: 138 ms through the thread, 115 ms
from the ring, 2026-11-27). A run in CUDA memory (Note [CUDA state layout]) is copied
straight into the ring (DMA where the ring is registered with CUDA, as locked tensors
are once CUDA is in use) and its CRC taken from the ring right after too, so it never
passes through other host memory.
"""
from __future__ import annotations

import threading
from typing import Any

from .._memory import copy_memory
from ..io.interrupts import deferred_interrupts
from ..units import ALIGNMENT, round_up
from .crc import crc32


class TensorRun:
    """``nbytes`` bytes of a tensor storage at ``offset``; ``crc_slots`` are the
    ``(bytearray, index)`` places its CRC-32 goes (little-endian) once known."""

    __slots__ = ("crc", "crc_slots", "nbytes", "offset", "source")

    def __init__(self, offset: int, source: Any, crc_slots: list | None = None) -> None:
        self.offset = offset
        self.source = source            # a 1-D uint8 tensor, on the CPU or a CUDA device
        self.nbytes = source.numel()
        self.crc_slots = crc_slots or []
        self.crc = 0

    def set_crc(self, crc: int) -> None:
        self.crc = crc
        for segment, index in self.crc_slots:
            segment[index:index + 4] = crc.to_bytes(4, "little")


class FileImage:
    """The runs of a file in offset order: ``bytearray`` header runs and ``TensorRun``s."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, Any]] = []     # (offset, bytearray | TensorRun)
        self.size = 0

    def add_bytes(self, offset: int, data: bytes) -> bytearray:
        return self.add_segment(offset, bytearray(data))

    def add_segment(self, offset: int, segment: bytearray) -> bytearray:
        """A header run of ``segment`` itself (not a copy)."""
        self._add(offset, len(segment), segment)
        return segment

    def add_tensor(self, offset: int, source: Any) -> TensorRun:
        run = TensorRun(offset, source)
        self._add(offset, run.nbytes, run)
        return run

    def pad_to(self, alignment: int) -> None:
        """Zero bytes up to the next multiple of ``alignment``."""
        if self.size % alignment:
            self.add_bytes(self.size, bytes(alignment - self.size % alignment))

    def extend(self, other: FileImage) -> int:
        """Append ``other``'s runs after this image's; returns where it starts."""
        base = self.size
        for offset, run in other.runs:
            self.runs.append((base + offset, run))
            if isinstance(run, TensorRun):
                run.offset += base
        self.size = base + other.size
        return base

    def _add(self, offset, nbytes, run):
        if offset != self.size:
            raise AssertionError(f"file image run at {offset} after {self.size} bytes")
        if nbytes:
            self.runs.append((offset, run))
        self.size = offset + nbytes

    def tensor_runs(self) -> list[TensorRun]:
        return [run for _, run in self.runs if isinstance(run, TensorRun)]

    def cuda_bytes(self) -> dict[Any, int]:
        """The bytes of this image's runs in CUDA memory, by device."""
        found: dict[Any, int] = {}
        for run in self.tensor_runs():
            if run.source.is_cuda:
                found[run.source.device] = found.get(run.source.device, 0) + run.nbytes
        return found


def uint8_view(storage: Any, nbytes: int | None = None) -> Any:
    """A 1-D uint8 tensor over the first ``nbytes`` (all) of ``storage`` (an
    ``UntypedStorage``, on its device)."""
    import torch

    if nbytes is None:
        nbytes = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (nbytes,), (1,))


#: Runs of at least this many bytes take their CRC on the CRC thread, smaller ones from
#: the ring (Note [streamed checkpoint writes]).
THREAD_CRC_BYTES = 1 << 20


class _Checksums:
    """The CRC-32 of every tensor run that needs one, computed on a thread of its own
    from the runs' own bytes while the ring is filled and written (Note [fast CRC-32]:
    it releases the GIL), each patched into its header bytes before ``wait_for`` lets
    them be copied."""

    PIECE = 64 << 20

    def __init__(self, runs: list[TensorRun]) -> None:
        self.runs = runs
        self.finished = 0
        self.error: BaseException | None = None
        self.stopped = False
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="nvmeswap-crc32", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for run in self.runs:
                view = memoryview(run.source.numpy())
                crc = 0
                for start in range(0, len(view), self.PIECE):
                    if self.stopped:
                        return
                    crc = crc32(view[start:start + self.PIECE], crc)
                view.release()
                with self.condition:
                    run.set_crc(crc)
                    self.finished += 1
                    self.condition.notify_all()
        except BaseException as error:
            with self.condition:
                self.error = error
                self.condition.notify_all()

    def wait_for(self, count: int) -> None:
        """Return once the first ``count`` runs have their CRC in place."""
        with self.condition:
            while self.finished < count and self.error is None:
                self.condition.wait()
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        self.stopped = True
        self.thread.join()


class StreamWriter:
    """Writes ``FileImage``s through a ring of ``chunks`` locked buffers of ``chunk_bytes``
    (Note [streamed checkpoint writes]); owns the ring until ``close()``."""

    def __init__(self, handle: Any, chunk_bytes: int, chunks: int) -> None:
        import torch

        self.handle = handle
        self.chunk_bytes = round_up(chunk_bytes, ALIGNMENT)
        self.chunks = chunks
        self.ring = handle.new_cpu_locked_tensor(self.chunk_bytes * chunks,
                                                 torch.empty(0, dtype=torch.uint8))
        self.view = memoryview(self.ring.numpy())

    def write(self, image: FileImage, filename: str) -> None:
        """Write all of ``image`` to ``filename`` (which must exist), filling in CRCs."""
        futures: list = [None] * self.chunks
        plan, checksums = self._plan(image)
        ring_address = self.ring.data_ptr()
        view = self.view
        at = 0                          # index of the run being copied
        failed = True
        try:
            for slot_number, start in enumerate(range(0, image.size, self.chunk_bytes)):
                slot = slot_number % self.chunks
                if futures[slot] is not None:
                    futures[slot].result()
                    futures[slot] = None
                end = min(start + self.chunk_bytes, image.size)
                into = slot * self.chunk_bytes - start      # ring index of file offset 0
                position = start
                while position < end:
                    offset, run_end, run, address, crc_from_ring, needed = plan[at]
                    upto = min(end, run_end)
                    if address:
                        # memcpy, not torch's copy: for a small run, that one wakes its
                        # threads for each copy, which wait for the CRC thread's core.
                        copy_memory(ring_address + into + position,
                                    address + position - offset, upto - position)
                    elif address is None:           # header bytes
                        if needed > checksums.finished:
                            checksums.wait_for(needed)
                        view[into + position:into + upto] = \
                            run if upto - position == len(run) else \
                            memoryview(run)[position - offset:upto - offset]
                    else:                           # in CUDA memory
                        self.ring[into + position:into + upto].copy_(
                            run.source[position - offset:upto - offset])
                    if crc_from_ring:
                        run.crc = crc32(view[into + position:into + upto],
                                        run.crc if position > offset else 0)
                        if upto == run_end:
                            run.set_crc(run.crc)
                    position = upto
                    if upto == run_end:
                        at += 1
                with deferred_interrupts():     # a write started is one waited for
                    futures[slot] = self.handle.submit_pwrite(
                        self.ring[into + start:into + end], filename, start)
            failed = False
        finally:
            checksums.close()
            first = None
            for future in futures:
                if future is None:
                    continue
                try:
                    future.result()
                except BaseException as error:      # the first one is raised below
                    first = first or error
            if first is not None and not failed:    # else the error under way is raised
                raise first

    @staticmethod
    def _plan(image: FileImage) -> tuple[list[tuple], _Checksums]:
        """For each run ``(offset, end, run, address, crc_from_ring, needed)``: address
        the host address of a tensor run's bytes (0 for CUDA memory, None for header
        bytes); crc_from_ring whether its CRC is taken from the ring; needed how many of
        the CRC thread's runs come before it (their CRCs may be in its bytes). And the
        CRC thread, started on its runs."""
        plan, on_thread = [], []
        for offset, run in image.runs:
            if isinstance(run, TensorRun):
                source = run.source
                address = 0 if source.is_cuda else source.data_ptr()
                threads = bool(run.crc_slots and address and run.nbytes >= THREAD_CRC_BYTES)
                plan.append((offset, offset + run.nbytes, run, address,
                             bool(run.crc_slots) and not threads, len(on_thread)))
                if threads:
                    on_thread.append(run)
            else:
                plan.append((offset, offset + len(run), run, None, False, len(on_thread)))
        return plan, _Checksums(on_thread)

    def close(self) -> None:
        if self.ring is not None:
            self.view.release()
            self.handle.free_cpu_locked_tensor(self.ring)
            self.ring = self.view = None
