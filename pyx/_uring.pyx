# cython: language_level=3, boundscheck=False, wraparound=False
"""The io_uring queues: a worker's transfer loop (``UringEngine``) and the calling
process's own queue for small requests (``UringQueue``), each on one ring; and
``probe()``, which says whether io_uring works here (Note [engines] in
nvmeswap/io/engines.py).

They are the kernel AIO queues of pyx/_queues.pyx on another interface, with the same
methods, checks and results: the same O_DIRECT split (pyx/_transfer_steps.pxd), and each
transfer or request ends in a ``Completion``, a request the kernel refused included. A
failure of the ring itself raises ``OSError`` naming the system call; misuse is a
``ValueError`` or ``RuntimeError``; a full queue is a False return. Entries are written
and published under the GIL (cdeps/io_uring.h), the kernel is entered without it.
"""
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from libc.errno cimport EAGAIN, EBUSY, EINTR
from posix.types cimport pid_t
from posix.unistd cimport close, getpid, read

from _check cimport errno_error
from _transfer_steps cimport Outcome, Transfer, _count_many, _fail, _write_rest
from _transfer_table cimport _table_ended
from nvmeswap._transfers cimport completion
from nvmeswap._queues cimport TransferEngine

from includes.io_uring cimport (
    NVMESWAP_IORING_MAX_FIXED_BUFFER, NVMESWAP_IORING_OP_READ, NVMESWAP_IORING_OP_WRITE,
    NVMESWAP_IORING_SETUP_COOP_TASKRUN, NVMESWAP_IORING_SETUP_DEFER_TASKRUN,
    NVMESWAP_IORING_SETUP_R_DISABLED, NVMESWAP_IORING_SETUP_SINGLE_ISSUER,
    nvmeswap_io_uring_cqe, nvmeswap_io_uring_params, nvmeswap_io_uring_sqe, nvmeswap_uring,
    nvmeswap_uring_adopt, nvmeswap_uring_buffer_table, nvmeswap_uring_clone_buffers,
    nvmeswap_uring_close, nvmeswap_uring_enable, nvmeswap_uring_setup,
    nvmeswap_uring_cq_advance, nvmeswap_uring_cq_ready, nvmeswap_uring_cqe, nvmeswap_uring_enter,
    nvmeswap_uring_next_sqe, nvmeswap_uring_open, nvmeswap_uring_prep_fixed,
    nvmeswap_uring_prep_rw, nvmeswap_uring_probe, nvmeswap_uring_publish,
    nvmeswap_uring_register_eventfd, nvmeswap_uring_set_buffer, nvmeswap_uring_unsubmitted,
)
from includes.kernel_aio cimport nvmeswap_eventfd
from includes.ring_submitter cimport (
    nvmeswap_ring_submitter, nvmeswap_ring_submitter_post,
    nvmeswap_ring_submitter_start, nvmeswap_ring_submitter_stop,
    nvmeswap_ring_submitter_take_error,
)

cdef enum:
    MAX_REQUEST = 0x7ffff000    # the most one request moves: Linux's MAX_RW_COUNT
    FIXED_SLOTS = 256           # registered buffers an engine holds
    CLONED_SLOTS = 128          # of them, those cloned from a BufferRegistry (the first)

# A worker's ring: one thread submits and waits, and completions are posted when it waits
# for them instead of interrupting it (Note [engines] in io/engines.py).
cdef unsigned WORKER_RING_FLAGS = (NVMESWAP_IORING_SETUP_SINGLE_ISSUER
                                   | NVMESWAP_IORING_SETUP_DEFER_TASKRUN)

# Note [cloned buffers]
# A worker's transfer through memory it has never touched costs it the page tables of every
# page (half of a first transfer's CPU), and pinning each request's pages costs kernel AIO
# most of the rest. With io_uring the parent can pin once for all its workers: it
# registers a region with a ring of its own (``BufferRegistry``, through its own page
# tables, 0.03 s a GiB) when a handle makes the region (a locked tensor: pinned as its
# locking promised) or first maps it to a worker, and each worker's ring takes those
# pinned pages by cloning the registry's slots when it maps the region
# (IORING_REGISTER_CLONE_BUFFERS, Linux 6.13: microseconds). A transfer
# names the slots (``begin(fixed_slot=...)``) and the address the parent registered, so
# the worker's own mapping of the region is touched only by the unaligned head and tail.
# The kernel clones buffers only between rings one process made (a ring made by the worker
# gets EINVAL), so the parent makes each worker's ring (``make_worker_ring``), disabled,
# and the worker adopts and enables it (``UringEngine(ring=...)``): it is then the one
# thread that submits. io_uring descriptors cannot travel over a socket (SCM_RIGHTS refuses
# them), so each worker inherits its ring and the registry when it starts. Where the kernel
# clones nothing (``clone_supported``), workers make their own rings and register regions
# themselves (workers/main.py). Registry slots are the table's first ``CLONED_SLOTS``, a
# worker's own registrations the rest. Registered buffers serve only O_DIRECT descriptors:
# a file without read_iter/write_iter (procfs) refuses them (EFAULT).


