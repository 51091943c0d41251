"""The calling process's own kernel queue, for the checkpoint calls made without a
handle, and DCP's storage made without one: loads into fresh private memory (Note
[fresh private reads], fresh_reads.py), saves through a ring of private memory (Note
[saves without a handle]), and reads into given tensors through one (``QueueReader``).

Note [saves without a handle]
``nvmeswap.save`` and ``save_safetensors`` called without a handle used to start one
for the call: workers started (20 to 44 ms here) and stopped (35 to 60 ms), and a ring
of 64 MiB of shared memory locked for them (40 to 200 ms), a fifth to a third of a 1
GiB save. Only the ring's writes need the kernel, and O_DIRECT writes need no worker:
``QueueWriter`` gives ``StreamWriter`` (image.py) its ring as private memory, locked,
and writes each slot with the calling process's own queue (requests of 1 MiB, at most
64 in flight; the unaligned tail of a file, under 4096 bytes, with one buffered write,
as Note [O_DIRECT tail]). The ring copies, the CRCs and the commit are the
Checkpointer's own. A ``Checkpointer`` made without a handle saves this way too, its
ring kept from one save to the next; where it stripes, the one queue has requests to
every stripe file in flight together (a ``StripedHandle`` started a handle, two
workers, per device).

Note [kept kernel queues]
Freeing a kernel AIO context (io_destroy) takes 32 ms here, whatever it did: the kernel
waits out an RCU grace period. A queue made and freed for each call made a 1 MiB
``nvmeswap.load`` take 32 ms and ``nvmeswap.save`` 56 ms, where ``torch.load`` took
0.8 ms and ``torch.save`` 1.7 ms (io_uring's rings free at once: 1.7 ms and 8.8 ms,
fsync included). So a queue that ends idle, nothing in flight, is kept for the next
call (up to ``KEPT_IDLE`` of each engine: one per thread that calls at once), and only
one that a failure or a Ctrl-C left with requests in flight is freed (which waits for
them). A kept queue is an eventfd and a context of 64 requests counted against
fs.aio-max-nr (an io_uring ring: its descriptor); ``release_idle_queues()`` frees
them, and a forked child starts with none (Note [process state]).

Note [own queue and CUDA]
Where CUDA was in use, these calls used to start a handle, for its locked buffers are
registered with CUDA: on an H100 VM a one-call save or load of 256 MiB of CUDA state
spent 100 to 135 ms starting and stopping the handle's workers and queue, and a load
130 ms more locking shared memory for its buffers and 47 ms freeing them, against
0.08 s for all of ``torch.load`` from the page cache (measured 2026-11-27). They keep
to the process's own queue now, and register with CUDA the private memory that copies
to or from a GPU go through, as the handle does its own (``Registration``): the
save's ring and a kept ``Checkpointer``'s snapshot, ``QueueReader``'s ring, and a
load's buffers that storages bound for a GPU lie in; each is unregistered before its
memory goes (registration pins pages: the driver would hold them past an unmap).
There, for 256 MiB of CUDA state on the VM's disk: ``nvmeswap.load`` 0.34-0.41 ->
0.25 s, ``nvmeswap.save`` 0.36-0.41 -> 0.23-0.35 s; registering a load's four buffers
took 13 ms, unregistering them 5 ms (cProfile of one process, 2026-11-27).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import mmap
import os
import select
import threading
from collections.abc import Iterator
from typing import Any

from .._memory import buffer_address, copy_memory, lock_range
from ..errors import (
    MemoryLockWarning,
    aio_contexts_exhausted,
    uring_setup_refused,
    warn_once,
)
from ..gpu.copies import register_range
from ..io import process_state
from ..io.engines import caller_queue_type, checked_engine, resolve
from ..io.files import open_target
from ..io.interrupts import deferred_interrupts
from ..io.operation import transfer_error
from ..locked_tensors import registers_with_cuda_now
from ..units import ALIGNMENT
from .stripes import StripeSet, stripe_pieces

REQUEST_BYTES = 1 << 20
IN_FLIGHT = 64
KEPT_IDLE = 2


class _IdleQueues:
    """The process's idle kernel queues, by engine (Note [kept kernel queues])."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: dict[str, list[Any]] = {}

    def take(self, engine: str) -> Any:
        with self.lock:
            kept = self.idle.get(engine)
            return kept.pop() if kept else None

    def give(self, engine: str, queue: Any) -> None:
        with self.lock:
            kept = self.idle.setdefault(engine, [])
            if len(kept) < KEPT_IDLE:
                kept.append(queue)
                return
        queue.close()

    def release(self) -> None:
        with self.lock:
            queues = [queue for kept in self.idle.values() for queue in kept]
            self.idle.clear()
        for queue in queues:
            queue.close()


