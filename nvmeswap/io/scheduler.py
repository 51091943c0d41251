"""The scheduler: places each operation, hands its chunks to the workers, reads their
responses, and completes operations for ``wait()``. Both handles run on it.

The road of one operation: ``open_operation`` (checks, file) -> ``placement.place``
(memory and chunk plan) -> ``_dispatch`` (zero-copy: a request per chunk) or ``_feed``
(staged: a piece at a time, as the staging space has room; a background thread keeps
async ones moving) -> ``Workforce.send`` -> a worker's engine -> ``_pump`` (responses) ->
``_complete_chunk`` -> ``_finish`` -> ``run`` or ``collect``. Two short roads skip the
first steps: ``_run_quick`` (a small synchronous operation, settled in one call) and
``_submit_quick_read`` (a small async read into locked memory, posted to the caller queue).
"""
import functools
import itertools
import os
import threading
import warnings

from .._transfers import transfer_in_caller
from ..errors import ValidationError, WorkerDied, caller_stacklevel
from .interrupts import deferred_interrupts
from .operation import WRITES, open_operation
from .ordering import Ordering
from .quick import quick, quick_read
from .validate import validate
from .workforce import GONE, Workforce, chunks_in_flight_limit


class Scheduler:
    """One handle's operations in flight, its workers, and the memory it shares with them.

    Holds no reference to the handle, so a finalizer can release it (``release``).
    """

    def __init__(self, placement, parallelism, engine_args, o_direct):
        self.placement = placement
        self.workers = Workforce(placement, parallelism, engine_args)
        self.closed = False
        self.creator_pid = os.getpid()
        self._o_direct = o_direct
        self._cond = threading.Condition()
        self._pumping_thread = None     # the thread reading responses, if any
        self._ops = {}
        self._async_ops = []
        self._op_ids = itertools.count(1)
        self._driving = False
        self._staged_ops = []   # staged operations in flight, oldest first
        self._ordering = Ordering()
        self._held = []         # started operations that wait for earlier ones, in order
        self._max_chunks = chunks_in_flight_limit()
        self._inline = 0        # synchronous operations running in their callers' threads
        with self._cond:
            self._running_pool()

    # -- what the handles call ----------------------------------------------------------
    def run(self, buffer, target, file_offset, *, is_read, validate):
        """A synchronous operation: returns 1, or raises its error.

        Interrupted while it runs, the operation goes on, and its error is dropped.
        """
        if not (validate or self._o_direct is False) and self._run_quick(
                buffer, target, file_offset, is_read):
            return 1
        op = self._begin(buffer, target, file_offset, is_read, validate, is_async=False)
        self._wait_until(op.is_done)
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
            if not self._has_room():    # back-pressure first: then it goes the quick road
                self._wait_until(self._has_room)
            if self._submit_quick_read(buffer, target, file_offset):
                return
        self._begin(buffer, target, file_offset, is_read, validate, is_async=True)

    def collect(self):
        """Wait for every submitted operation; return how many, or raise the first failure.

        Each operation is collected once: a thread takes the operations submitted so far
        and waits for them; another thread's ``collect()`` takes only later ones. An
        interrupted wait gives its operations back, for the next ``collect()`` to count.
        """
        with deferred_interrupts(), self._cond:
            ops, self._async_ops = self._async_ops, []
        if not ops:
            return 0
        try:
            self._wait_until(functools.partial(_all_done, ops))
        except BaseException:
            with deferred_interrupts(), self._cond:
                self._async_ops[:0] = ops
            raise
        failed = [op.error for op in ops if op.error is not None]
        if not failed:
            return len(ops)
        first = failed[0]
        first.failed_operations = len(failed)
        if hasattr(first, "add_note"):      # Python 3.11+
            first.add_note(f"{len(failed)} of {len(ops)} operations failed")
        # Note [no reference cycle]: the traceback holds this frame; this frame must not
        # hold the error, or the operations (and the caller's buffers) through them, or
        # only the garbage collector would free them, locked memory included.
        del failed, ops
        try:
            raise first
        finally:
            del first

    def unshare(self, region):
        """Have the workers unmap ``region`` and drop our descriptor of it."""
        with deferred_interrupts(), self._cond:
            self.workers.unmap(region)
        region.close()

    def check_usable(self):
        if self.closed:
            raise ValueError("I/O operation on a closed nvmeswap handle")
        if os.getpid() != self.creator_pid:
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
        with deferred_interrupts(), self._cond:
            self.closed = True      # no operation starts from now on
        if os.getpid() != self.creator_pid:
            return
        try:
            if self._ops and self._pumping_thread != threading.get_ident():
                self._wait_until(lambda: not self._ops)
            with self._cond:
                while self._inline:     # they use the staging space: let them finish
                    self._cond.wait()
        finally:
            with deferred_interrupts(), self._cond:
                if self._ops:       # interrupted, or dropped from inside our own pump
                    self.workers.kill()     # first: then nothing of theirs touches our memory
                    self._fail_all(WorkerDied("the handle was closed with operations in "
                                              "flight"), everything=True)
            try:
                self.workers.stop()
            finally:
                self.workers.close_queue()  # waits for its requests: memory is freed next
                for region in self.placement.release():
                    region.close()
                self._warn_uncollected()

    def _warn_uncollected(self):
        with self._cond:
            ops, self._async_ops = self._async_ops, []
        for op in ops:
            if op.error is not None:
                warnings.warn(f"an operation nobody waited for failed: {op.error}",
                              ResourceWarning, stacklevel=caller_stacklevel())

    # -- the road of one operation -----------------------------------------------------
    def _begin(self, buffer, target, file_offset, is_read, validate, is_async):
        """Open, place and start one operation. If anything fails before it has started
        (Ctrl-C included: Note [deferred interrupts]), nothing of it is left behind."""
        # Back-pressure, before anything is opened: every chunk in flight holds
        # descriptors in a worker, every staged operation waiting for room holds its own.
        if not self._has_room():
            self._wait_until(self._has_room)
        op = None
        try:
            with deferred_interrupts():
                op = open_operation(next(self._op_ids), buffer, target, file_offset,
                                    is_read=is_read, validate=validate, o_direct=self._o_direct)
            # An async operation runs inline only when none is in flight (else it would
            # make its caller wait for them) and the caller queue cannot take it.
            if op.buffer.nbytes <= self.placement.inline_limit(op) and not (
                    is_async and (self._ops or self.workers.may_take_in_caller(op))):
                self._run_inline(op, is_async)
            else:
                self._start(op, is_async)
        except BaseException:
            if op is not None and not op.started:
                self._abandon(op)
            raise
        return op

    def _has_room(self):
        return (self.workers.chunks_in_flight + len(self._staged_ops) + len(self._held)
                < self._max_chunks)

    def _start(self, op, is_async):
        """Place the operation and hand its chunks to the workers."""
        with deferred_interrupts(), self._cond:
            self.check_usable()
            self._running_pool()    # before registering: it may fail what is out
            self._place(op)
            self._launch(op, is_async)

    def _place(self, op):
        self.placement.place(op)
        if self.workers.takes_in_caller(op):      # Note [caller queue]
            op.by_caller = True
            if op.staged is None:
                op.chunks = [(0, op.buffer.nbytes)]     # one request: nothing to fan out
        op.remaining = len(op.chunks)

    def _launch(self, op, is_async):
        """Register a placed operation and send what can go now, or hold it until the
        earlier operations it conflicts with have finished (Note [ordering]); under the
        lock."""
        self._ops[op.op_id] = op
        op.started = True
        op.is_async = is_async
        if is_async:
            self._async_ops.append(op)
        op.waits_for = self._ordering.add(op)
        if not op.waits_for:
            self._go(op)
            return
        self._held.append(op)
        if is_async and not self._driving:
            self._drive_in_background()     # so that it starts without waiting for wait()

    def _go(self, op):
        if op.staged is None:
            self._dispatch(op)
            return
        self._staged_ops.append(op)
        self._feed(op)
        if op.is_async and not op.done and op.staged.waiting() and not self._driving:
            self._drive_in_background()

    def _release_held(self, finished):
        """``finished`` is done: start the held operations that waited only for it."""
        for op in list(self._held):
            if op not in self._held:
                continue        # started or finished by a nested call (its send failed)
            op.waits_for.discard(finished)
            if not op.waits_for and op.error is None:
                self._held.remove(op)
                self._go(op)

    def _run_quick(self, buffer, target, file_offset, is_read):
        """Note [quick synchronous operations]: True if the operation was settled in one
        call. Only with nothing in flight (then there is no order to keep), counted as an
        inline operation so that ``release`` waits for it."""
        with _InlineCount(self) as count:
            with deferred_interrupts(), self._cond:
                self.check_usable()
                if self._ops:
                    return False
                count()
            return quick(buffer, target, file_offset, is_read=is_read,
                         limit=self.placement.host_inline_limit)

    def _submit_quick_read(self, buffer, target, file_offset):
        """Note [quick asynchronous reads]: True if the read went to the caller queue,
        booked as ``_launch`` books one. Only when it has nothing in flight to wait for
        and there is room for it."""
        queue = self.workers.queue
        if queue is None or self._o_direct is False or not self._has_room():
            return False
        with deferred_interrupts():
            op = quick_read(next(self._op_ids), buffer, target, file_offset, self.placement)
            if op is None:
                return False
            with self._cond:
                if (self.closed or queue is not self.workers.queue
                        or self._ordering.conflicts(op) or not queue.post(
                            op.op_id, 0, True, op.file.direct_fd,
                            op.region.address + op.region_offset, op.buffer.nbytes,
                            op.file_offset)):
                    op.file.close()
                    return False    # the ordinary road waits, or says why
                op.remaining = 1
                op.started = op.is_async = True
                op.waits_for = set()
                self._ops[op.op_id] = op
                self._async_ops.append(op)
                self._ordering.track(op)
        return True

    def _run_inline(self, op, is_async):
        """Note [small synchronous operations]: an operation of one request runs in the
        calling thread: a synchronous one unless it must follow an operation in flight
        (Note [ordering]), an asynchronous one when nothing is in flight and the caller
        queue cannot take it (Note [caller queue]). A round trip to a worker costs
        two process wake-ups, more than the request itself on a fast device, and one
        request gains nothing from fan-out. ``release`` waits for such operations: they
        borrow the staging space.
        """
        with _InlineCount(self) as count:
            with deferred_interrupts(), self._cond:
                self.check_usable()
                self._place(op)
                if self._ordering.conflicts(op) or (op.staged is not None
                                                    and op.staged.start_next() is None):
                    # It must follow an operation in flight (Note [ordering]), or the
                    # staging space is lent out: it waits like any operation.
                    self._running_pool()
                    self._launch(op, is_async)
                    return
                count()
            region_offset = op.region_offset_of(0)
            if op.staged is not None and not op.is_read:
                op.copier.to_region(0, op.buffer.nbytes, op.region, region_offset)
            done = transfer_in_caller(op.op_id, 0, op.is_read, op.file.direct_fd,
                                      op.file.buffered_fd, op.region.address + region_offset,
                                      op.buffer.nbytes, op.file_offset, op.file.alignment)
            with deferred_interrupts(), self._cond:
                op.started = True
                if is_async:
                    self._async_ops.append(op)
                self._complete_chunk(op, done)

    def _dispatch(self, op):
        """Hand every chunk of a zero-copy operation out."""
        for index in range(len(op.chunks)):
            if not self._sent(op, index):
                break
        if not op.by_caller:    # the workers hold their own copies of the descriptors
            op.file.close()

    def _sent(self, op, index):
        """Send one chunk; False if it could not go. A live worker's refusal fails the
        chunk and the chunks not sent after it; a dead worker is the pump's to handle."""
        refused = self.workers.send(op, index)
        if refused == 0:
            return True
        if refused != GONE:
            start, length = op.chunks[index]
            if op.error is None:
                op.error = op.transfer_error(refused, op.file_offset + start, length, 0)
            self._give_up(op, index)
        return False

    def _give_up(self, op, index):
        """Chunks ``index`` on will never be answered: count them out."""
        if op.staged is None:
            self._count_out(op, len(op.chunks) - index)
            return
        op.staged.finish(index)
        self._count_out(op, 1 + op.staged.cancel_rest())
        self._feed_staged()     # the room it held may be what another one waits for

    def _count_out(self, op, chunks):
        """``chunks`` of ``op`` are done with (answered, or never to be); finish it after
        its last."""
        op.remaining -= chunks
        if op.remaining == 0 and not op.done:
            self._finish(op)

    def _feed(self, op):
        """Start a staged operation's next pieces while the staging space has room
        (Note [staging ring])."""
        while not op.done and op.error is None:
            index = op.staged.start_next()
            if index is None:
                return
            if not op.is_read:
                start, length = op.chunks[index]
                try:
                    op.copier.to_region(start, length, op.region,
                                        op.staged.region_offset(index))
                except Exception as error:
                    op.error = op.copy_error(error)
                    self._give_up(op, index)
                    return
            if not self._sent(op, index):
                return
        if op.error is not None and not op.done:
            # A piece failed (a read's copy, say): the pieces not started never will be.
            self._count_out(op, op.staged.cancel_rest())

    def _feed_staged(self):
        """Room in the staging space: the oldest staged operations take it first."""
        for op in list(self._staged_ops):
            self._feed(op)

    def _drive_in_background(self):
        """Note [staging ring]: an async staged operation can have more pieces than the
        staging space holds, and only a thread reading responses frees room; without one
        it would stall until ``wait()``. The thread ends when no such operation is left.
        """
        self._driving = True

        def drive():
            try:
                self._wait_until(self._staged_work_done)
            except BaseException:
                with self._cond:
                    self._driving = False
                raise

        threading.Thread(target=drive, name="nvmeswap-staging", daemon=True).start()

    def _staged_work_done(self):
        # Decided under the lock that _start holds, so no operation is left undriven.
        done = not self._staged_ops and not self._held
        if done:
            self._driving = False
        return done

    def _running_pool(self):
        """The current workers; a set with a member that died while idle is replaced."""
        if not self._ops and self._pumping_thread is None:
            self.workers.replace_if_dead()
        return self.workers.running()

    # -- responses ---------------------------------------------------------------------
    def _wait_until(self, finished):
        """Block (GIL released) until ``finished()``; one thread at a time reads responses."""
        while True:
            with deferred_interrupts(), self._cond:
                if finished():
                    return
                pumping = self._pumping_thread is None
                if pumping:
                    pool = self.workers.pool
                    self._pumping_thread = threading.get_ident()
            if not pumping:
                with self._cond:
                    if self._pumping_thread is not None:
                        self._cond.wait()   # where an interrupt loses nothing
                continue
            try:
                self._pump(pool)
            finally:
                with deferred_interrupts(), self._cond:
                    self._pumping_thread = None
                    self._cond.notify_all()

    def _pump(self, pool):
        """Read the workers' responses and complete their chunks (Note [deferred interrupts])."""
        events = self.workers.poll(pool)
        with deferred_interrupts(), self._cond:
            try:
                responses = self.workers.read(pool, events)
            except WorkerDied as death:
                self._fail_pool(pool, death)
                return
            except OSError:
                if pool is not self.workers.pool:
                    return      # killed under us (close): its descriptors are gone
                raise
            self._complete(responses)

    def _complete(self, completions):
        for done in completions:
            op = self._ops.get(done.op_id)
            if op is not None:
                self._complete_chunk(op, done)

    def _complete_chunk(self, op, done):
        chunk = done.chunk
        start, length = op.chunks[chunk]
        if done.failed:
            if op.error is None:
                op.error = op.transfer_error(done.err, done.at_offset, done.requested, done.got)
        elif op.copier is not None and op.is_read and op.error is None:
            try:
                op.copier.from_region(start, length, op.region, op.region_offset_of(chunk))
            except Exception as error:
                op.error = op.copy_error(error)
        if op.staged is not None:
            op.staged.finish(chunk)
            self._feed_staged()
        self._count_out(op, 1)

    def _fail_pool(self, pool, death):
        """A worker died: kill its siblings, fail everything in flight, restart on next use."""
        if self.workers.discard(pool):
            self._fail_all(death)

    def _fail_all(self, death, everything=False):
        """Fail every operation with the workers, or held: the workers are gone. The
        caller queue's go on (they complete from the kernel), and those waiting for
        staging room get it. With ``everything`` (closing), the caller queue's fail too,
        once the kernel has finished their requests."""
        failing = [op for op in self._ops.values()
                   if everything or not op.by_caller or op in self._held]
        for op in failing:      # all first: none of them may be started by another's end
            if op.error is None:
                op.error = WorkerDied(f"{death}: {op.describe()}")
        if everything:
            self._complete(self.workers.drain_queue())
        for op in failing:
            if not op.done:
                self._finish(op)
        if not everything:
            self._feed_staged()

    def _finish(self, op):
        if self._ops.pop(op.op_id, None) is not None:
            self._ordering.remove(op)
            if op in self._held:
                self._held.remove(op)
        if op.staged is not None and op in self._staged_ops:
            self._staged_ops.remove(op)
        if op.error is None and op.validate:
            try:
                validate(op, self.placement.bytes_reader(op))
            except (ValidationError, OSError) as error:
                op.error = error
        if WRITES.end(op) and op.error is not None:
            op.file.undo_growth(op.file_offset + op.buffer.nbytes)
        self._release_memory(op)
        op.buffer = op.region = op.copier = None
        op.done = True
        if self._held:
            self._release_held(op)

    def _abandon(self, op):
        """Give back what an operation that never started holds."""
        with deferred_interrupts(), self._cond:
            if WRITES.end(op):
                op.file.undo_growth(op.file_offset + op.buffer.nbytes)  # preallocated
            op.done = True
            self._release_memory(op)
            self._feed_staged()     # the room it held may be what another one waits for

    def _release_memory(self, op):
        op.file.close()
        if op.region is not None:
            for region in self.placement.give_back(op):
                self.unshare(region)


class _InlineCount:
    """An operation running in its caller's thread, counted once the block calls this
    (under the scheduler's lock) and uncounted however the block ends: a Ctrl-C held
    back until the count was taken included. ``release`` waits for the count to drop."""

    __slots__ = ("_scheduler", "_counted")

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
