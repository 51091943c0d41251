"""The calling process's own kernel queue, for the checkpoint calls made without a
handle, and DCP's storage made without one: loads into fresh private memory (Note
[fresh private reads], fresh_reads.py), saves through a ring of private memory
(``QueueWriter``, queue_writer.py), and reads into given tensors through one
(``QueueReader``, queue_reader.py); and the private memory they use, registered with
CUDA where it is in use.

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

import itertools
import mmap
import os
import select
import threading
from typing import Any

from .._memory import buffer_address, lock_range
from ..errors import (
    MemoryLockWarning,
    aio_contexts_exhausted,
    uring_setup_refused,
    warn_once,
)
from ..gpu.copies import register_range
from ..io import process_state
from ..io.engines import caller_queue_type, checked_engine, resolve
from ..io.interrupts import deferred_interrupts
from ..io.operation import transfer_error
from ..locked_tensors import registers_with_cuda_now
from .stripes import stripe_pieces

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
        # Held back from a Ctrl-C: a request the kernel has must be in the books.
        with deferred_interrupts():
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
