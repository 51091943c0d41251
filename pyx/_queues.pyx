# cython: language_level=3, boundscheck=False, wraparound=False
"""The kernel AIO queues: a worker's transfer loop (``AioEngine``, run without the GIL)
and the calling process's own queue for small requests (``CallerQueue``).

A transfer moves ``nbytes`` between memory at ``address`` and a file at ``offset``.
Its aligned middle goes through kernel AIO on the O_DIRECT descriptor in requests of
``block_size`` bytes; an unaligned head or tail goes through plain pread/pwrite on a
buffered descriptor (see Note [O_DIRECT tail] in nvmeswap/io/files.py).

Results cross into Python as in nvmeswap._transfers: a failure of the call itself raises
``OSError`` (pyx/_check.pxd's ``errno_error``, naming the system call), and no function
returns an errno; each transfer or request ends in a ``Completion``, a refusal by the
kernel included. Misuse is a ``ValueError`` or ``RuntimeError``; a full caller queue is a
False return (the request goes to a worker instead).
"""
from libc.stdlib cimport malloc, free
from libc.errno cimport EAGAIN, EINTR, EIO
from posix.types cimport pid_t
from posix.unistd cimport close, getpid, read, write

from _check cimport errno_error
from _transfer_steps cimport (
    Outcome, Transfer, _aio_context, _begin_transfer, _clear_iocb, _count_many, _fail, _failed,
)
from _transfer_table cimport TransferTable, _table_add, _table_ended, _table_free, _table_init
from nvmeswap._transfers cimport completion

from includes.kernel_aio cimport (
    aio_context_t, iocb, io_event, IOCB_CMD_PREAD, IOCB_CMD_PWRITE,
    nvmeswap_io_destroy, nvmeswap_io_submit, nvmeswap_io_getevents, nvmeswap_eventfd,
    IOCB_FLAG_RESFD, timespec,
)
from includes.submitter cimport (
    nvmeswap_submitter, nvmeswap_submitter_start, nvmeswap_submitter_post,
    nvmeswap_submitter_drain, nvmeswap_submitter_take_failed, nvmeswap_submitter_stop,
)


