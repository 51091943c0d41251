"""The scheduler: routes each operation, hands its requests to the workers or the
caller queue, reads their responses, and completes operations for ``wait()``. Both
handles run on it.

The road of one operation (Note [roads] in io/roads.py): ``_try_quick`` (a quick road,
or none) -> ``open_operation`` (checks, file) -> ``placement.place`` (memory and chunk
plan) -> ``route`` -> the calling thread (INLINE), or ``Books.book`` (io/books.py: sent
where its road goes, held behind earlier ones, completed from the responses) -> ``run``
or ``collect``. A batch (Note [batches]) is checked and opened once, then booked slice by
slice.
"""
import functools
import itertools
import os
import threading
import warnings

from .._transfers import post_to_run, transfer_in_caller
from ..errors import WorkerDied, caller_stacklevel
from . import process_state
from .batch import SLICE, BatchOperation, checked_requests
from .books import Books
from .files import open_target
from .futures import Future
from .interrupts import deferred_interrupts
from .operation import open_operation, writes
from .ordering import QuickSyncOperation
from .quick import QuickReadRun, ReadDescriptors, candidate, names_the_runs_file, quick_transfer
from .roads import Facts, Memory, Road, route
from .workforce import Workforce, chunks_in_flight_limit


class Scheduler:
    """One handle's operations in flight, its workers, and the memory it shares with them.

    Holds no reference to the handle, so a finalizer can release it (``release``).
    """

    def __init__(self, placement, parallelism, engine_settings, o_direct, limits):
        self.placement = placement
        self.limits = limits
        self.workers = Workforce(placement, parallelism, engine_settings, limits)
        self.closed = False
        self.creator_pid = os.getpid()
        self._o_direct = o_direct
        self._cond = threading.Condition()
        self.books = Books(placement, self.workers, self._cond)
        self._op_ids = itertools.count(1)
        self._read_descriptors = ReadDescriptors()     # Note [shared read descriptors]
        self._max_chunks = chunks_in_flight_limit(limits)
        self._inline = 0        # operations running in their callers' threads
        with self._cond:
            self._running_pool()

    # -- what the handles call ----------------------------------------------------------
    def run(self, buffer, target, file_offset, *, is_read, validate):
        """A synchronous operation: returns 1, or raises its error.

        Interrupted while it runs, the operation goes on, and its error is dropped.
        """
        if not validate and self._try_quick(buffer, target, file_offset, is_read, False):
            return 1
        op = self._begin(buffer, target, file_offset, is_read, validate, is_async=False)
        self.books.wait_until(op.is_done)
        error = op.error
        if error is None:
            return 1
        del op      # Note [no reference cycle] in collect()
        try:
            raise error
        finally:
            del error

    def submit(self, buffer, target, file_offset, *, is_read, validate):
        """Start an operation that ``collect()`` completes."""
        if is_read and not validate:
            if not self._has_room():    # back-pressure first: then it may go a quick road
                self.books.wait_until(self._has_room)
            if self._try_quick(buffer, target, file_offset, True, True):
                return
        self._begin(buffer, target, file_offset, is_read, validate, is_async=True)

    def submit_future(self, buffer, target, file_offset, *, is_read):
        """Start an operation of its own, which ``wait()`` does not collect."""
        return Future(self.books, self._begin(buffer, target, file_offset, is_read, False,
                                              is_async=True, for_wait=False))

    def submit_many(self, buffers, target, offsets, lengths, *, is_read):
        """Start a batch (Note [batches]): its requests checked and its file opened before
        any I/O, then booked slice by slice."""
        requests = checked_requests(buffers, offsets, lengths, is_read=is_read)
        start = min(request.offset for request in requests)
        end = max(request.offset + request.nbytes for request in requests)
        file = None
        try:
            # Inside the try: a Ctrl-C held back to the block's end leaves nothing open.
            with deferred_interrupts():
                file = open_target(target, for_write=not is_read, offset=start,
                                   nbytes=end - start, o_direct=self._o_direct,
                                   written_end=self.books.written_end)
            past_limit = None if is_read else file.past_size_limit(start, end - start)
            if past_limit is not None:      # every request is checked before any I/O
                raise past_limit
            size = max(1, min(SLICE, self._max_chunks // 2))
            for first in range(0, len(requests), size):
                part = requests[first:first + size]
                if not self._has_room(len(part)):
                    self.books.wait_until(functools.partial(self._has_room, len(part)))
                op = None
                try:
                    with deferred_interrupts():
                        op = BatchOperation(next(self._op_ids), is_read, part,
                                            file.duplicate())
                        writes().start(op)
                    self._start_batch(op, target)
                except BaseException:
                    if op is not None and not op.started and not op.done:
                        self.books.abandon(op)
                    raise
        finally:
            if file is not None:
                file.close()

    def _start_batch(self, op, target):
        """Route a slice of a batch: booked whole, or each request on its own road."""
        with deferred_interrupts(), self._cond:
            self.check_usable()
            op.road = route(self._batch_facts(op), self.limits.roads)
            if op.road is Road.BATCH:
                self.books.book(op, is_async=True)
                return
        writes().end(op, False, 0)      # nothing of it has started, nor grown the file
        op.file.close()
        op.done = True
        for request in op.requests:
            self._begin(request.buffer, target, request.offset, op.is_read, False,
                        is_async=True)

    def _batch_facts(self, op):
        alignment, locked = op.file.alignment, self.placement.locked
        requests = op.requests
        aligned = all(request.address % alignment == 0 and request.offset % alignment == 0
                      and request.nbytes % alignment == 0 for request in requests)
        in_locked = all(request.buffer.device is None
                        and locked.containing(request.address, request.nbytes) is not None
                        for request in requests)
        return Facts(True, True, op.is_read, max(op.lengths()),
                     self.placement.host_inline_limit, aligned,
                     Memory.LOCKED if in_locked else Memory.HOST, bool(self.books.ops),
                     self._queue_room(len(requests)), batch=True)

    def collect(self):
        """Wait for the operations the calling thread started; return how many, or raise
        the first failure.

        Each operation is counted once: by its own thread's ``collect()``, or, once its
        thread has ended, by any thread's. A thread that started none takes everyone's
        (an operation handed to another thread to wait for: that thread's ``wait()``
        counts it and raises its failure). A thread's ``collect()`` never returns while an
        operation it started is in flight, whoever took it. An interrupted wait gives its
        operations back, for the next ``collect()`` to count.
        """
        me = threading.get_ident()
        with deferred_interrupts(), self._cond:
            ops = self.books.take_for_wait(me)
        try:
            self.books.wait_until(functools.partial(self._collected, ops, me))
        except BaseException:
            with deferred_interrupts(), self._cond:
                self.books.async_ops[:0] = ops
            raise
        if not ops:
            return 0
        count = sum(op.count for op in ops)     # a batch counts its requests
        failed = [op for op in ops if op.error is not None]
        if not failed:
            return count
        first = failed[0].error
        failures = sum(max(op.failures, 1) for op in failed)
        first.failed_operations = failures
        if hasattr(first, "add_note"):      # Python 3.11+
            first.add_note(f"{failures} of {count} operations failed")
        # Note [no reference cycle]: the traceback holds this frame; this frame must not
        # hold the error, or the operations (and the caller's buffers) through them, or
        # only the garbage collector would free them, locked memory included.
        del failed, ops
        try:
            raise first
        finally:
            del first

    def _collected(self, ops, thread):
        return _all_done(ops) and not self.books.in_flight_for(thread)

    def unshare(self, region):
        """Have the workers unmap ``region`` and drop our descriptor of it."""
        self.books.unshare(region)

    def register(self, region):
        """A locked region made for this handle: on io_uring, pinned for the workers' rings
        now (Note [cloned buffers] in pyx/_uring.pyx), as locking it promised."""
        with deferred_interrupts(), self._cond:
            self.check_usable()
            self.workers.register(region)

    def check_usable(self):
        if self.closed:
            raise ValueError("I/O operation on a closed nvmeswap handle")
        if process_state.pid != self.creator_pid:
            raise RuntimeError(f"this nvmeswap handle belongs to process {self.creator_pid}; "
                               "after fork() create a new handle in the child")

    def release(self):
        """Finish what is in flight, stop the workers and close every region.

        Called by ``close()``, or by a finalizer when a handle is dropped or the
        interpreter exits: operations nobody waited for still complete, and a failed one
        is named in a ResourceWarning (its file cut back, Note [preallocation]). If
        interrupted, the workers are killed and unfinished writes undone. Never from a
        forked child.
        """
        if os.getpid() != self.creator_pid:
            # A forked child: its copy of the lock may have been held by a thread that
            # does not exist here; nothing of the handle is the child's to touch.
            self.closed = True
            return
        with deferred_interrupts(), self._cond:
            self.closed = True      # no operation starts from now on
        try:
            if self.books.ops and self.books.pumping_thread != threading.get_ident():
                self.books.wait_until(lambda: not self.books.ops)
            with self._cond:
                while self._inline:     # they use the staging space: let them finish
                    self._cond.wait()
        finally:
            with deferred_interrupts(), self._cond:
                if self.books.ops:       # interrupted, or dropped from inside our own pump
                    self.workers.kill()     # first: then nothing of theirs touches our memory
                    self.books.fail_all(WorkerDied("the handle was closed with operations "
                                                   "in flight"), everything=True)
            try:
                self.workers.stop()     # the caller queue closed too, whatever happens
            finally:
                for region in self.placement.release():
                    region.close()
                self._warn_uncollected()

    def _warn_uncollected(self):
        with self._cond:
            ops, self.books.async_ops = self.books.async_ops, []
        for op in ops:
            if op.error is not None:
                warnings.warn(f"an operation nobody waited for failed: {op.error}",
                              ResourceWarning, stacklevel=caller_stacklevel())

    # -- the road of one operation -----------------------------------------------------
    def _try_quick(self, buffer, target, file_offset, is_read, is_async):
        """A quick road (Note [roads]): True if the operation was settled (synchronous)
        or booked (an asynchronous read); False if it goes the ordinary way."""
        found = None if self._o_direct is False else candidate(buffer, target, file_offset,
                                                               writable=is_read)
        if found is None:
            return False
        buf, path = found
        region = self.placement.locked.containing(buf.address, buf.nbytes)
        if not is_async:
            return self._run_quick(buf, region, path, file_offset, is_read)
        return (route(self._quick_facts(buf, region, True, True), self.limits.roads)
                is Road.QUICK_READ and self._submit_quick_read(buf, region, target, path,
                                                                file_offset))

    def _quick_facts(self, buf, region, is_async, is_read):
        return Facts(False, is_async, is_read, buf.nbytes, self.placement.host_inline_limit,
                     True, Memory.HOST if region is None else Memory.LOCKED,
                     bool(self.books.ops), self._queue_room())

    def _run_quick(self, buf, region, path, file_offset, is_read):
        """True if the operation was settled in one call (Note [quick synchronous
        operations]). Routed under the lock (nothing in flight: then there is no order to keep),
        counted as an inline operation so that ``release`` waits for it, and in the ordering
        while it runs (Note [ordering])."""
        quick = QuickSyncOperation(is_read)
        with _InlineCount(self) as count:
            with deferred_interrupts(), self._cond:
                self.check_usable()
                if (route(self._quick_facts(buf, region, False, is_read), self.limits.roads)
                        is not Road.QUICK_SYNC
                        or self.books.ordering.conflicts_with_quick(is_read)):
                    return False
                count()
                self.books.ordering.track(quick)
            try:
                return quick_transfer(buf, path, file_offset, is_read)
            finally:
                with deferred_interrupts(), self._cond:
                    self.books.end_uncounted(quick)

    def _submit_quick_read(self, buf, region, target, path, file_offset):
        """True if the read was booked for the caller queue (Note [quick asynchronous
        reads]): joined to its thread's run of reads of that file, or starting one (Note
        [quick read runs]). It is booked only if its file qualifies, there is room for it
        and nothing in flight is one it must follow; else it goes the ordinary way."""
        key = (threading.get_ident(), path)
        run = self.books.open_runs.get(key)
        if run is not None and names_the_runs_file(run, path, file_offset + buf.nbytes):
            with self._cond:
                if (not self.closed and self.books.open_runs.get(key) is run
                        and self._queue_room()
                        and not self.books.ordering.writes_in_flight(run.file.identity)
                        and post_to_run(self.workers.queue, run, buf, file_offset)):
                    return True
        with deferred_interrupts():
            shared = self._read_descriptors.take(path, file_offset + buf.nbytes)
            if shared is None:
                return False
            op = None
            try:
                with self._cond:
                    if self.closed or not self._queue_room():
                        return False
                    op = QuickReadRun(next(self._op_ids), buf, region, target, file_offset,
                                      shared, key)
                    if self.books.ordering.conflicts(op):
                        return False
                    op.road = Road.QUICK_READ
                    self.books.book(op, is_async=True)
                    if not op.done:
                        self.books.open_runs[key] = op
            finally:
                if op is None or not op.started:    # once started, its end gives it back
                    self._read_descriptors.release(shared)
        return True

    def _begin(self, buffer, target, file_offset, is_read, validate, is_async,
               for_wait=True):
        """Open, place, route and start one operation. If anything fails before it has
        started (Ctrl-C included: Note [deferred interrupts]), nothing of it is left."""
        # Back-pressure, before anything is opened: every chunk in flight holds
        # descriptors in a worker, every staged operation waiting for room holds its own.
        if not self._has_room():
            self.books.wait_until(self._has_room)
        op = None
        try:
            with deferred_interrupts():
                op = open_operation(next(self._op_ids), buffer, target, file_offset,
                                    is_read=is_read, validate=validate, o_direct=self._o_direct,
                                    preallocate_min=self.limits.preallocate_min,
                                    written_end=self.books.written_end)
            if op.error is not None:    # no room for the write: it ends here, its error
                self.books.book_failure(op, is_async, for_wait)     # where I/O's would be
                return op
            self._start(op, is_async, for_wait)
        except BaseException:
            if op is not None and not op.started:
                self.books.abandon(op)
            raise
        return op

    def _has_room(self, chunks=1):
        books = self.books
        return (self.workers.chunks_in_flight + len(books.staged_ops) + len(books.held)
                + chunks <= self._max_chunks)

    def _queue_room(self, requests=1):
        # Held and staged operations may each still post one request (Note [roads]).
        return self.workers.queue_room(len(self.books.held) + len(self.books.staged_ops),
                                       requests)

    def _facts(self, op, is_async):
        """What ``route`` needs of a placed operation (under the lock)."""
        buf, alignment, books = op.buffer, op.file.alignment, self.books
        inline_limit = self.placement.inline_limit(op)
        if op.staged is not None:
            memory = Memory.HOST if buf.device is None else Memory.DEVICE
        else:
            memory = Memory.CUFILE if op.region.on_device else Memory.LOCKED
        return Facts(True, is_async, op.is_read, buf.nbytes, inline_limit,
                     op.file_offset % alignment == 0 and buf.nbytes % alignment == 0,
                     memory, bool(books.ops), self._queue_room(),
                     # Asked only where it can matter: it walks the operations in flight.
                     conflicts=buf.nbytes <= inline_limit and bool(books.ordering.conflicts(op)),
                     staging_room=op.staged is None or op.staged.can_start_next())

    def _start(self, op, is_async, for_wait=True):
        """Place and route the operation; book it, or run it in the calling thread."""
        with _InlineCount(self) as count:
            with deferred_interrupts(), self._cond:
                self.check_usable()
                self.placement.place(op)
                op.road = route(self._facts(op, is_async), self.limits.roads)
                if op.road is not Road.INLINE:
                    self._running_pool()    # before booking: it may fail what is out
                    self.books.book(op, is_async, for_wait)
                    return
                count()
                self.books.ordering.track(op)   # routed so: it waits for nothing
                if op.staged is not None:
                    op.staged.start_next()      # the room its facts saw
            try:
                done = self._run_inline(op)
            except BaseException:
                with deferred_interrupts(), self._cond:
                    self.books.end_uncounted(op)
                raise
            with deferred_interrupts(), self._cond:
                self.books.book(op, is_async, for_wait)
                self.books.complete_chunk(op, done)

    def _run_inline(self, op):
        """Note [small synchronous operations]: an operation of one request runs in the
        calling thread (Note [roads] says when). A round trip to a worker costs two
        process wake-ups, more than the request itself on a fast device, and one request
        gains nothing from fan-out. ``release`` waits for such operations: they may
        borrow the staging space.
        """
        region_offset = op.region_offset_of(0)
        if op.staged is not None and not op.is_read:
            op.copier.to_region(0, op.buffer.nbytes, op.region, region_offset)
        return transfer_in_caller(op.op_id, 0, op.is_read, op.file.direct_fd,
                                  op.file.buffered_fd, op.region.address + region_offset,
                                  op.buffer.nbytes, op.file_offset, op.file.alignment)

    def _running_pool(self):
        """The current workers; a set with a member that died while idle is replaced,
        though the caller queue have requests out (no thread may be reading the pool)."""
        if not self.workers.with_workers and self.books.pumping_thread is None:
            self.workers.replace_if_dead()
        return self.workers.running()

class _InlineCount:
    """An operation running in its caller's thread, counted once the block calls this
    (under the scheduler's lock) and uncounted however the block ends: a Ctrl-C held
    back until the count was taken included. ``release`` waits for the count to drop."""

    __slots__ = ("_counted", "_scheduler")

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self._counted = False

    def __enter__(self):
        return self

    def __call__(self):
        self._scheduler._inline += 1
        self._counted = True

    def __exit__(self, *exc_info):
        if self._counted:
            scheduler = self._scheduler
            with deferred_interrupts(), scheduler._cond:
                scheduler._inline -= 1
                scheduler._cond.notify_all()
        return False


def _all_done(ops):
    return all(op.done for op in ops)
