"""The scheduler's side of its worker processes: the pool (started, replaced after a death,
stopped), chunks handed out in turn with the regions they need mapped first, regions
unmapped, and the chunks in flight counted; and the caller's own queue for small
operations. Called with the scheduler's lock held."""
import errno
import os
import resource
import select

from ..workers import protocol
from ..workers.pool import WorkerPool
from .engines import caller_queue_type
from .roads import CALLER_ROADS

GONE = -1
_DEATH = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)


def chunks_in_flight_limit(limits):
    """Each chunk in flight holds up to two file descriptors in a worker, and a worker
    inherits our RLIMIT_NOFILE: beyond it the kernel would drop descriptors sent to it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_chunks_in_flight
    return max(1, min(limits.max_chunks_in_flight, (soft - limits.reserved_fds) // 2))


class Workforce:
    """One handle's workers and caller queue, as the scheduler uses them; the one place
    that builds the messages its workers are sent.

    Note [caller queue]: a small operation that O_DIRECT can move whole (aligned offset
    and length, host memory the kernel can reach) is one kernel AIO request; a worker
    adds two process wake-ups and a socket round trip to it, more than the request costs
    on a fast device. So such asynchronous operations go into the handle's own kernel AIO
    context (posted to its submitting thread, Note [submitter] in pyx/_queues.pyx), or its
    own ring on io_uring (Note [engines] in io/engines.py), and
    are reaped in bulk by whichever thread reads responses; the context's eventfd wakes
    that thread beside the workers' sockets. Many small reads are then in flight at once,
    as fio keeps them. A worker's death does not touch them. Larger operations still fan
    out to the workers.
    """

    def __init__(self, placement, parallelism, engine_settings, limits):
        self.pool = None
        self.queue = None       # the CallerQueue, made with the first pool
        self._with_workers = 0
        self._placement = placement
        self._parallelism = parallelism
        self._engine_settings = engine_settings
        self._limits = limits
        self._next = 0
        # io_uring: regions registered once here for every worker's ring to clone (Note
        # [cloned buffers] in pyx/_uring.pyx), region id -> (first slot, slots) or None.
        self._registry = None
        self._registered = {}

    @property
    def with_workers(self):
        """Chunks out with the workers (those of the caller queue are not)."""
        return self._with_workers

    @property
    def chunks_in_flight(self):
        return self._with_workers + (self.queue.in_flight if self.queue is not None else 0)

    def running(self):
        """The current pool, started if there is none."""
        if self.pool is None:
            registry = self._the_registry()
            self.pool = WorkerPool(self._parallelism, self._engine_settings,
                                   registry.fd if registry else -1)
            self._next = 0
            if self.queue is None:  # after the workers: theirs must fit under fs.aio-max-nr
                self.queue = _caller_queue(self._limits, self._engine_settings.engine)
            if self.queue is not None:
                self.pool.also_wake(self.queue.eventfd)
        return self.pool

    def queue_room(self, may_post, requests=1):
        """Whether the caller queue can take ``requests`` more while ``may_post`` booked
        operations may still post one each (Note [roads]: a post never finds it full)."""
        queue = self.queue
        return queue is not None and queue.in_flight + may_post + requests <= queue.capacity

    def post_batch(self, op):
        """Post every request of a batch (Note [batches]) to the caller queue in one call;
        how many it took (all: its room was counted when the batch was routed)."""
        return self.queue.post_many(op.op_id, op.is_read, op.file.direct_fd, op.addresses(),
                                    op.lengths(), op.offsets())

    def poll(self, pool, wait=True):
        """Block until ``pool`` or the caller queue has something to say; without
        ``wait``, only look."""
        if pool is not None:
            return pool.poll(None if wait else 0)
        if self.queue is not None:      # only the queue has work out
            select.select([self.queue.eventfd], [], [], None if wait else 0)
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
        """With nothing out with the workers, a pool with a member that died is dropped
        (the next ``running()`` starts a fresh one): the caller queue's requests are not
        theirs. With chunks out, the pump sees a death."""
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
        """Let the workers finish and exit (EOF, TERM, KILL), and close the caller queue
        meanwhile: each waits for the kernel to retire an AIO context (~30 ms), so the
        two waits overlap. The queue is closed however this ends (it waits for its
        requests: the memory they use may be freed next); the workers are killed if
        interrupted. The registrations go last, with the workers' rings gone."""
        pool, self.pool = self.pool, None
        try:
            if pool is not None:
                pool.ask_to_stop()
            self.close_queue()
            if pool is not None:
                pool.reap()
        except BaseException:
            if pool is not None:
                pool.kill()
            self.close_queue()      # a no-op unless the interruption came before it
            raise
        finally:
            self.close_registry()

    def send(self, op, index):
        """Send chunk ``index`` of ``op`` where its road goes (Note [roads]). Returns 0;
        ``GONE`` if its worker is dead or dying (the pump sees it and fails what is in
        flight); or the errno with which the caller queue or a live worker's socket
        refused it (ETOOMANYREFS: descriptors in flight beyond RLIMIT_NOFILE), the chunk
        then not counted. A refusal by the kernel of a posted request comes back from
        the queue as its response (Note [submitter])."""
        start, length = op.chunks[index]
        if op.road in CALLER_ROADS:
            # Never full (Note [roads]); were it so, the operation fails, saying so.
            return 0 if self.queue.post(op.op_id, index, op.is_read, op.file.direct_fd,
                                        op.region.address + op.region_offset_of(index),
                                        length, op.file_offset + start) else errno.EAGAIN
        workers = self.pool.workers
        worker = workers[self._next]
        self._next = (self._next + 1) % len(workers)
        region = op.region
        on_device = region.on_device
        if op.is_read:
            kind = protocol.CUFILE_READ if on_device else protocol.READ
        else:
            kind = protocol.CUFILE_WRITE if on_device else protocol.WRITE
        self._with_workers += 1
        try:
            if region.region_id not in worker.mapped:
                self._map(worker, region)
            worker.send(protocol.transfer_request(
                kind, region.region_id, op.op_id, index, op.region_offset_of(index), length,
                op.file_offset + start, op.file.alignment), op.file.descriptors())
        except OSError as error:
            if worker.process.poll() is not None or error.errno in _DEATH:
                return GONE
            self._with_workers -= 1
            return error.errno or errno.EIO
        return 0

    def _map(self, worker, region):
        """Have ``worker`` map ``region`` before its first request on it (a device region:
        cuFile loaded there first, Note [device regions])."""
        if region.on_device:
            if "cufile" not in worker.mapped:
                cufile = self._placement.cufile
                worker.send(protocol.cufile_setup_request(
                    [os.fsencode(path) for path in cufile.libraries]),
                    [cufile.config_fd] if cufile.config_fd >= 0 else [])
                worker.mapped.add("cufile")
            worker.send(protocol.device_map_request(
                region.region_id, region.size, region.ipc_handle, region.ordinal,
                region.address - region.allocation_base))
        else:
            slots = self.register(region)
            worker.send(protocol.map_request(
                region.region_id, region.size, region.offset,
                None if slots is None else (region.address, *slots)), [region.fd])
        worker.mapped.add(region.region_id)

    def _the_registry(self):
        """Our ``BufferRegistry``, made on first use, for the workers to inherit (Note
        [cloned buffers] in pyx/_uring.pyx); None where they register regions themselves
        (kernel AIO, or a kernel that clones nothing)."""
        if self._registry is None:
            self._registry = False
            if self._engine_settings.engine == "uring":
                from .._uring import BufferRegistry, clone_supported

                try:
                    self._registry = BufferRegistry() if clone_supported() else False
                except OSError:
                    pass
        return self._registry or None

    def register(self, region):
        """The registry slots that hold ``region``, registered now if not yet (when a
        handle makes it, or at its first mapping); None where the workers register it
        themselves (Note [cloned buffers] in pyx/_uring.pyx)."""
        registry = self._the_registry()
        if registry is None:
            return None
        if region.region_id not in self._registered:
            self._registered[region.region_id] = registry.register(region.address,
                                                                   region.size)
        return self._registered[region.region_id]

    def unmap(self, region):
        """Have every worker that mapped ``region`` unmap it (and drop its clone of the
        region's registration, which we drop here)."""
        for worker in self.pool.workers if self.pool is not None else []:
            if region.region_id in worker.mapped:
                worker.mapped.discard(region.region_id)
                try:
                    worker.send(protocol.unmap_request(region.region_id))
                except OSError:
                    pass    # a dead worker maps nothing; the pump will see its death
        slots = self._registered.pop(region.region_id, None)
        if slots is not None:
            self._registry.unregister(*slots)

    def close_registry(self):
        """Let go of every registration (the workers' clones end with their rings)."""
        registry, self._registry = self._registry, None
        self._registered.clear()
        if registry:
            registry.close()


def _caller_queue(limits, engine):
    """The handle's caller queue on its engine (Note [engines] in io/engines.py), or None
    where the kernel refuses another AIO context (fs.aio-max-nr) or ring: small
    operations then go to the workers like the rest."""
    try:
        # Back-pressure keeps fewer than max_chunks_in_flight out; twice that leaves
        # room for threads that passed it at once.
        return caller_queue_type(engine)(2 * limits.max_chunks_in_flight)
    except OSError:
        return None
