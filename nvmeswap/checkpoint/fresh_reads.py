"""Reading a checkpoint's storages into fresh private memory through the calling
process's own kernel queue: the road of ``nvmeswap.load`` and ``load_safetensors``
called without a handle.

Note [fresh private reads]
A load that makes the memory its tensors live in needs nothing of a handle: its
workers reach only shared memory, and fresh shared memory is made and locked at 0.6 to
0.8 s a GiB here, in 4 KiB pages (Note [parallel population] in pyx/_memory.pyx), more
than reading the bytes. Private anonymous memory, torch's own kind, costs half that
(0.32 s a GiB here: the page faults). So such a load maps private memory, one mapping
per group of storages (Note [checkpoint reads]), and reads into it with O_DIRECT from
the calling process's own queue (the caller queue of Note [caller queue], on the engine
the environment names: kernel AIO or io_uring): aligned requests of 1 MiB, 64 in
flight, the kernel faulting the pages in as it pins them for the transfer. Each mapping
is locked once read, its pages present by then (milliseconds a GiB). No worker starts
or stops. A cold 0.69 GiB archive on the memory-backed device: 0.36 s, against 0.68 to
0.84 s through a handle's locked buffers and 0.31 to 0.46 s for ``torch.load``, which
pays the same faults (docs/checkpoints.md).

The pages are torch's kind too: 4 KiB, or 2 MiB where the kernel's THP setting is
"always" or where ``THP_MEM_ALLOC_ENABLE=1`` asks torch to advise its own large
allocations (then the mappings are advised for huge pages, MADV_HUGEPAGE). Huge pages
are not asked for otherwise: on a virtual machine whose balloon reports free memory to
its host (this one), the free 2 MiB blocks huge pages are made of are the ones the host
has taken back, and the same load took 0.17 to 0.55 s with them, ``torch.load`` 1.06 to
1.36 s.

A handle given by the caller still gets the storages in its locked set, zero-copy for
it. Where CUDA is in use, a buffer holding storages bound for a GPU is registered with
CUDA while they are copied (Note [own queue and CUDA] in own_queue.py): copies from
registered memory run about nine times faster than from private memory (shared/GPU.md).
"""
from __future__ import annotations

import os
import threading
from typing import Any

from .._memory import buffer_address
from ..io.files import open_target
from ..io.interrupts import deferred_interrupts
from ..units import ALIGNMENT, round_up
from .own_queue import OwnQueue, lock, private_memory, read_requests

#: torch's switch for advising its own large allocations to use huge pages.
TORCH_THP = "THP_MEM_ALLOC_ENABLE"


class FreshReads:
    """Each ``(start, end)`` of ``groups`` (``start`` aligned) of the file at ``paths[0]``
    (a path or a descriptor), or of the file striped over ``paths`` (one per device, Note
    [stripes]) in stripes of ``stripe_bytes``, read into a fresh uint8 tensor of its own,
    locked once read. The reads are in flight on a thread of their own from the start
    (Note [reads beside the pickle] in loading.py): ``buffers`` at once, the bytes
    arriving; ``wait_for(group, upto)`` until a group's first bytes are read, ``wait()``
    until all are and the memory is locked; either raises the reads' first failure. The
    files are opened and the memory mapped before it returns."""

    def __init__(self, paths: list[int | str], stripe_bytes: int | None,
                 groups: list[tuple[int, int]]) -> None:
        import torch

        self.files: list[Any] = []
        self.memory: list[Any] = []
        self.own: OwnQueue | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.stopped = False        # no more requests to start: the load has failed
        self.read_upto = [0] * len(groups)      # each group's bytes read from its start
        self._ended: list[dict[int, int]] = [{} for _ in groups]   # start -> end, past it
        self._progress = threading.Condition()
        huge_pages = os.environ.get(TORCH_THP, "").strip().lower() in ("1", "on", "true", "yes")
        try:
            for path in paths:
                self.files.append(open_target(path, for_write=False, offset=0, nbytes=0,
                                              o_direct=None))
            for start, end in groups:
                self.memory.append(private_memory(round_up(end - start, ALIGNMENT),
                                                  huge_pages=huge_pages))
            if groups:
                self.own = OwnQueue(f"reading {self.files[0].name}")
            self.buffers = [torch.frombuffer(mapping, dtype=torch.uint8)[:end - start]
                            for mapping, (start, end) in zip(self.memory, groups)]
            self.thread = threading.Thread(target=self._run, args=(stripe_bytes, groups),
                                           name="nvmeswap-load", daemon=True)
            self.thread.start()
        except BaseException:
            self._close()
            raise

    def _run(self, stripe_bytes, groups):
        try:
            if self.own is not None:
                self._read(self._requests(stripe_bytes, groups))
        except BaseException as error:
            self.error = error
        finally:
            try:
                self._close()       # waits for the requests in flight: into the memory
            except BaseException as error:
                self.error = self.error or error
        try:
            if self.error is None:
                for mapping in self.memory:
                    lock(mapping, f"{self.files[0].name}: the loaded tensors")
        except BaseException as error:
            self.error = error
        finally:
            with self._progress:
                self.finished = True
                self._progress.notify_all()

    def _requests(self, stripe_bytes, groups):
        """``(file, file offset, address, length, bytes needed, (group, start, end))``
        of each request, the last its place in its group's memory."""
        for group, (mapping, (start, end)) in enumerate(zip(self.memory, groups)):
            base, _ = buffer_address(mapping, True)
            for request in read_requests(self.files, stripe_bytes, start,
                                         start + round_up(end - start, ALIGNMENT), base, end):
                at = request[2] - base
                yield (*request, (group, at, at + request[3]))

    def _read(self, requests):
        """Keep the queue full of ``requests`` until all have ended, moving each group's
        ``read_upto`` on; the first failure, or a read that ends short of the bytes it
        needs, raises (naming the file)."""
        own = self.own
        pending = next(requests, None)
        while True:
            if self.stopped:
                pending = None
            if pending is None and not own.requests:
                break
            while pending is not None:
                file, *request = pending   # offset, address, length, needed, owner
                if not own.submit(file, True, *request):
                    break
                pending = next(requests, None)
            for (group, at, end), error in own.reap():
                if error is not None:
                    raise error
                self._ended_read(group, at, end)
        if self.stopped:
            raise RuntimeError(f"{self.files[0].name}: the reads were stopped")

    def _ended_read(self, group, at, end):
        ended = self._ended[group]
        ended[at] = end
        upto = self.read_upto[group]
        if upto in ended:
            while upto in ended:
                upto = ended.pop(upto)
            with self._progress:
                self.read_upto[group] = upto
                self._progress.notify_all()

    def _close(self):
        with deferred_interrupts():
            try:
                if self.own is not None:
                    self.own.close()
            finally:
                for file in self.files:
                    file.close()

    def wait_for(self, group: int, upto: int) -> None:
        """Until bytes ``[0, upto)`` of ``group`` are read."""
        with self._progress:
            while self.read_upto[group] < upto and not self.finished:
                self._progress.wait()
        if self.read_upto[group] < upto:
            raise self.error or AssertionError(f"bytes {upto} of group {group} were not read")

    def stop(self) -> None:
        """Start no more requests (those in flight end as they will): the load failed."""
        self.stopped = True

    def wait(self) -> list[Any]:
        """The buffers, every byte read and the memory locked; or the reads' error."""
        with self._progress:    # not join() alone: a Ctrl-C in it can mark the thread ended
            while not self.finished:
                self._progress.wait()
        self.thread.join()      # the thread's last step: it ends now
        if self.error is not None:
            raise self.error
        return self.buffers
