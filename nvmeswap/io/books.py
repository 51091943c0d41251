"""The operations of one handle in flight, from booking to their end: sent where their
road goes, fed through the staging space, held for the ones they must follow, completed
from the responses, failed when workers die. Called with the scheduler's lock held
(``cond``), but for ``wait_until``, which takes it.
"""
import collections
import errno
import threading

from ..errors import ValidationError, WorkerDied
from .interrupts import deferred_interrupts
from .operation import writes
from .ordering import Ordering
from .roads import WORKER_ROADS, Road
from .validate import validate
from .workforce import GONE

_TAKEN = object()   # a claim's pool when another thread reads responses


class _Claim:
    """Whether this thread reads responses now, and from which pool (Note [pumping
    claims])."""

    __slots__ = ("held", "pool")

    def __init__(self):
        self.held = False
        self.pool = None


class Books:
    """What is in flight: operations by id, the asynchronous ones nobody has collected,
    those held for earlier ones (Note [ordering]), the staged ones, and the thread
    reading responses."""

    def __init__(self, placement, workers, cond):
        self.placement = placement
        self.workers = workers
        self.cond = cond
        self.ops = {}
        self._in_flight_by = collections.Counter()   # starter thread -> its ops in self.ops
        self.async_ops = []
        self.held = []          # booked operations that wait for earlier ones, in order
        self.staged_ops = []    # staged operations in flight, oldest first
        self.ordering = Ordering()
        self.open_runs = {}     # (thread, path) -> the run its reads join (Note [quick read runs])
        self.pumping_thread = None  # the thread reading responses, if any
        self._driving = False

    def written_end(self, identity):
        """``Ordering.written_end``, under the lock."""
        with self.cond:
            return self.ordering.written_end(identity)

    def operation_on(self, region):
        """An operation in flight (started or held) on ``region``'s memory, or None."""
        start, end = region.address, region.address + region.size
        with self.cond:
            return next((op for op in self.ops.values() if op.region is region or any(
                address < end and start < address + nbytes
                for address, nbytes in op.memory_spans())), None)

    def unshare(self, region):
        """Have the workers unmap ``region`` and drop our descriptor of it."""
        with deferred_interrupts(), self.cond:
            self.workers.unmap(region)
        region.close()

    def book(self, op, is_async, for_wait=True):
        """Enter a routed operation in the books, under the lock: the one booking of every
        road. An inline one has moved its bytes already; any other starts now, or is held
        until the earlier operations it conflicts with have finished (Note [ordering]).
        An asynchronous one is for ``wait()`` to collect unless a future holds it."""
        op.started = True
        op.is_async = is_async
        if for_wait:    # a synchronous one too: interrupted, it is waited for, not counted
            op.starter = threading.get_ident()
            if is_async:
                self.async_ops.append(op)
        if op.road is Road.CALLER_QUEUE and op.staged is None:
            op.chunks = [(0, op.buffer.nbytes)]     # one request: nothing to fan out
        op.remaining = len(op.chunks)
        if op.road is Road.INLINE:
            return
        self.ops[op.op_id] = op
        if op.starter is not None:
            self._in_flight_by[op.starter] += 1
        if op.road is Road.QUICK_READ:
            op.waits_for = set()    # checked before it was booked
            self.ordering.track(op)
        else:
            op.waits_for = self.ordering.add(op)
        if not op.waits_for:
            self._go(op)
            return
        self.held.append(op)
        if is_async and not self._driving:
            self._drive_in_background()     # so that it starts without waiting for wait()

    def take_for_wait(self, thread):
        """The asynchronous operations ``thread``'s ``wait()`` counts: those it started,
        and those of threads that have ended (nobody else will count them); if there are
        none, everyone's (a thread that waits for operations handed to it)."""
        alive = {other.ident for other in threading.enumerate()}
        taken, left = [], []
        for op in self.async_ops:
            (taken if op.starter == thread or op.starter not in alive else left).append(op)
        if not taken:
            taken, left = left, []
        self.async_ops = left
        for op in taken:    # a run counted now takes no more reads
            if op.road is Road.QUICK_READ:
                self.close_run(op)
        return taken

    def close_run(self, op):
        """Let the run ``op`` take no more reads (Note [quick read runs])."""
        if self.open_runs.get(op.key) is op:
            del self.open_runs[op.key]

    def in_flight_for(self, thread):
        """Whether an operation ``thread`` started is still in flight: an asynchronous
        one, whoever's ``wait()`` took it, or a synchronous one whose call Ctrl-C
        interrupted."""
        return self._in_flight_by[thread] > 0

    def _go(self, op):
        if op.staged is None:
            self._dispatch(op)
            return
        self.staged_ops.append(op)
        self._feed(op)
        if op.is_async and not op.done and op.staged.waiting() and not self._driving:
            self._drive_in_background()

    def end_uncounted(self, op):
        """An operation that ran in its caller's thread and is not to be completed here
        (a quick synchronous one, or an inline one that raised) has ended: count it out
        of the ordering, and start what waited only for it."""
        self.ordering.remove(op)
        if self.held:
            self._release_held(op)

    def _release_held(self, finished):
        """``finished`` is done: start the held operations that waited only for it."""
        for op in list(self.held):
            if op not in self.held:
                continue        # started or finished by a nested call (its send failed)
            op.waits_for.discard(finished)
            if not op.waits_for and op.error is None:
                self.held.remove(op)
                self._go(op)

    def _dispatch(self, op):
        """Hand every chunk of a zero-copy operation out (a batch's in one call)."""
        if op.road is Road.BATCH:
            taken = self.workers.post_batch(op)
            if taken < len(op.chunks):
                start, length = op.chunks[taken]
                op.error = op.transfer_error(errno.EAGAIN, op.file_offset + start, length, 0)
                self._count_out(op, len(op.chunks) - taken)
            return
        for index in range(len(op.chunks)):
            if not self._sent(op, index):
                break
        # The workers hold their own copies of the descriptors; a cuFile operation keeps
        # ours, to be done again on the staging road (Note [cuFile refusing a file]).
        if op.road is Road.WORKERS:
            op.file.close(keep_for_undo=not op.is_read)

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
        self.feed_staged()     # the room it held may be what another one waits for

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

    def feed_staged(self):
        """Room in the staging space: the oldest staged operations take it first."""
        for op in list(self.staged_ops):
            self._feed(op)

    def _drive_in_background(self):
        """An async staged operation can have more pieces than the staging space holds
        (Note [staging ring]), and only a thread reading responses frees room; without one
        it would stall until ``wait()``. The thread ends when no such operation is left.
        """
        self._driving = True

        def drive():
            try:
                self.wait_until(self._staged_work_done)
            except BaseException:
                with self.cond:
                    self._driving = False
                raise

        threading.Thread(target=drive, name="nvmeswap-staging", daemon=True).start()

    def _staged_work_done(self):
        # Decided under the lock that booking holds, so no operation is left undriven.
        done = not self.staged_ops and not self.held
        if done:
            self._driving = False
        return done

    # -- responses ---------------------------------------------------------------------
    def wait_until(self, finished):
        """Block (GIL released) until ``finished()``; one thread at a time reads responses
        (Note [pumping claims])."""
        while True:
            claim = _Claim()
            try:
                if self._claim_pumping(claim, finished):
                    return
                if claim.pool is _TAKEN:
                    with self.cond:
                        if self.pumping_thread is not None:
                            self.cond.wait()   # where an interrupt loses nothing
                    continue
                self._pump(claim)
            finally:
                if claim.held:      # only if the poll was interrupted
                    self._release_pumping()

    def progress(self):
        """Complete what has ended, without waiting: unless another thread is reading
        responses (then it does)."""
        claim = _Claim()
        try:
            self._claim_pumping(claim)
            if claim.held:
                self._pump(claim, wait=False)
        finally:
            if claim.held:
                self._release_pumping()

    def _claim_pumping(self, claim, finished=None):
        """Become the thread that reads responses, unless another one is: ``claim`` says
        which, and the pool to read. True if ``finished()`` holds (nothing claimed).

        Note [pumping claims]: a Ctrl-C held back in a section is raised as the section
        ends, and between two sections anything may raise it. So the claim is made
        inside a section and recorded there, in ``claim``, and given back inside the
        section that completes what was read (``_pump``): outside a section it is held
        only while the thread blocks in ``poll``, where a Ctrl-C raised leaves it for
        the caller's ``finally``. A claim this thread finds it holds when it asks again
        (a second Ctrl-C in that ``finally``) is taken up again: this thread is not
        reading responses while it asks.
        """
        me = threading.get_ident()
        with deferred_interrupts(), self.cond:
            if self.pumping_thread == me:
                self._release_pumping_locked()
            if finished is not None and finished():
                return True
            if self.pumping_thread is not None:
                claim.pool = _TAKEN
                return False
            self.pumping_thread = me
            claim.pool, claim.held = self.workers.pool, True    # the pool read under the lock
            return False

    def _release_pumping(self):
        with deferred_interrupts(), self.cond:
            self._release_pumping_locked()

    def _release_pumping_locked(self):
        if self.pumping_thread == threading.get_ident():
            self.pumping_thread = None
            self.cond.notify_all()

    def _pump(self, claim, wait=True):
        """Read the workers' responses and complete their chunks (Note [deferred
        interrupts]); give back ``claim`` in the same section (Note [pumping claims])."""
        pool = claim.pool
        events = self.workers.poll(pool, wait)
        with deferred_interrupts(), self.cond:
            try:
                try:
                    responses = self.workers.read(pool, events)
                except WorkerDied as death:
                    self._fail_pool(pool, death)
                    return
                except OSError:
                    if pool is not self.workers.pool:
                        return      # killed under us (close): its descriptors are gone
                    raise
                self.complete(responses)
            finally:
                self._release_pumping_locked()
                claim.held = False

    def complete(self, completions):
        ops = self.ops
        for done in completions:
            op = ops.get(done.op_id)
            if op is None:
                continue
            if op.staged is None and op.copier is None and not done.failed:
                if op.count > 1 and not op.is_read:
                    # A batch's request, an operation to wait(): its bytes stay, whatever
                    # the others' fate (Note [shared growth]).
                    start, length = op.chunks[done.chunk]
                    op.kept_end = max(op.kept_end, op.file_offset + start + length)
                self._count_out(op, 1)  # zero-copy and done: nothing to copy or give back
            else:
                self.complete_chunk(op, done)

    def complete_chunk(self, op, done):
        """One request of ``op`` has ended (a ``Completion``)."""
        chunk = done.chunk
        if done.failed:
            op.failures += 1
            if op.error is None:
                op.error = op.transfer_error(done.err, done.at_offset, done.requested, done.got)
        elif op.copier is not None and op.is_read and op.error is None:
            start, length = op.chunks[chunk]
            try:
                op.copier.from_region(start, length, op.region, op.region_offset_of(chunk))
            except Exception as error:
                op.error = op.copy_error(error)
        if op.staged is not None:
            op.staged.finish(chunk)
            self.feed_staged()
        self._count_out(op, 1)

    def _fail_pool(self, pool, death):
        """A worker died: kill its siblings, fail everything in flight, restart on next use."""
        if self.workers.discard(pool):
            self.fail_all(death)

    def fail_all(self, death, everything=False):
        """Fail every operation with the workers, or held: the workers are gone. The
        caller queue's go on (they complete from the kernel), and those waiting for
        staging room get it. With ``everything`` (closing), the caller queue's fail too,
        once the kernel has finished their requests."""
        failing = [op for op in self.ops.values()
                   if everything or op.road in WORKER_ROADS or op in self.held]
        for op in failing:      # all first: none of them may be started by another's end
            if op.error is None:
                op.error = WorkerDied(f"{death}: {op.describe()}")
        if everything:
            self.complete(self.workers.drain_queue())
        for op in failing:
            if not op.done:
                self._finish(op)
        if not everything:
            self.feed_staged()

    def _finish(self, op):
        if op.road is Road.CUFILE and op.error is not None and self.placement.refuse(op):
            self._redo_staged(op)
            return
        if op.road is Road.QUICK_READ:
            self.close_run(op)
        if self.ops.pop(op.op_id, None) is not None:
            if op.starter is not None:
                self._in_flight_by[op.starter] -= 1
                if not self._in_flight_by[op.starter]:
                    del self._in_flight_by[op.starter]
            if op in self.held:
                self.held.remove(op)
        self.ordering.remove(op)    # an inline one is counted there alone
        if op.staged is not None and op in self.staged_ops:
            self.staged_ops.remove(op)
        if op.error is None and op.validate:
            try:
                validate(op, self.placement.bytes_reader(op))
            except (ValidationError, OSError) as error:
                op.error = error
        if not op.is_read:
            failed = op.error is not None
            cut = writes().end(op, failed, op.kept_end if failed else
                               op.file_offset + op.buffer.nbytes)
            if cut is not None:
                op.file.cut_back(*cut)
        self._release_memory(op)
        op.buffer = op.region = op.copier = None
        op.done = True
        if self.held:
            self._release_held(op)

    def book_failure(self, op, is_async, for_wait=True):
        """Enter an operation that failed before any I/O (a write without room for its
        bytes) as done with its error: an asynchronous one is reported at ``wait()``."""
        with deferred_interrupts(), self.cond:
            op.started = True
            op.is_async = is_async
            if is_async and for_wait:
                op.starter = threading.get_ident()
                self.async_ops.append(op)
        self.abandon(op)

    def _redo_staged(self, op):
        """Start ``op`` again on the staging road: cuFile refused its file (Note [cuFile
        refusing a file] in io/cufile_placement.py). It keeps its place in the books."""
        for region in self.placement.give_back(op):
            self.unshare(region)
        op.region = op.copier = op.staged = None
        op.owns_region = False
        op.error, op.failures = None, 0
        op.road = Road.WORKERS      # never refused again, whatever happens next
        try:
            self.placement.place(op)
        except Exception as error:  # no staging memory, a CUDA error: it ends with that
            op.error = error
            op.chunks, op.remaining = [], 0
            self._finish(op)
            return
        op.remaining = len(op.chunks)
        self._go(op)

    def abandon(self, op):
        """Give back what an operation that never started holds."""
        with deferred_interrupts(), self.cond:
            cut = writes().end(op, True, 0)     # its preallocation may have grown the file
            if cut is not None:
                op.file.cut_back(*cut)
            op.done = True
            self._release_memory(op)
            self.feed_staged()     # the room it held may be what another one waits for

    def _release_memory(self, op):
        op.file.close()
        if op.region is not None:
            for region in self.placement.give_back(op):
                self.unshare(region)


