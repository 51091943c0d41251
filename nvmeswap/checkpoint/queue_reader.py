"""Reads into given tensors through the calling process's own kernel queue:
``QueueReader``, what ``load_into``, ``load_safetensors_into`` and DCP's reader read with
where no handle was given, and ``reader_of``, which picks it or the handle."""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any

from .._memory import copy_memory
from ..io.files import open_target
from ..units import ALIGNMENT
from .own_queue import OwnQueue, Registration, private_memory, read_requests


@contextlib.contextmanager
def reader_of(handle: Any) -> Iterator[Any]:
    """What reads into given tensors (``async_pread``, ``sync_pread``, ``wait``) for the
    time of the block: ``handle``, or where it is None a ``QueueReader`` of the
    process's own queue, closed after the block."""
    if handle is not None:
        yield handle
        return
    with QueueReader() as reader:
        yield reader


def copy_into(target: Any, view: Any, at: int = 0) -> None:
    """``view``'s bytes (a uint8 tensor over locked or registered memory) into
    ``target``'s, from byte ``at`` of it."""
    import torch

    nbytes = view.numel()
    if target.device.type == "cpu":
        copy_memory(target.data_ptr() + at, view.data_ptr(), nbytes)
    else:       # a GPU's tensor: DMA, the ring being registered (Note [own queue and CUDA])
        target.view(-1).view(torch.uint8)[at:at + nbytes].copy_(view)


def _copy_to_place(places: list[tuple[Any, int]], index: int, view: Any) -> None:
    """``view`` into ``places[index]``: a target tensor, from a byte of it."""
    target, at = places[index]
    copy_into(target, view, at)