cdef class TransferEngine:
    """What both engines keep the same way: ``queue_depth`` request slots and the
    transfers in progress (at most ``max_transfers``), begun here and ended by the
    engine's ``advance`` (``AioEngine`` below, ``UringEngine`` in pyx/_uring.pyx).

    Note [concurrent transfers]: a worker is handed one chunk after another (the pieces
    of a staged operation arrive as they are copied), and a chunk smaller than
    ``queue_depth`` blocks would leave the queue part empty if it ran alone. So every
    transfer started with ``begin`` shares the slots: ``advance`` fills free slots from
    the oldest transfer on, and reports transfers as they end. With ``overlap_events``
    free slots are refilled at every completion; without it (DeepNVMe's default) a new
    batch starts when the previous one has completed.

    Note [reaping in bulk]: with ``overlap_events`` a blocking ``advance`` waits for a
    quarter of the requests in flight, but never for more than the oldest transfer still
    has in flight, so that it wakes no later than that transfer can end. Waking for every
    completion cost each of them a wake-up, a pass of the worker's loop and a submit of
    one request; the device meanwhile keeps three quarters of the queue. With the ring's
    fixed buffers, where little else is left per request, the CPU per GB moved fell by a
    quarter (bench/cpu_per_byte.py, io_uring overwrite 0.0100 -> 0.0073 s, read 0.0101
    -> 0.0077 s); on kernel AIO, whose cost is the kernel pinning every request's pages,
    it did not show.
    """

    def __cinit__(self, *args, **kwargs):
        self.free_slots = NULL
        self.owner = NULL
        self.table.transfers = NULL
        self.table.used = NULL
        self.table.order = NULL
        if type(self) is TransferEngine:
            raise TypeError("TransferEngine is the base of AioEngine and UringEngine; make one "
                            "of those")

    cdef int _set_up(self, size_t block_size, int queue_depth, bint single_submit,
                     bint overlap_events, int max_transfers) except -1:
        """Take the settings (checked by the engine) and make the slots and the table."""
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.max_transfers = max_transfers
        self.single_submit = single_submit
        self.overlap_events = overlap_events
        self.free_slots = <int *>malloc(sizeof(int) * queue_depth)
        self.owner = <int *>malloc(sizeof(int) * queue_depth)
        if not (self.free_slots and self.owner and _table_init(&self.table, max_transfers)):
            raise MemoryError()
        cdef int i
        for i in range(queue_depth):
            self.free_slots[i] = i
        self.n_free = queue_depth
        self.in_flight = 0
        return 0

    cdef int _completions_to_wait(self) noexcept nogil:
        """How many completions a blocking ``advance`` waits for (Note [reaping in
        bulk]); at least one, at most what is in flight."""
        cdef Transfer *oldest
        if not self.overlap_events:
            return self.in_flight
        oldest = &self.table.transfers[self.table.order[0]]
        return max(1, <int>min(self.in_flight // 4, oldest.prepared - oldest.completed))

    def __dealloc__(self):
        # After the engine's own: its requests have completed by then.
        free(self.free_slots)
        free(self.owner)
        _table_free(&self.table)

    @property
    def busy(self):
        """Whether transfers are in progress."""
        return self.table.n_order > 0

    @property
    def full(self):
        """Whether ``begin`` must wait for a transfer to end."""
        return self.table.n_order == self.max_transfers

    def transfer(self, unsigned long long op_id, unsigned int chunk, bint is_read,
                 int direct_fd, int buffered_fd, size_t address, size_t nbytes,
                 long long offset, size_t alignment):
        """Move the bytes; return the transfer's ``Completion``.

        Blocks until the transfer has ended; only for an engine with nothing else in
        progress. ``alignment`` is 1 when ``direct_fd`` is not O_DIRECT; otherwise
        ``address - offset`` must be a multiple of it.
        """
        if self.table.n_order:
            raise RuntimeError("transfer needs an engine with nothing in progress")
        self.begin(op_id, chunk, is_read, direct_fd, buffered_fd, address, nbytes, offset,
                   alignment)
        while True:
            ended = self.advance(True)
            if ended:
                return ended[0]

    def begin(self, unsigned long long op_id, unsigned int chunk, bint is_read,
              int direct_fd, int buffered_fd, size_t address, size_t nbytes,
              long long offset, size_t alignment, int fixed_slot=-1, size_t fixed_base=0,
              size_t fixed_address=0):
        """Start a transfer (Note [concurrent transfers]); ``advance`` returns its
        ``Completion``, carrying ``op_id`` and ``chunk``, when it has ended. The caller
        keeps the memory mapped until then.

        The unaligned head and tail (Note [O_DIRECT tail]) move here, with pread/pwrite on
        ``buffered_fd``; the aligned middle through the engine's requests in ``advance``.

        On io_uring, ``fixed_slot`` >= 0 names the first of the registered buffers that
        hold the memory as another process registered it (Note [cloned buffers] in
        pyx/_uring.pyx): from ``fixed_base`` on, in pieces of at most 1 GiB, where the
        transfer's bytes are at ``fixed_address``.
        """
        cdef int index = _table_add(&self.table)
        if index < 0:
            raise RuntimeError("too many transfers in progress")
        cdef Transfer *t = &self.table.transfers[index]
        t.direct = alignment > 1
        t.fixed_slot = fixed_slot
        t.fixed_base = <char *>fixed_base
        t.fixed_delta = <long long>fixed_address - <long long>address
        _begin_transfer(t, op_id, chunk, is_read, direct_fd, buffered_fd, address, nbytes,
                        offset, alignment, <long long>self.block_size)


cdef class AioEngine(TransferEngine):
    """A ``TransferEngine`` on one kernel AIO context (a worker's)."""
    cdef aio_context_t ctx
    cdef iocb *slots
    cdef iocb **batch
    cdef io_event *events

    def __cinit__(self, size_t block_size, int queue_depth, bint single_submit,
                  bint overlap_events, int max_transfers=256):
        self.ctx = 0
        self.slots = NULL
        self.batch = NULL
        self.events = NULL
        if block_size == 0 or queue_depth <= 0 or max_transfers <= 0:
            raise ValueError("block_size, queue_depth and max_transfers must be positive")
        self._set_up(block_size, queue_depth, single_submit, overlap_events, max_transfers)
        self.slots = <iocb *>malloc(sizeof(iocb) * queue_depth)
        self.batch = <iocb **>malloc(sizeof(iocb *) * queue_depth)
        self.events = <io_event *>malloc(sizeof(io_event) * queue_depth)
        if not (self.slots and self.batch and self.events):
            raise MemoryError()
        self.ctx = _aio_context(queue_depth)

    def __dealloc__(self):
        if self.ctx:
            nvmeswap_io_destroy(self.ctx)   # waits for the requests still in flight
        free(self.slots)
        free(self.batch)
        free(self.events)

    def advance(self, bint block):
        """Start requests while slots are free; with ``block``, wait for completions
        first if requests are in flight. Returns the ``Completion`` of each transfer that
        has ended, oldest first."""
        cdef long ret = 0
        with nogil:
            self._start_requests()
            if self.in_flight and block:
                ret = self._reap(True)
            elif self.in_flight:
                ret = self._reap(False)
            if ret >= 0:
                self._start_requests()
        if ret < 0:
            # The context itself failed: nothing more can be reaped safely.
            raise errno_error(<int>-ret, "io_getevents")
        return _table_ended(&self.table)

    cdef void _start_requests(self) noexcept nogil:
        """Fill free slots with the next requests of the oldest transfers, and submit them."""
        cdef int k, index, slot, ready = 0, submitted, i
        cdef long long bs = <long long>self.block_size
        cdef Transfer *t
        cdef iocb *cb
        if not self.overlap_events and self.in_flight > 0:
            return
        for k in range(self.table.n_order):
            index = self.table.order[k]
            t = &self.table.transfers[index]
            while self.n_free > 0 and t.prepared < t.total and not t.out.failed:
                self.n_free -= 1
                slot = self.free_slots[self.n_free]
                cb = &self.slots[slot]
                _clear_iocb(cb)
                cb.aio_data = slot
                cb.aio_lio_opcode = IOCB_CMD_PREAD if t.is_read else IOCB_CMD_PWRITE
                cb.aio_fildes = t.fd
                cb.aio_buf = <unsigned long long>(t.buf + t.prepared * bs)
                cb.aio_nbytes = <unsigned long long>min(bs, t.nbytes - t.prepared * bs)
                cb.aio_offset = t.offset + t.prepared * bs
                self.owner[slot] = index
                self.batch[ready] = cb
                ready += 1
                t.prepared += 1
            if self.n_free == 0:
                break
        if ready == 0:
            return
        submitted = self._submit(ready)
        self.in_flight += submitted
        # Never submitted (the context is full, or refused them): give the slots back.
        for i in range(ready - 1, submitted - 1, -1):
            slot = <int>self.batch[i].aio_data
            self.table.transfers[self.owner[slot]].prepared -= 1
            self.free_slots[self.n_free] = slot
            self.n_free += 1

    cdef int _submit(self, int ready) noexcept nogil:
        """Submit batch[0:ready]; return how many the kernel took. A refusal fails the
        transfer of the refused request."""
        cdef int done = 0
        cdef long ret
        cdef Transfer *t
        while done < ready:
            if self.single_submit:
                ret = nvmeswap_io_submit(self.ctx, 1, &self.batch[done])
            else:
                ret = nvmeswap_io_submit(self.ctx, ready - done, &self.batch[done])
            if ret > 0:
                done += <int>ret     # a partial submit: resubmit the rest
            elif ret == -EINTR:
                continue
            elif ret == -EAGAIN and self.in_flight + done > 0:
                break                # the context is full: reap first, then retry
            else:
                t = &self.table.transfers[self.owner[<int>self.batch[done].aio_data]]
                if not t.out.failed:
                    _fail(&t.out, <int>(-ret if ret < 0 else EIO),
                          self.batch[done].aio_offset,
                          <long long>self.batch[done].aio_nbytes, 0)
                break
        return done

    cdef long _reap(self, bint block) noexcept nogil:
        """Reap completions (with ``block``, wait for at least one; without
        ``overlap_events``, for the whole batch). Returns how many, or -errno."""
        cdef timespec no_wait
        cdef long ret
        cdef int i, slot
        cdef Transfer *t
        cdef iocb *cb
        no_wait.tv_sec = 0
        no_wait.tv_nsec = 0
        while True:
            ret = nvmeswap_io_getevents(
                self.ctx, self._completions_to_wait() if block else 0,
                self.queue_depth, self.events, NULL if block else &no_wait)
            if ret != -EINTR:
                break
        if ret < 0:
            return ret
        for i in range(ret):
            slot = <int>self.events[i].data
            cb = &self.slots[slot]
            t = &self.table.transfers[self.owner[slot]]
            if not t.out.failed:
                _failed(&self.events[i], cb, &t.out)
            t.completed += 1
            self.free_slots[self.n_free] = slot
            self.n_free += 1
        self.in_flight -= <int>ret
        return ret


cdef class CallerQueue:
    """The calling process's own kernel AIO context, for small operations (Note [caller
    queue] in nvmeswap/io/workforce.py): each request is submitted from the calling thread
    (``submit``) or handed to the queue's submitting thread (``post``, Note [submitter]),
    and reaped in bulk; ``eventfd`` becomes readable as requests complete.

    Each request is one aligned O_DIRECT transfer. The memory of a request in flight must
    stay valid until ``reap`` has returned it; freeing the queue waits for them all.

    Note [submitter]
    On a virtual machine, io_submit of one request to an idle device costs several times
    its share of a batch: it exits to the hypervisor to notify the device. A caller
    starting small reads one by one paid that for each, in its own thread, more than
    DeepSpeed's threads spent per read. ``post`` hands the request to a thread of the
    queue's own (C, no GIL; cdeps/submitter.h) and returns: the thread submits what has
    been posted meanwhile in one call, on another core, while the caller prepares the
    next request. What the kernel refuses there comes back from ``reap`` as a failed
    request with its errno, like a failed transfer. The thread starts with the first
    post and ends with ``close``; where it cannot start, ``post`` submits in the caller.
    """
    cdef aio_context_t ctx
    cdef iocb *slots
    cdef iocb **batch           # post_many's requests, submitted together
    cdef io_event *events
    cdef int *free_slots
    cdef int n_free
    cdef unsigned long long *op_ids
    cdef unsigned int *chunks
    cdef int *refused_slots
    cdef int *refused_errnos
    cdef int n_refused          # refused to ``submit``, at the front of refused_*
    cdef nvmeswap_submitter *submitter
    cdef bint submitter_tried
    cdef pid_t creator
    cdef readonly int capacity
    cdef readonly int in_flight
    cdef readonly int eventfd
    cdef bint started           # __cinit__'s body ran (see __dealloc__)

    def __cinit__(self, int capacity):
        self.ctx = 0
        self.eventfd = -1
        self.started = True
        self.submitter = NULL
        self.creator = getpid()
        self.slots = <iocb *>malloc(sizeof(iocb) * capacity)
        self.batch = <iocb **>malloc(sizeof(iocb *) * capacity)
        self.events = <io_event *>malloc(sizeof(io_event) * capacity)
        self.free_slots = <int *>malloc(sizeof(int) * capacity)
        self.op_ids = <unsigned long long *>malloc(sizeof(unsigned long long) * capacity)
        self.chunks = <unsigned int *>malloc(sizeof(unsigned int) * capacity)
        self.refused_slots = <int *>malloc(sizeof(int) * capacity)
        self.refused_errnos = <int *>malloc(sizeof(int) * capacity)
        if not (self.slots and self.batch and self.events and self.free_slots and self.op_ids
                and self.chunks
                and self.refused_slots and self.refused_errnos):
            raise MemoryError()
        self.capacity = capacity
        self.in_flight = 0
        self.n_refused = 0
        self.n_free = capacity
        cdef int i
        for i in range(capacity):
            self.free_slots[i] = capacity - 1 - i
        cdef long ret = nvmeswap_eventfd()
        if ret < 0:
            raise errno_error(<int>-ret, "eventfd")
        self.eventfd = <int>ret
        self.ctx = _aio_context(capacity)

    def __dealloc__(self):
        if not self.started:
            return      # the arguments did not convert: the body never ran, eventfd is 0
        self._stop_submitter()
        if self.ctx:
            nvmeswap_io_destroy(self.ctx)   # waits for the requests still in flight
        if self.eventfd >= 0:
            close(self.eventfd)
        free(self.slots)
        free(self.batch)
        free(self.events)
        free(self.free_slots)
        free(self.op_ids)
        free(self.chunks)
        free(self.refused_slots)
        free(self.refused_errnos)

    def close(self):
        """Submit what is posted, wait for the requests in flight and free the context;
        idempotent."""
        self._stop_submitter()
        if self.ctx:
            with nogil:
                nvmeswap_io_destroy(self.ctx)
            self.ctx = 0
        if self.eventfd >= 0:
            close(self.eventfd)
            self.eventfd = -1
        self.in_flight = self.n_refused = 0

    cdef void _stop_submitter(self):
        # In a forked child the thread does not exist: its memory is left as it is.
        if self.submitter != NULL and getpid() == self.creator:
            with nogil:
                nvmeswap_submitter_stop(self.submitter)
        self.submitter = NULL

    def submit(self, unsigned long long op_id, unsigned int chunk, bint is_read, int fd,
               size_t address, size_t nbytes, long long offset):
        """Start one request from the calling thread; False if the queue is full. A refusal
        by the kernel comes back from ``reap``."""
        cdef long ret
        cdef int slot = self._take_slot(op_id, chunk, is_read, fd, address, nbytes, offset)
        if slot < 0:
            return False
        cdef iocb *cb = &self.slots[slot]
        with nogil:
            while True:
                ret = nvmeswap_io_submit(self.ctx, 1, &cb)
                if ret != -EINTR:
                    break
        if ret != 1:
            self._refused(slot, <int>-ret if ret < 0 else EIO)
        return True

    def post(self, unsigned long long op_id, unsigned int chunk, bint is_read, int fd,
             size_t address, size_t nbytes, long long offset):
        """Hand one request to the submitting thread (Note [submitter]); False if the queue
        is full. A refusal by the kernel comes back from ``reap``."""
        if not self.submitter_tried and self.ctx:
            self.submitter_tried = True
            self.submitter = nvmeswap_submitter_start(self.ctx, self.eventfd, self.capacity)
        if self.submitter == NULL:
            return self.submit(op_id, chunk, is_read, fd, address, nbytes, offset)
        cdef int slot = self._take_slot(op_id, chunk, is_read, fd, address, nbytes, offset)
        if slot < 0:
            return False
        nvmeswap_submitter_post(self.submitter, &self.slots[slot])
        return True

    def post_many(self, unsigned long long op_id, bint is_read, int fd, addresses, nbytes,
                  offsets):
        """Start a request per address and file offset (chunk = its index), all in one
        io_submit from the calling thread; ``nbytes`` is one size for all or one per
        request. Returns how many the queue took, from the first on: the rest did not fit.
        A refusal by the kernel comes back from ``reap``."""
        cdef int count = _count_many(addresses, nbytes, offsets)
        cdef int taken = 0, done = 0, slot
        cdef bint one_size = isinstance(nbytes, int)
        cdef long ret
        while taken < count:
            slot = self._take_slot(op_id, taken, is_read, fd, addresses[taken],
                                   nbytes if one_size else nbytes[taken], offsets[taken])
            if slot < 0:
                break
            self.batch[taken] = &self.slots[slot]
            taken += 1
        while done < taken:
            with nogil:
                ret = nvmeswap_io_submit(self.ctx, taken - done, self.batch + done)
            if ret > 0:
                done += <int>ret
            elif ret != -EINTR:     # the first request not taken is refused; on after it
                self._refused(<int>self.batch[done].aio_data, <int>-ret if ret < 0 else EIO)
                done += 1
        return taken

    cdef int _take_slot(self, unsigned long long op_id, unsigned int chunk, bint is_read,
                        int fd, size_t address, size_t nbytes, long long offset) except -2:
        """A slot filled with the request, counted in flight; -1 if none is free."""
        if self.ctx == 0:
            raise ValueError("the caller queue is closed")
        if self.n_free == 0:
            return -1
        self.n_free -= 1
        cdef int slot = self.free_slots[self.n_free]
        cdef iocb *cb = &self.slots[slot]
        _clear_iocb(cb)
        cb.aio_data = slot
        cb.aio_lio_opcode = IOCB_CMD_PREAD if is_read else IOCB_CMD_PWRITE
        cb.aio_fildes = fd
        cb.aio_buf = <unsigned long long>address
        cb.aio_nbytes = nbytes
        cb.aio_offset = offset
        cb.aio_flags = IOCB_FLAG_RESFD
        cb.aio_resfd = self.eventfd
        self.op_ids[slot] = op_id
        self.chunks[slot] = chunk
        self.in_flight += 1
        return slot

    cdef void _give_back(self, int slot):
        self.free_slots[self.n_free] = slot
        self.n_free += 1
        self.in_flight -= 1

    cdef void _refused(self, int slot, int err):
        """Keep a request the kernel refused to ``submit`` for ``reap``, as the submitting
        thread keeps those it was refused, and wake the thread reading completions."""
        cdef unsigned long long one = 1
        self.refused_slots[self.n_refused] = slot
        self.refused_errnos[self.n_refused] = err
        self.n_refused += 1
        write(self.eventfd, &one, sizeof(one))

    def reap(self, bint wait_all=False):
        """The ``Completion`` of each request that has ended, those the kernel refused
        included; with ``wait_all``, of every request in flight (GIL released while it
        waits)."""
        cdef unsigned long long counter
        cdef timespec no_wait
        cdef long ret
        cdef long min_nr
        cdef list done = []
        cdef int i, slot
        cdef iocb *cb
        cdef Outcome out
        # The counter first: a completion after it has been read signals again. (Read
        # even with nothing in flight: the last completion may have been reaped before
        # its signal arrived, which would leave the eventfd readable for nothing.)
        if self.eventfd >= 0:
            read(self.eventfd, &counter, sizeof(counter))
        if self.in_flight == 0:
            return done
        if self.submitter != NULL and wait_all:     # then every request left is the kernel's
            with nogil:
                nvmeswap_submitter_drain(self.submitter)
        self._take_refused(done)
        min_nr = self.in_flight if wait_all else 0
        if self.in_flight == 0:
            return done
        no_wait.tv_sec = 0
        no_wait.tv_nsec = 0
        while True:
            with nogil:
                ret = nvmeswap_io_getevents(self.ctx, min_nr, self.capacity, self.events,
                                            NULL if wait_all else &no_wait)
            if ret == -EINTR:
                continue
            if ret < 0:
                raise errno_error(<int>-ret, "io_getevents")
            for i in range(ret):
                slot = <int>self.events[i].data
                cb = &self.slots[slot]
                if _failed(&self.events[i], cb, &out):
                    done.append(completion(self.op_ids[slot], self.chunks[slot], out.err,
                                           out.at_offset, out.requested, out.got))
                else:
                    done.append(completion(self.op_ids[slot], self.chunks[slot], 0,
                                           cb.aio_offset, <long long>cb.aio_nbytes,
                                           <long long>cb.aio_nbytes))
                self.free_slots[self.n_free] = slot
                self.n_free += 1
            self.in_flight -= <int>ret
            min_nr -= ret
            if min_nr <= 0:
                return done

    cdef void _take_refused(self, list done):
        """Completions of the refused requests: those of ``submit`` first (kept in
        refused_*), then the submitting thread's, taken after them."""
        cdef int n = self.n_refused
        cdef int i, slot
        cdef iocb *cb
        if self.submitter != NULL:
            n += nvmeswap_submitter_take_failed(self.submitter, self.refused_slots + n,
                                                self.refused_errnos + n)
        for i in range(n):
            slot = self.refused_slots[i]
            cb = &self.slots[slot]
            done.append(completion(self.op_ids[slot], self.chunks[slot], self.refused_errnos[i],
                                   cb.aio_offset, <long long>cb.aio_nbytes, 0))
            self._give_back(slot)
        self.n_refused = 0