def release_idle_queues() -> None:
    """Free the kernel queues kept idle between calls (Note [kept kernel queues])."""
    process_state.shared(_IdleQueues).release()


class OwnQueue:
    """A caller queue (Note [caller queue] in io/workforce.py) on the engine the
    environment names, each request kept with its file, so that a failure names it.
    ``close()`` waits for what is in flight: until then its memory must stay. It is the
    process's that made it: a forked child is refused it (its kernel AIO context is not
    the child's; an io_uring ring would be shared with the parent)."""

    def __init__(self, what: str) -> None:
        self.engine = resolve(checked_engine(None))
        self.queue = process_state.shared(_IdleQueues).take(self.engine)
        if self.queue is None:
            try:
                self.queue = caller_queue_type(self.engine)(IN_FLIGHT)
            except OSError as error:
                refused = uring_setup_refused if self.engine == "uring" else \
                    aio_contexts_exhausted
                raise refused(error.errno, f" for {what}") from None
        self.requests: dict[int, tuple] = {}    # id -> (file, is_read, offset, needed, owner)
        self._ids = itertools.count()
        self.creator = process_state.pid

    def submit(self, file: Any, is_read: bool, offset: int, address: int, length: int,
               needed: int, owner: Any = None) -> bool:
        """Start one request; False if the queue is full. ``needed``: how many of its
        bytes must move (a read may end short past them, at the file's end)."""
        if process_state.pid != self.creator:
            raise RuntimeError(f"this kernel queue belongs to process {self.creator}, not "
                               f"to this forked child ({file.name})")
        request = next(self._ids)
        if not self.queue.submit(request, 0, is_read, file.direct_fd, address, length,
                                 offset):
            return False
        self.requests[request] = file, is_read, offset, needed, owner
        return True

    def reap(self) -> list[tuple[Any, BaseException | None]]:
        """Wait for requests to end: ``(owner, None or the error naming its file)`` of
        each that did."""
        done = self.queue.reap(False)
        if not done:
            select.select([self.queue.eventfd], [], [])
        return [self._outcome(completion) for completion in done]

    def _outcome(self, completion):
        file, is_read, offset, needed, owner = self.requests.pop(completion.op_id)
        if completion.err:
            return owner, transfer_error(file.name, is_read, completion.err,
                                         completion.at_offset, completion.requested,
                                         completion.got)
        if completion.got >= needed:
            return owner, None
        return owner, transfer_error(file.name, is_read, 0, offset, needed, completion.got)

    def close(self) -> None:
        """Keep the queue for the next call if nothing is in flight, else free it, which
        waits for what is (Note [kept kernel queues]); idempotent."""
        with deferred_interrupts():
            queue, self.queue = self.queue, None
            if queue is None:
                return
            if not self.requests and not queue.in_flight and \
                    process_state.pid == self.creator:
                process_state.shared(_IdleQueues).give(self.engine, queue)
            else:
                queue.close()


def read_requests(files: list[Any], stripe_bytes: int | None, start: int, end: int,
                  address: int, needed_end: int):
    """``(file, file offset, address, length, bytes needed)`` of the requests of at most
    1 MiB that read bytes ``start`` to ``end`` (both aligned) of a file, or of one
    striped over ``files`` in stripes of ``stripe_bytes`` (Note [stripes]), to memory
    at ``address``. Bytes past ``needed_end`` are there for alignment only: a read may
    end short of them, at the end of the file."""
    for at in range(start, end, REQUEST_BYTES):
        length = min(REQUEST_BYTES, end - at)
        needed = min(length, max(0, needed_end - at))
        into = address + at - start
        if stripe_bytes is None:
            yield files[0], at, into, length, needed
            continue
        for device, offset, within, piece in stripe_pieces(len(files), stripe_bytes,
                                                           length, at):
            yield (files[device], offset, into + within, piece,
                   min(piece, max(0, needed - within)))


