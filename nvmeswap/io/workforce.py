"""The scheduler's side of its worker processes: the pool (started, replaced after a death,
stopped), chunks handed out in turn with the regions they need mapped first, regions
unmapped, and the chunks in flight counted. Called with the scheduler's lock held."""
import errno
import resource

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
    """One handle's workers, as the scheduler uses them."""

    def __init__(self, placement, parallelism, engine_args):
        self.pool = None
        self.chunks_in_flight = 0
        self._placement = placement
        self._parallelism = parallelism
        self._engine_args = engine_args
        self._next = 0

    def running(self):
        """The current pool, started if there is none."""
        if self.pool is None:
            self.pool = WorkerPool(self._parallelism, self._engine_args)
            self._next = 0
        return self.pool

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
        self.chunks_in_flight = 0
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
        flight beyond RLIMIT_NOFILE), the chunk then not counted."""
        workers = self.pool.workers
        worker = workers[self._next]
        self._next = (self._next + 1) % len(workers)
        start, length = op.chunks[index]
        region = op.region
        self.chunks_in_flight += 1
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
            self.chunks_in_flight -= 1
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