cdef long _open_ring(nvmeswap_uring *ring, int entries, unsigned flags) except -1:
    """``ring`` made and mapped for ``entries`` requests in flight (room for twice as many
    completions: the completion queue never overflows)."""
    cdef long ret = nvmeswap_uring_open(ring, <unsigned>entries, 2 * <unsigned>entries, flags)
    if ret < 0:
        raise errno_error(<int>-ret, "io_uring_setup")
    return 0


cdef inline int _cloned_slot(Transfer *t, long long at, unsigned nbytes) noexcept nogil:
    """The cloned slot (Note [cloned buffers]) that holds ``nbytes`` at ``at`` of the
    transfer's middle, or -1 (none named, or the request spans two slots)."""
    cdef long long start, within
    if t.fixed_slot < 0:
        return -1
    start = <long long>(t.buf + at + t.fixed_delta - t.fixed_base)
    within = start % <long long>NVMESWAP_IORING_MAX_FIXED_BUFFER
    if start < 0 or within + nbytes > <long long>NVMESWAP_IORING_MAX_FIXED_BUFFER:
        return -1
    return t.fixed_slot + <int>(start // <long long>NVMESWAP_IORING_MAX_FIXED_BUFFER)


def make_worker_ring(int queue_depth):
    """A ring for a worker's ``UringEngine`` (Note [cloned buffers]), made here, disabled
    until the worker enables it: ``(descriptor, flags taken, parameters)``, for
    ``UringEngine(..., ring=...)`` in the worker. The caller closes its descriptor once
    the worker has its own copy."""
    cdef nvmeswap_io_uring_params p
    cdef unsigned flags = WORKER_RING_FLAGS | NVMESWAP_IORING_SETUP_R_DISABLED
    if queue_depth <= 0:
        raise ValueError("queue_depth must be positive")
    cdef long ret = nvmeswap_uring_setup(<unsigned>queue_depth, 2 * <unsigned>queue_depth,
                                         &flags, &p)
    if ret < 0:
        raise errno_error(<int>-ret, "io_uring_setup")
    return <int>ret, flags, (<char *>&p)[:sizeof(p)]


cdef long _settle(nvmeswap_uring *ring, int in_flight, unsigned wanted) noexcept nogil:
    """Submit what is published and wait until ``wanted`` completions are ready (of the
    ``in_flight`` requests not yet reaped); 0, or -errno where the ring failed.

    A kernel short of resources (EAGAIN, EBUSY) takes the published requests at a later
    enter: until then, completions of the others are waited for instead."""
    cdef long ret
    cdef unsigned pending, ready
    while True:
        ready = nvmeswap_uring_cq_ready(ring)
        pending = nvmeswap_uring_unsubmitted(ring)
        if ready >= wanted and pending == 0:
            return 0
        ret = nvmeswap_uring_enter(ring, pending, wanted if ready < wanted else 0)
        if ret == -EAGAIN or ret == -EBUSY:
            if ready >= wanted:
                return 0
            if <unsigned>in_flight > pending + ready:   # some are the kernel's: wait for one
                ret = nvmeswap_uring_enter(ring, 0, ready + 1)
        if ret < 0 and ret != -EINTR:
            return ret
        if ret == 0 and pending and wanted == 0:
            return 0    # none taken now: the next enter offers them again


cdef class UringEngine(TransferEngine):
    """A ``TransferEngine`` (pyx/_queues.pyx) on one ring (a worker's): ``AioEngine`` on
    io_uring. Without ``single_submit``, the requests of a batch and the wait for the
    previous ones go to the kernel in one ``io_uring_enter``.

    ``register_buffers`` registers memory with the ring (io_uring's fixed buffers): the
    kernel pins it once, not at every request (IORING_OP_READ_FIXED/WRITE_FIXED); a
    worker registers a region it moves twice (workers/main.py, Note [engines]).
    """
    cdef nvmeswap_uring ring
    cdef long long *slot_offset
    cdef unsigned *slot_nbytes
    cdef pid_t creator
    cdef int buffer_table       # registered buffers: 0 no table yet, 1 made, -1 refused
    cdef size_t fixed_owner[FIXED_SLOTS]    # the address registered (0: a free slot)
    cdef char *fixed_start[FIXED_SLOTS]
    cdef char *fixed_end[FIXED_SLOTS]
    cdef int n_fixed, last_fixed    # slots in use; the slot the last request was found in
    cdef bint started           # __cinit__'s body ran (see __dealloc__)

    def __cinit__(self, size_t block_size, int queue_depth, bint single_submit,
                  bint overlap_events, int max_transfers=256, ring=None):
        self.ring.fd = -1
        self.started = True
        self.creator = getpid()
        cdef int adopted = -1 if ring is None else ring[0]
        try:
            if block_size == 0 or block_size > MAX_REQUEST or queue_depth <= 0 \
                    or max_transfers <= 0:
                raise ValueError("block_size (at most 2 GiB - 4 KiB), queue_depth and "
                                 "max_transfers must be positive")
            self._set_up(block_size, queue_depth, single_submit, overlap_events,
                         max_transfers)
            self.slot_offset = <long long *>malloc(sizeof(long long) * queue_depth)
            self.slot_nbytes = <unsigned *>malloc(sizeof(unsigned) * queue_depth)
            if not (self.slot_offset and self.slot_nbytes):
                raise MemoryError()
        except BaseException:
            if adopted >= 0:
                close(adopted)
            raise
        if ring is None:
            _open_ring(&self.ring, queue_depth, WORKER_RING_FLAGS)
        else:
            self._adopt(adopted, ring[1], ring[2])

    cdef int _adopt(self, int fd, unsigned flags, bytes params) except -1:
        """Take the ring ``make_worker_ring`` made in the parent, and start it."""
        cdef nvmeswap_io_uring_params p
        cdef long ret
        if len(params) != sizeof(p):
            close(fd)
            raise ValueError(f"io_uring parameters are {sizeof(p)} bytes, not {len(params)}")
        memcpy(&p, <char *>params, sizeof(p))
        ret = nvmeswap_uring_adopt(&self.ring, fd, &p, flags)     # closes fd if it fails
        if ret < 0:
            raise errno_error(<int>-ret, "mmap")
        if flags & NVMESWAP_IORING_SETUP_R_DISABLED:
            ret = nvmeswap_uring_enable(&self.ring)
            if ret < 0:
                nvmeswap_uring_close(&self.ring)
                raise errno_error(<int>-ret, "io_uring_register")
        return 0

    def __dealloc__(self):
        if not self.started:
            return      # the arguments did not convert: the body never ran, ring.fd is 0
        # The kernel writes into the transfers' memory until their requests complete.
        if self.ring.fd >= 0 and self.in_flight and getpid() == self.creator:
            with nogil:
                _settle(&self.ring, self.in_flight, <unsigned>self.in_flight)
        nvmeswap_uring_close(&self.ring)
        free(self.slot_offset)
        free(self.slot_nbytes)

    def register_buffers(self, size_t address, size_t nbytes):
        """Register ``nbytes`` at ``address`` with the ring (in pieces of at most 1 GiB):
        the requests inside it then skip pinning its pages. True if registered; False if
        the kernel refuses (before Linux 5.19, or beyond RLIMIT_MEMLOCK without
        CAP_IPC_LOCK) or the table is full: its requests then go as any others do. The
        memory stays mapped until ``unregister_buffers(address)``."""
        cdef size_t pieces = (nbytes + NVMESWAP_IORING_MAX_FIXED_BUFFER - 1) \
            // NVMESWAP_IORING_MAX_FIXED_BUFFER
        cdef size_t done = 0, length
        cdef int slot = 0
        if self.ring.fd < 0 or nbytes == 0 or address == 0:
            return False
        if not self._has_table() or self.n_fixed + <int>pieces > FIXED_SLOTS - CLONED_SLOTS:
            return False
        slot = CLONED_SLOTS
        while done < nbytes:
            while self.fixed_owner[slot]:
                slot += 1
            length = min(nbytes - done, <size_t>NVMESWAP_IORING_MAX_FIXED_BUFFER)
            if nvmeswap_uring_set_buffer(&self.ring, slot, <void *>(address + done), length):
                self.unregister_buffers(address)
                return False
            self.fixed_owner[slot] = address
            self.fixed_start[slot] = <char *>(address + done)
            self.fixed_end[slot] = <char *>(address + done + length)
            self.n_fixed += 1
            done += length
        return True

    cdef bint _has_table(self):
        """Whether the ring has its table of registered buffers (made the first time)."""
        if self.buffer_table == 0:
            self.buffer_table = 1 if nvmeswap_uring_buffer_table(&self.ring, FIXED_SLOTS) == 0 \
                else -1
        return self.buffer_table > 0

    def clone_buffers(self, int registry_fd, int first, int count):
        """Take slots ``first`` .. ``first + count - 1`` of a ``BufferRegistry``'s ring
        (Note [cloned buffers]); True if the kernel did. Transfers then name them with
        ``begin(fixed_slot=first, ...)`` until ``drop_buffers``."""
        if (self.ring.fd < 0 or first < 0 or count <= 0 or first + count > CLONED_SLOTS
                or not self._has_table()):
            return False
        return nvmeswap_uring_clone_buffers(&self.ring, registry_fd, <unsigned>first,
                                            <unsigned>count) == 0

    def drop_buffers(self, int first, int count):
        """Empty slots taken by ``clone_buffers``; a request in flight keeps its pages until
        it completes."""
        cdef int slot
        if 0 <= first and first + count <= CLONED_SLOTS and self.buffer_table > 0:
            for slot in range(first, first + count):
                nvmeswap_uring_set_buffer(&self.ring, slot, NULL, 0)

    def unregister_buffers(self, size_t address):
        """Undo ``register_buffers(address, ...)`` (nothing if it was not registered), before
        the memory is unmapped; a request in flight keeps its pages until it completes."""
        cdef int slot
        for slot in range(FIXED_SLOTS):
            if self.fixed_owner[slot] == address and address:
                nvmeswap_uring_set_buffer(&self.ring, slot, NULL, 0)
                self.fixed_owner[slot] = 0
                self.fixed_start[slot] = self.fixed_end[slot] = NULL
                self.n_fixed -= 1

    cdef int _fixed_slot(self, char *start, unsigned nbytes) noexcept nogil:
        """The registered buffer that holds ``nbytes`` at ``start``, or -1 (looked for from
        the last one found on; a free slot ends at NULL and holds nothing)."""
        cdef int k, slot
        for k in range(FIXED_SLOTS if self.n_fixed else 0):
            slot = (self.last_fixed + k) % FIXED_SLOTS
            if self.fixed_start[slot] <= start and start + nbytes <= self.fixed_end[slot]:
                self.last_fixed = slot
                return slot
        return -1

    def advance(self, bint block):
        """Start requests while slots are free; with ``block``, wait for completions
        first if requests are in flight. Returns the ``Completion`` of each transfer that
        has ended, oldest first."""
        cdef long ret = 0
        with nogil:
            self._fill()
            if self.single_submit:
                ret = self._submit_one_by_one()
            if ret >= 0 and self.in_flight:
                ret = _settle(&self.ring, self.in_flight,
                              <unsigned>self._completions_to_wait() if block else 0)
            if ret >= 0:
                self._reap()
                self._fill()
                ret = self._submit_one_by_one() if self.single_submit else \
                    _settle(&self.ring, self.in_flight, 0)
        if ret < 0:
            # The ring itself failed: nothing more can be reaped safely.
            raise errno_error(<int>-ret, "io_uring_enter")
        return _table_ended(&self.table)

    cdef void _fill(self) noexcept nogil:
        """Write the next requests of the oldest transfers into free slots and publish
        them (without ``overlap_events``, only once the previous batch has completed)."""
        cdef int k, index, slot, fixed, ready = 0
        cdef long long bs = <long long>self.block_size
        cdef long long at
        cdef char *address
        cdef Transfer *t
        cdef nvmeswap_io_uring_sqe *sqe
        if not self.overlap_events and self.in_flight > 0:
            return
        for k in range(self.table.n_order):
            index = self.table.order[k]
            t = &self.table.transfers[index]
            while self.n_free > 0 and t.prepared < t.total and not t.out.failed:
                self.n_free -= 1
                slot = self.free_slots[self.n_free]
                at = t.prepared * bs
                self.owner[slot] = index
                self.slot_offset[slot] = t.offset + at
                self.slot_nbytes[slot] = <unsigned>min(bs, t.nbytes - at)
                sqe = nvmeswap_uring_next_sqe(&self.ring)
                # Registered buffers only on O_DIRECT: a file without read_iter/write_iter
                # (procfs) refuses them (EFAULT), and buffered I/O copies the bytes anyway.
                fixed = _cloned_slot(t, at, self.slot_nbytes[slot]) if t.direct else -1
                address = t.buf + at + (t.fixed_delta if fixed >= 0 else 0)
                nvmeswap_uring_prep_rw(
                    sqe, NVMESWAP_IORING_OP_READ if t.is_read else NVMESWAP_IORING_OP_WRITE,
                    t.fd, <unsigned long long>address, self.slot_nbytes[slot],
                    self.slot_offset[slot], slot)
                if fixed < 0 and t.direct:
                    fixed = self._fixed_slot(t.buf + at, self.slot_nbytes[slot])
                if fixed >= 0:
                    nvmeswap_uring_prep_fixed(sqe, fixed)
                ready += 1
                t.prepared += 1
            if self.n_free == 0:
                break
        if ready:
            nvmeswap_uring_publish(&self.ring)
            self.in_flight += ready

    cdef long _submit_one_by_one(self) noexcept nogil:
        """``single_submit``: one enter per published request; 0 or -errno."""
        cdef long ret = 1
        while ret != 0 and nvmeswap_uring_unsubmitted(&self.ring):
            ret = nvmeswap_uring_enter(&self.ring, 1, 0)
            if ret < 0 and ret != -EINTR:   # what a refusal means is _settle's to say
                return _settle(&self.ring, self.in_flight, 0)
        return 0

    cdef void _reap(self) noexcept nogil:
        """Read every completion ready into its transfer's outcome."""
        cdef unsigned i, n = nvmeswap_uring_cq_ready(&self.ring)
        cdef int slot
        cdef Transfer *t
        cdef nvmeswap_io_uring_cqe *cqe
        for i in range(n):
            cqe = nvmeswap_uring_cqe(&self.ring, i)
            slot = <int>cqe.user_data
            t = &self.table.transfers[self.owner[slot]]
            if t.out.failed or cqe.res == <int>self.slot_nbytes[slot]:
                pass
            elif cqe.res >= 0 and not t.is_read:
                _write_rest(t.fd, t.buf + (self.slot_offset[slot] - t.offset),
                            self.slot_offset[slot], self.slot_nbytes[slot], cqe.res, &t.out)
            else:
                _fail(&t.out, -cqe.res if cqe.res < 0 else 0, self.slot_offset[slot],
                      self.slot_nbytes[slot], cqe.res if cqe.res > 0 else 0)
            t.completed += 1
            self.free_slots[self.n_free] = slot
            self.n_free += 1
        nvmeswap_uring_cq_advance(&self.ring, n)
        self.in_flight -= <int>n


cdef class UringQueue:
    """The calling process's own ring, for small operations (Note [caller queue] in
    nvmeswap/io/workforce.py): ``CallerQueue`` (pyx/_queues.pyx) on io_uring, with its
    interface. ``post`` hands what it published to a thread of the queue's own
    (cdeps/ring_submitter.h: Note [submitter] in pyx/_queues.pyx, on a ring), started by
    the first post and ended by ``close``. ``eventfd`` becomes readable as requests
    complete (it is registered with the ring); completions are read from the ring
    without a system call.

    Each request is one aligned O_DIRECT transfer. The memory of a request in flight must
    stay valid until ``reap`` has returned it; closing the queue waits for them all.
    """
    cdef nvmeswap_uring ring
    cdef int *free_slots
    cdef int n_free
    cdef unsigned long long *op_ids
    cdef unsigned int *chunks
    cdef long long *offsets
    cdef unsigned *sizes
    cdef size_t *addresses
    cdef int *write_fds         # a write's descriptor (its rest, if cut short: _write_rest)
    cdef nvmeswap_ring_submitter *submitter
    cdef bint submitter_tried
    cdef pid_t creator
    cdef readonly int capacity
    cdef readonly int in_flight
    cdef readonly int eventfd
    cdef bint started           # __cinit__'s body ran (see __dealloc__)

    def __cinit__(self, int capacity):
        self.ring.fd = -1
        self.eventfd = -1
        self.started = True
        self.creator = getpid()
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.free_slots = <int *>malloc(sizeof(int) * capacity)
        self.op_ids = <unsigned long long *>malloc(sizeof(unsigned long long) * capacity)
        self.chunks = <unsigned int *>malloc(sizeof(unsigned int) * capacity)
        self.offsets = <long long *>malloc(sizeof(long long) * capacity)
        self.sizes = <unsigned *>malloc(sizeof(unsigned) * capacity)
        self.addresses = <size_t *>malloc(sizeof(size_t) * capacity)
        self.write_fds = <int *>malloc(sizeof(int) * capacity)
        if not (self.free_slots and self.op_ids and self.chunks and self.offsets and self.sizes
                and self.addresses and self.write_fds):
            raise MemoryError()
        self.capacity = capacity
        cdef int i
        for i in range(capacity):
            self.free_slots[i] = capacity - 1 - i
        self.n_free = capacity
        cdef long ret = nvmeswap_eventfd()
        if ret < 0:
            raise errno_error(<int>-ret, "eventfd")
        self.eventfd = <int>ret
        # No interrupt of a running submitter for each completion (Note [engines]).
        _open_ring(&self.ring, capacity, NVMESWAP_IORING_SETUP_COOP_TASKRUN)
        ret = nvmeswap_uring_register_eventfd(&self.ring, self.eventfd)
        if ret < 0:
            raise errno_error(<int>-ret, "io_uring_register")

    def __dealloc__(self):
        if not self.started:
            return      # the arguments did not convert: the body never ran, the fds are 0
        self._release()
        free(self.free_slots)
        free(self.op_ids)
        free(self.chunks)
        free(self.offsets)
        free(self.sizes)
        free(self.addresses)
        free(self.write_fds)

    def close(self):
        """Submit what is posted, wait for the requests in flight and free the ring;
        idempotent."""
        self._release()

    cdef void _release(self):
        # In a forked child the ring is the parent's: its copy is dropped, never waited on,
        # and the thread does not exist: its memory is left as it is.
        if self.submitter != NULL and getpid() == self.creator:
            with nogil:
                nvmeswap_ring_submitter_stop(self.submitter)
        self.submitter = NULL
        if self.ring.fd >= 0 and self.in_flight and getpid() == self.creator:
            with nogil:
                _settle(&self.ring, self.in_flight, <unsigned>self.in_flight)
        nvmeswap_uring_close(&self.ring)
        if self.eventfd >= 0:
            close(self.eventfd)
            self.eventfd = -1
        self.in_flight = 0

    def submit(self, unsigned long long op_id, unsigned int chunk, bint is_read, int fd,
               size_t address, size_t nbytes, long long offset):
        """Start one request from the calling thread; False if the queue is full. A refusal
        by the kernel comes back from ``reap``."""
        if self._take_slot(op_id, chunk, is_read, fd, address, nbytes, offset) < 0:
            return False
        nvmeswap_uring_publish(&self.ring)
        self._push()
        return True

    def post(self, unsigned long long op_id, unsigned int chunk, bint is_read, int fd,
             size_t address, size_t nbytes, long long offset):
        """Hand one request to the submitting thread; False if the queue is full. A refusal
        by the kernel comes back from ``reap``."""
        if not self.submitter_tried and self.ring.fd >= 0:
            self.submitter_tried = True
            self.submitter = nvmeswap_ring_submitter_start(&self.ring)
        if self.submitter == NULL:
            return self.submit(op_id, chunk, is_read, fd, address, nbytes, offset)
        if self._take_slot(op_id, chunk, is_read, fd, address, nbytes, offset) < 0:
            return False
        nvmeswap_uring_publish(&self.ring)
        nvmeswap_ring_submitter_post(self.submitter)
        return True

    def post_many(self, unsigned long long op_id, bint is_read, int fd, addresses, nbytes,
                  offsets):
        """Start a request per address and file offset (chunk = its index), all with one
        system call; ``nbytes`` is one size for all or one per request. Returns how many
        the queue took, from the first on: the rest did not fit."""
        cdef int count = _count_many(addresses, nbytes, offsets)
        cdef int taken = 0
        cdef bint one_size = isinstance(nbytes, int)
        while taken < count and self._take_slot(
                op_id, taken, is_read, fd, addresses[taken],
                nbytes if one_size else nbytes[taken], offsets[taken]) >= 0:
            taken += 1
        if taken:
            nvmeswap_uring_publish(&self.ring)
            self._push()
        return taken

    cdef int _take_slot(self, unsigned long long op_id, unsigned int chunk, bint is_read,
                        int fd, size_t address, size_t nbytes, long long offset) except -2:
        """A slot and a submission entry filled with the request (not yet published),
        counted in flight; -1 if none is free."""
        if self.ring.fd < 0:
            raise ValueError("the caller queue is closed")
        if nbytes > MAX_REQUEST:
            raise ValueError(f"a request moves at most {MAX_REQUEST} bytes, not {nbytes}")
        if self.n_free == 0:
            return -1
        self.n_free -= 1
        cdef int slot = self.free_slots[self.n_free]
        # Never NULL: every slot in flight holds at most one entry, and there are as many.
        nvmeswap_uring_prep_rw(nvmeswap_uring_next_sqe(&self.ring),
                               NVMESWAP_IORING_OP_READ if is_read else NVMESWAP_IORING_OP_WRITE,
                               fd, address, <unsigned>nbytes, offset, slot)
        self.op_ids[slot] = op_id
        self.chunks[slot] = chunk
        self.offsets[slot] = offset
        self.sizes[slot] = <unsigned>nbytes
        self.addresses[slot] = address
        self.write_fds[slot] = -1 if is_read else fd
        self.in_flight += 1
        return slot

    cdef void _push(self) except *:
        """Submit what is published, GIL released (and raise what failed in the thread)."""
        cdef long ret = 0
        if self.submitter != NULL:
            ret = nvmeswap_ring_submitter_take_error(self.submitter)
        if ret == 0:
            with nogil:
                ret = _settle(&self.ring, self.in_flight, 0)
        if ret < 0:
            raise errno_error(<int>-ret, "io_uring_enter")

    def reap(self, bint wait_all=False):
        """The ``Completion`` of each request that has ended, those the kernel refused
        included; with ``wait_all``, of every request in flight (GIL released while it
        waits)."""
        cdef unsigned long long counter
        cdef list done = []
        cdef long ret
        cdef int wanted, missing
        # The counter first: a completion after it has been read signals again. (Read
        # even with nothing in flight, as CallerQueue.reap does.)
        if self.eventfd >= 0:
            read(self.eventfd, &counter, sizeof(counter))
        if self.in_flight == 0:
            return done
        wanted = self.in_flight if wait_all else 0
        while True:
            missing = max(0, wanted - <int>len(done))
            with nogil:
                ret = _settle(&self.ring, self.in_flight, <unsigned>missing)
            if ret < 0:
                raise errno_error(<int>-ret, "io_uring_enter")
            self._take_ready(done)
            if len(done) >= wanted:
                return done

    cdef void _take_ready(self, list done):
        cdef unsigned i, n = nvmeswap_uring_cq_ready(&self.ring)
        cdef nvmeswap_io_uring_cqe *cqe
        cdef int slot, res
        cdef Outcome rest
        for i in range(n):
            cqe = nvmeswap_uring_cqe(&self.ring, i)
            slot = <int>cqe.user_data
            res = cqe.res
            rest.failed = False
            if self.write_fds[slot] >= 0 and 0 <= res < <int>self.sizes[slot] and _write_rest(
                    self.write_fds[slot], <char *>self.addresses[slot], self.offsets[slot],
                    self.sizes[slot], res, &rest):
                res = <int>self.sizes[slot]
            if rest.failed:
                done.append(completion(self.op_ids[slot], self.chunks[slot], rest.err,
                                       rest.at_offset, rest.requested, rest.got))
            else:
                done.append(completion(self.op_ids[slot], self.chunks[slot],
                                       -res if res < 0 else 0, self.offsets[slot],
                                       self.sizes[slot], res if res > 0 else 0))
            self.free_slots[self.n_free] = slot
            self.n_free += 1
        nvmeswap_uring_cq_advance(&self.ring, n)
        self.in_flight -= <int>n


cdef class BufferRegistry:
    """The parent's registrations of its regions, on a ring of its own that only holds
    them, for its workers' rings to clone (Note [cloned buffers]). ``register`` pins a
    region's pages (they must be mapped here), ``unregister`` lets them go once no worker
    ring holds a clone."""
    cdef nvmeswap_uring ring
    cdef bint used[CLONED_SLOTS]

    def __cinit__(self):
        self.ring.fd = -1
        _open_ring(&self.ring, 1, 0)
        cdef long ret = nvmeswap_uring_buffer_table(&self.ring, CLONED_SLOTS)
        if ret < 0:
            nvmeswap_uring_close(&self.ring)
            raise errno_error(<int>-ret, "io_uring_register")

    def __dealloc__(self):
        nvmeswap_uring_close(&self.ring)

    @property
    def fd(self):
        """The ring's descriptor, for a worker's ``UringEngine.clone_buffers``."""
        return self.ring.fd

    def register(self, size_t address, size_t nbytes):
        """Register ``nbytes`` at ``address`` in consecutive slots of at most 1 GiB each:
        ``(first slot, count)``, or None if the kernel refuses (RLIMIT_MEMLOCK without
        CAP_IPC_LOCK) or no run of free slots is long enough."""
        cdef int count = <int>((nbytes + NVMESWAP_IORING_MAX_FIXED_BUFFER - 1)
                               // NVMESWAP_IORING_MAX_FIXED_BUFFER)
        cdef int first, k
        cdef size_t at
        if self.ring.fd < 0 or nbytes == 0 or address == 0:
            return None
        for first in range(CLONED_SLOTS - count + 1):
            if any(self.used[first + k] for k in range(count)):
                continue
            for k in range(count):
                at = <size_t>k * NVMESWAP_IORING_MAX_FIXED_BUFFER
                if nvmeswap_uring_set_buffer(&self.ring, first + k, <void *>(address + at),
                                             min(nbytes - at,
                                                 <size_t>NVMESWAP_IORING_MAX_FIXED_BUFFER)):
                    self.unregister(first, k)
                    return None
                self.used[first + k] = True
            return first, count
        return None

    def unregister(self, int first, int count):
        """Empty slots ``register`` filled; worker rings keep what they cloned."""
        cdef int slot
        for slot in range(max(first, 0), min(first + count, CLONED_SLOTS)):
            if self.used[slot] and self.ring.fd >= 0:
                nvmeswap_uring_set_buffer(&self.ring, slot, NULL, 0)
            self.used[slot] = False

    def close(self):
        """Empty every slot and close the ring; idempotent."""
        nvmeswap_uring_close(&self.ring)
        cdef int slot
        for slot in range(CLONED_SLOTS):
            self.used[slot] = False


_clones = None


def clone_supported():
    """Whether a ring made here takes another one's registered buffers, a range of them
    in place (Note [cloned buffers]): tried once per process."""
    global _clones
    if _clones is None:
        _clones = _try_clone()
    return _clones


def _try_clone():
    import mmap

    from nvmeswap._memory import buffer_address
    try:
        registry = BufferRegistry()
    except OSError:
        return False
    page = mmap.mmap(-1, 4096)
    try:
        if registry.register(buffer_address(page, True)[0], 4096) is None:
            return False
        engine = UringEngine(4096, 1, False, True, ring=make_worker_ring(1))
        return engine.clone_buffers(registry.fd, 0, 1)
    except OSError:
        return False
    finally:
        registry.close()
        page.close()


def probe():
    """None if io_uring works here (a ring made, an eventfd registered with it, a request
    submitted and completed); else why not, in one sentence."""
    return (_refusal() or (0, None))[1]


def _refusal():
    """None if io_uring works here; else ``(errno, why not)``."""
    cdef const char *which = NULL
    cdef long ret = nvmeswap_eventfd()
    if ret < 0:
        return -ret, f"eventfd failed: {errno_error(<int>-ret)}"
    cdef int fd = <int>ret
    with nogil:
        ret = nvmeswap_uring_probe(fd, &which)
    close(fd)
    if ret == 0:
        return None
    return -ret, _reason(<int>-ret, which.decode())


def _reason(int err, str call):
    import errno, os, pathlib
    name = f"{errno.errorcode.get(err, err)}: {os.strerror(err)}"
    if err == errno.EOPNOTSUPP:
        return "the kernel's io_uring is older than Linux 5.6 (no IORING_OP_READ/WRITE)"
    if err == errno.ENOSYS:
        return (f"{call} is not available ({name}): the kernel was built without io_uring, "
                "or a seccomp profile (a container's) blocks it")
    if err != errno.EPERM:
        return f"{call} failed ({name})"
    knob = pathlib.Path("/proc/sys/kernel/io_uring_disabled")      # there since Linux 6.6
    disabled = knob.read_text().strip() if knob.exists() else "0"
    return f"{call} was refused ({name}): " + {
        "1": "kernel.io_uring_disabled=1 allows it only to the group kernel.io_uring_group, "
             "and this process is not in it",
        "2": "kernel.io_uring_disabled=2 turns it off"}.get(
        disabled, "a security policy (seccomp, an LSM) forbids it")