def _open_once(pieces):
    """``{path: TargetFile}`` of the files that ``(path, offset, _, length)`` pieces go
    to, each opened once over the span of its pieces (so that only a span that ends
    unaligned, the file's end, gets a buffered descriptor for its tail). On a failure
    none stays open."""
    spans: dict[str, tuple[int, int]] = {}
    for path, offset, _, length in pieces:
        start, end = spans.get(path, (offset, offset + length))
        spans[path] = min(start, offset), max(end, offset + length)
    files: dict[str, Any] = {}
    try:
        for path, (start, end) in spans.items():
            files[path] = open_target(path, for_write=True, offset=start, nbytes=end - start,
                                      o_direct=None)
    except BaseException:
        for file in files.values():
            file.close()
        raise
    return files


def private_memory(nbytes: int, *, huge_pages: bool = False) -> mmap.mmap:
    """Fresh private anonymous memory of ``nbytes``, not yet touched; advised for huge
    pages if asked."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if huge_pages:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):   # a kernel without THP: 4 KiB pages
            pass
    return mapping


def private_tensor(nbytes: int, *, locked: bool) -> Any:
    """A uint8 tensor of ``nbytes`` of fresh private memory (page-aligned: O_DIRECT
    reaches it), page-locked if ``locked``; its memory goes with the tensor."""
    import torch

    mapping = private_memory(nbytes)
    if locked:
        lock(mapping, "a save's buffers")
    return torch.frombuffer(mapping, dtype=torch.uint8)


class Registration:
    """``tensor``'s private memory registered with CUDA for DMA copies where CUDA is in
    use (Note [own queue and CUDA]), for as long as this lives or until ``release()``
    (idempotent). It holds the tensor, so the memory cannot go while it is registered;
    dropped unreleased, it unregisters first. Only the process that registered it
    unregisters: a forked child leaves the parent's to the parent."""

    __slots__ = ("_pid", "_unregister", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self._pid = os.getpid()
        self._unregister = None
        self.ensure()

    def ensure(self) -> None:
        """Register it now if CUDA has come into use since (memory kept from before)."""
        tensor = self.tensor
        if self._unregister is None and tensor is not None and tensor.numel() and \
                os.getpid() == self._pid and registers_with_cuda_now():
            self._unregister = register_range(tensor.data_ptr(),
                                              tensor.numel() * tensor.element_size())

    def release(self) -> None:
        unregister, self._unregister, self.tensor = self._unregister, None, None
        if unregister is not None and os.getpid() == self._pid:
            unregister()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:   # at interpreter exit CUDA may be gone; the memory goes with it
            pass


def lock(mapping: mmap.mmap, name: str) -> None:
    """Page-lock ``mapping``; where the system refuses, one warning and it stays unlocked."""
    address, nbytes = buffer_address(mapping, True)
    try:
        lock_range(address, nbytes)
    except OSError as error:
        warn_once("own-queue-lock", f"{name}: page-locking was refused ({error.strerror}); "
                  "the memory stays unlocked (raise `ulimit -l`)", MemoryLockWarning)


class _Write:
    """One ``submit_pwrite``: done when its requests are; holds its files open until then."""

    def __init__(self, writer: QueueWriter, files: dict[str, Any]) -> None:
        self.writer = writer
        self.files = files          # path -> TargetFile
        self.left = 0
        self.error: BaseException | None = None

    def result(self) -> None:
        while self.left:
            self.writer.settle()
        self.writer.forget(self)
        if self.error is not None:
            raise self.error


class QueueWriter:
    """The part of ``aio_handle`` that ``StreamWriter`` uses, through an ``OwnQueue``
    (Note [saves without a handle]): locked tensors of private memory, and
    ``submit_pwrite`` of one of them, whose future's ``result()`` waits for its
    requests; with ``stripes`` (a StripeSet), to the logical files striped over its
    folders (Note [stripes]). A reap cut short (a Ctrl-C) ends every write in flight
    with that error; the next ``submit_pwrite`` starts a fresh queue. ``close()`` waits
    for what is in flight and closes every file."""

    def __init__(self, what: str, stripes: StripeSet | None = None) -> None:
        self._what = what
        self.own = OwnQueue(what)
        self.stripes = stripes
        self._writes: list[_Write] = []
        self._interrupted: BaseException | None = None
        self._registered: dict[int, Registration] = {}    # by address

    def new_cpu_locked_tensor(self, nbytes: int, example: Any) -> Any:
        tensor = private_tensor(nbytes, locked=True)
        self._registered[tensor.data_ptr()] = Registration(tensor)
        return tensor

    def ensure_registered(self) -> None:
        """Register its tensors with CUDA where CUDA has come into use since they were
        made (a kept ring)."""
        for registration in self._registered.values():
            registration.ensure()

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Unregister it from CUDA if it was; its memory goes with the tensor."""
        registration = self._registered.pop(tensor.data_ptr(), None)
        if registration is not None:
            registration.release()
        return True

    def submit_pwrite(self, buffer: Any, filename: str, file_offset: int) -> _Write:
        """Start writing ``buffer`` at ``file_offset`` (aligned, as the ring's slots are)."""
        if self._interrupted is not None:
            self._recover()
        nbytes = buffer.numel()
        if self.stripes is None:
            pieces = [(filename, file_offset, 0, nbytes)]
        else:
            paths = self.stripes.paths(filename)
            pieces = [(paths[device], offset, at, length) for device, offset, at, length
                      in self.stripes.pieces(nbytes, file_offset)]
        write = _Write(self, _open_once(pieces))
        self._writes.append(write)
        for path, offset, at, length in pieces:
            self._write_piece(write, write.files[path], offset, buffer[at:at + length])
        return write

    def _write_piece(self, write, file, offset, piece):
        nbytes = piece.numel()
        address = piece.data_ptr()
        direct = nbytes - (offset + nbytes) % file.alignment
        for at in range(0, direct, REQUEST_BYTES):
            length = min(REQUEST_BYTES, direct - at)
            while not self.own.submit(file, False, offset + at, address + at, length,
                                      length, write):
                self.settle()
            write.left += 1
        if direct < nbytes:         # the file's unaligned end (Note [O_DIRECT tail])
            tail = piece[direct:].numpy().tobytes()
            err, wrote = 0, 0
            try:
                wrote = os.pwrite(file.buffered_fd, tail, offset + direct)
            except OSError as error:
                err = error.errno
            if err or wrote != len(tail):
                write.error = write.error or transfer_error(
                    file.name, False, err, offset + direct, len(tail), wrote)

    def settle(self) -> None:
        """Wait for some requests to end, each counted against its write. Once a reap has
        been cut short (a Ctrl-C), completions may have gone uncounted: the next call
        waits for everything in flight instead and ends every write with that error."""
        if self._interrupted is None:
            try:
                for write, error in self.own.reap():
                    write.left -= 1
                    write.error = write.error or error
            except BaseException as error:
                self._interrupted = error
                raise
            return
        self.own.close()
        for write in self._writes:
            write.left = 0
            write.error = write.error or self._interrupted

    def _recover(self):
        """After a reap cut short: wait for what is in flight, end every write with
        that error and close its files, then a fresh queue for the writes to come (a
        kept Checkpointer's next save)."""
        self.settle()
        for write in list(self._writes):
            self.forget(write)
        self.own = OwnQueue(self._what)
        self._interrupted = None

    def close_files(self) -> None:
        """Close this process's descriptors of every write's files, and nothing else: in
        a forked child, whose parent's writes are the parent's."""
        for write in self._writes:
            for file in write.files.values():
                file.close()

    def forget(self, write: _Write) -> None:
        if write in self._writes:
            self._writes.remove(write)
            for file in write.files.values():
                file.close()

    def close(self) -> None:
        self.own.close()
        for write in list(self._writes):
            self.forget(write)
        registered, self._registered = self._registered, {}
        for registration in registered.values():
            registration.release()

    def __enter__(self) -> QueueWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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
