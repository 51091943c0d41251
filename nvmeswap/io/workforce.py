"""The scheduler's side of its worker processes: the pool (started, replaced after a death,
stopped), chunks handed out in turn with the regions they need mapped first, regions
unmapped, and the chunks in flight counted; and the caller's own queue for small
operations. Called with the scheduler's lock held."""
import errno
import resource
import select

from .._queues import CallerQueue
from ..workers import protocol
from ..workers.pool import WorkerPool

GONE = -1
_DEATH = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)

# Started operations wait while this many chunks are with the workers.
MAX_CHUNKS_IN_FLIGHT = 128
# Descriptors a process keeps for itself besides those of chunks in flight.
_RESERVED_FDS = 32


def chunks_in_flight_limit():
    """Each chunk in flight holds up to two file descriptors in a worker, and a worker
    inherits our RLIMIT_NOFILE: beyond it the kernel would drop descriptors sent to it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CHUNKS_IN_FLIGHT
    return max(1, min(MAX_CHUNKS_IN_FLIGHT, (soft - _RESERVED_FDS) // 2))


class Workforce:
    """One handle's workers and caller queue, as the scheduler uses them.

    Note [caller queue]: a small operation that O_DIRECT can move whole (aligned offset
    and length, host memory the kernel can reach) is one kernel AIO request; a worker
    adds two process wake-ups and a socket round trip to it, more than the request costs
    on a fast device. So such asynchronous operations go into the handle's own kernel AIO
    context (posted to its submitting thread, Note [submitter] in pyx/_queues.pyx) and are
    reaped in bulk by whichever thread reads responses; the context's eventfd wakes that
    thread beside the workers' sockets. Many small reads are then in flight at once, as
    fio keeps them. A worker's death does not touch them. Larger operations still fan out
    to the workers.
    """

    def __init__(self, placement, parallelism, engine_args):
        self.pool = None
        self.queue = None       # the CallerQueue, made with the first pool
        self._with_workers = 0
        self._placement = placement
        self._parallelism = parallelism
        self._engine_args = engine_args
        self._next = 0

    @property
    def chunks_in_flight(self):
        return self._with_workers + (self.queue.in_flight if self.queue is not None else 0)

    def running(self):
        """The current pool, started if there is none."""
        if self.pool is None:
            self.pool = WorkerPool(self._parallelism, self._engine_args)
            self._next = 0
            if self.queue is None:  # after the workers: theirs must fit under fs.aio-max-nr
                self.queue = _caller_queue()
            if self.queue is not None:
                self.pool.also_wake(self.queue.eventfd)
        return self.pool

    def takes_in_caller(self, op):
        """Whether ``op`` (placed: host memory) goes to the caller queue (Note [caller queue])."""
        return self.may_take_in_caller(op) and op.region.read_kind == protocol.READ

    def may_take_in_caller(self, op):
        """``takes_in_caller`` as far as it can be told before placement."""
        return (self.queue is not None and op.buffer.nbytes <= self._placement.inline_limit(op)
                and _o_direct_whole(op))

    def poll(self, pool):
        """Block until ``pool`` or the caller queue has something to say."""
        if pool is not None:
            return pool.poll()
        select.select([self.queue.eventfd], [], [])     # only the queue has work out
        return []

    def read(self, pool, events):
        """The responses ready after ``poll()``, the caller queue's included."""
        responses = pool.read(events) if pool is not None else []
        if pool is self.pool:
            self._with_workers -= len(responses)
        # Reaped when its eventfd woke us too: that clears a signal that came after its
        # completion had been reaped already, which would otherwise wake every poll.
        queue = self.queue
        if queue is not None and (queue.in_flight or any(fd == queue.eventfd
                                                         for fd, _ in events)):
            responses.extend(self._queue_responses(wait_all=False))
        return responses

    def drain_queue(self):
        """Wait for every request in the caller queue; their responses."""
        return self._queue_responses(wait_all=True) if self.queue is not None else []

    def _queue_responses(self, wait_all):
        return self.queue.reap(wait_all)

    def close_queue(self):
        queue, self.queue = self.queue, None
        if queue is not None:
            queue.close()

    def replace_if_dead(self):
        """With nothing in flight, a pool with a member that died is dropped (the next
        ``running()`` starts a fresh one). With operations out, the pump sees a death."""
        if self.pool is not None and self.pool.first_death() is not None:
            self.kill()

    def discard(self, pool):
        """Kill ``pool`` if it is still the current one; True if it was."""
        if pool is None or pool is not self.pool:
            return False
        self.kill()
        return True

    def kill(self):
        """SIGKILL and reap every worker: no kernel AIO of theirs touches our memory after."""
        pool, self.pool = self.pool, None
        self._with_workers = 0
        if pool is not None:
            pool.kill()

    def stop(self):
        """Let the workers finish and exit (EOF, TERM, KILL); killed if interrupted."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        try:
            pool.stop()
        except BaseException:
            pool.kill()
            raise

    def send(self, op, index):
        """Send chunk ``index`` of ``op`` to the next worker. Returns 0; ``GONE`` if that
        worker is dead or dying (the pump sees it and fails what is in flight); or the
        errno with which a live worker's socket refused it (ETOOMANYREFS: descriptors in
        flight beyond RLIMIT_NOFILE), the chunk then not counted. An operation of the
        caller queue's is posted there (Note [submitter] in pyx/_queues.pyx: a refusal by the
        kernel comes back as its response); if the queue is full (threads that passed
        back-pressure at once), to a worker."""
        if op.by_caller:
            start, length = op.chunks[index]
            if self.queue.post(op.op_id, index, op.is_read, op.file.direct_fd,
                               op.region.address + op.region_offset_of(index), length,
                               op.file_offset + start):
                return 0
            if self.pool is None:
                return errno.EAGAIN
            op.by_caller = False
        workers = self.pool.workers
        worker = workers[self._next]
        self._next = (self._next + 1) % len(workers)
        start, length = op.chunks[index]
        region = op.region
        self._with_workers += 1
        try:
            if region.region_id not in worker.mapped:
                for message, fds in self._placement.map_requests(worker, region):
                    worker.send(message, fds)
                worker.mapped.add(region.region_id)
            worker.send(protocol.transfer_request(
                region.read_kind if op.is_read else region.write_kind, region.region_id,
                op.op_id, index, op.region_offset_of(index), length, op.file_offset + start,
                op.file.alignment), op.file.descriptors())
        except OSError as error:
            if worker.process.poll() is not None or error.errno in _DEATH:
                return GONE
            self._with_workers -= 1
            return error.errno or errno.EIO
        return 0

    def unmap(self, region):
        """Have every worker that mapped ``region`` unmap it."""
        for worker in self.pool.workers if self.pool is not None else []:
            if region.region_id in worker.mapped:
                worker.mapped.discard(region.region_id)
                try:
                    worker.send(protocol.unmap_request(region.region_id))
                except OSError:
                    pass    # a dead worker maps nothing; the pump will see its death


def _caller_queue():
    """The handle's caller queue, or None where the kernel refuses another AIO context
    (fs.aio-max-nr): small operations then go to the workers like the rest."""
    try:
        # Back-pressure keeps fewer than MAX_CHUNKS_IN_FLIGHT out; twice that leaves room
        # for threads that passed it at once.
        return CallerQueue(2 * MAX_CHUNKS_IN_FLIGHT)
    except OSError:
        return None


def _o_direct_whole(op):
    """O_DIRECT can move all of ``op`` in one request: its file range is aligned (its
    memory then is too: placement keeps memory and file at the same phase)."""
    alignment = op.file.alignment
    return op.file_offset % alignment == 0 and op.buffer.nbytes % alignment == 0