class QueueReader:
    """The part of ``aio_handle`` that ``load_into``, ``load_safetensors_into`` and DCP's
    reader use (``async_pread``, ``sync_pread``, ``wait``), through an ``OwnQueue`` (made
    at the first ``wait()``). The reads asked for are made at ``wait()``: each target's
    bytes with O_DIRECT into a ring of ``slots`` private buffers of ``slot_bytes``, in
    aligned windows, copied into the target as each window lands (a tensor's own memory
    is not aligned for O_DIRECT: torch places its large tensors 64 bytes past a page). A
    file named in ``stripe()`` is read from its stripe files (Note [stripes]).
    ``close()`` waits for what is in flight."""

    def __init__(self, slot_bytes: int = 16 << 20, slots: int = 4) -> None:
        self.own: OwnQueue | None = None      # made by the first wait()
        self.slot_bytes, self.slots = slot_bytes, slots
        self.ring: Any = None
        self._ring_registration: Registration | None = None
        self._jobs: list[tuple[Any, str, int]] = []
        self._ranges: list[tuple[str, list[tuple[int, int]], Any]] = []
        self._stripes: dict[str, tuple[list[str], int]] = {}
        self._files: dict[str, Any] = {}

    def stripe(self, filename: str, paths: list[str], stripe_bytes: int) -> None:
        """Read ``filename`` from ``paths``, one per device, in stripes of ``stripe_bytes``."""
        self._stripes[filename] = paths, stripe_bytes

    def async_pread(self, target: Any, filename: str, file_offset: int) -> int:
        self._jobs.append((target, filename, file_offset))
        return 0

    @property
    def range_bytes(self) -> int:
        """The most bytes one range of ``read_ranges`` may span."""
        return self.slot_bytes - 2 * ALIGNMENT

    def read_ranges(self, filename: str, ranges: list[tuple[int, int]], land: Any) -> None:
        """At the next ``wait()``, read each ``(start, end)`` of ``ranges`` (file offsets in
        increasing order, none longer than ``range_bytes``), ranges lying close together
        in one request, and call ``land(index, view)`` with ``view`` a uint8 tensor over
        the ring's copy of bytes ``[start, end)`` of range ``index``, as they land (a
        record found by its header in the bytes read: Note [headers in the reads] in
        loading.py). What ``land`` raises fails the ``wait()``."""
        self._ranges.append((filename, ranges, land))

    def wait(self) -> int:
        """Make every read asked for; the first failure raises once all have ended."""
        import torch

        jobs, self._jobs = self._jobs, []
        ranges, self._ranges = self._ranges, []
        if not jobs and not ranges:
            return 0
        if self.own is None:
            self.own = OwnQueue(f"reading {self._name(jobs[0][1] if jobs else ranges[0][0])}")
        if self.ring is None:
            mapping = private_memory(self.slot_bytes * self.slots)
            self.ring = torch.frombuffer(mapping, dtype=torch.uint8)
            self._ring_registration = Registration(self.ring)
        count = len(jobs) + sum(len(asked[1]) for asked in ranges)
        windows = itertools.chain.from_iterable(
            self._windows(*asked) for asked in ranges + self._targets_ranges(jobs))
        free = list(range(self.slots))
        landing: dict[int, list] = {}       # slot -> [requests left, window]
        unsubmitted: collections.deque = collections.deque()
        first = None
        window = next(windows, None)
        while (window is not None and first is None) or landing:
            while window is not None and free and first is None:
                slot = free.pop()
                requests = self._requests(slot, window)
                if requests:
                    landing[slot] = [len(requests), window]
                    unsubmitted.extend(requests)
                else:       # nothing to read (an empty range): landed already
                    free.append(slot)
                    first = self._land(slot, window)
                window = next(windows, None)
            while unsubmitted and self.own.submit(*unsubmitted[0]):
                unsubmitted.popleft()
            for slot, error in self.own.reap():
                landing[slot][0] -= 1
                first = first or error
                if landing[slot][0] == 0:
                    landed = landing.pop(slot)[1]
                    if first is None:
                        first = self._land(slot, landed)
                    free.append(slot)
        if first is not None:
            raise first
        return count

    def _targets_ranges(self, jobs):
        """``read_ranges``' arguments for the targets of ``jobs``, a file's in file order,
        each target's bytes as one range, or as pieces of a range where it is larger;
        small ones lying close are then read several to a request (2000 small tensors
        were 2000 requests, 4 in flight)."""
        piece = self.range_bytes
        pieces: dict[str, list[tuple[int, int, Any, int]]] = {}
        for target, filename, file_offset in jobs:
            nbytes = target.numel() * target.element_size()
            for at in range(0, nbytes, piece):
                pieces.setdefault(filename, []).append(
                    (file_offset + at, file_offset + min(nbytes, at + piece), target, at))
        asked = []
        for filename, held in pieces.items():
            held.sort(key=lambda found: found[0])
            places = [(target, at) for _, _, target, at in held]
            asked.append((filename, [(start, end) for start, end, _, _ in held],
                          functools.partial(_copy_to_place, places)))
        return asked

    def _windows(self, filename, ranges, land):
        """``(length, file, file offset, land, [(index, start, end)])``: ``ranges``
        gathered into windows no larger than a slot, a window taking the next range while
        the gap to it is small against a slot (what the gap holds is read too)."""
        piece, gap = self.range_bytes, self.range_bytes // 16
        held: list[tuple[int, int, int]] = []
        held_end = 0
        for index, (start, end) in enumerate(ranges):
            if end - start > piece:
                raise ValueError(f"a range of {end - start} bytes is more than a slot")
            if held and (max(end, held_end) - held[0][1] > piece or start - held_end > gap):
                yield held_end - held[0][1], filename, held[0][1], land, held
                held = []
            held_end = max(end, held_end) if held else end
            held.append((index, start, end))
        if held:
            yield held_end - held[0][1], filename, held[0][1], land, held

    def _requests(self, slot, window):
        """The requests (``OwnQueue.submit``'s arguments) that read ``window`` into ``slot``."""
        length, filename, offset = window[:3]
        start = offset // ALIGNMENT * ALIGNMENT
        end = -(-(offset + length) // ALIGNMENT) * ALIGNMENT
        paths, stripe_bytes = self._stripes.get(filename, ([filename], None))
        files = [self._file(path) for path in paths]
        address = self.ring.data_ptr() + slot * self.slot_bytes
        return [(file, True, file_offset, into, size, needed, slot)
                for file, file_offset, into, size, needed
                in read_requests(files, stripe_bytes, start, end, address, offset + length)]

    def _name(self, filename):
        """How errors name ``filename`` (a descriptor is named by its file's path)."""
        return filename if filename in self._stripes else self._file(filename).name

    def _file(self, path):
        if path not in self._files:
            self._files[path] = open_target(path, for_write=False, offset=0, nbytes=0,
                                            o_direct=None)
        return self._files[path]

    def _land(self, slot, window):
        """Hand each range of ``window``, read into ``slot``, to its ``land``; what that
        raises (a record's header found wrong, say), or None."""
        _, _, offset, land, held = window
        base = slot * self.slot_bytes + offset % ALIGNMENT - offset
        try:
            for index, start, end in held:
                land(index, self.ring[base + start:base + end])
        except Exception as failure:
            return failure
        return None

    def sync_pread(self, target: Any, filename: str, file_offset: int) -> int:
        self.async_pread(target, filename, file_offset)
        self.wait()
        return 1

    def close(self) -> None:
        try:
            if self.own is not None:
                self.own.close()    # waits for the requests in flight, before the ring goes
        finally:
            for file in self._files.values():
                file.close()
            self._files.clear()
            registration, self._ring_registration = self._ring_registration, None
            if registration is not None:
                registration.release()
            self.ring = None

    def __enter__(self) -> QueueReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
