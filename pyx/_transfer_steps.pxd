# The steps of a transfer, written once for every extension: its outcome, the O_DIRECT
# split and the buffered edges (pyx/_queues.pyx, pyx/_uring.pyx and pyx/_transfers.pyx),
# an engine's record of a transfer in progress (both engines), a kernel AIO context and
# its requests (both queues of pyx/_queues.pyx). Inline: nothing is imported at run time.
from libc.errno cimport EINTR, EINVAL

from _check cimport errno_error
from includes.kernel_aio cimport (
    IOCB_CMD_PWRITE, aio_context_t, iocb, io_event, nvmeswap_io_setup, nvmeswap_pread,
    nvmeswap_pwrite,
)


cdef struct Outcome:
    # The first failure: its errno (0 for a short transfer), where it happened, and
    # how many of the bytes requested there came back. Until then: the whole transfer,
    # every byte of it got.
    bint failed
    int err
    long long at_offset
    long long requested
    long long got


cdef struct Transfer:
    # A transfer in an engine (Note [concurrent transfers] in pyx/_queues.pyx).
    unsigned long long op_id
    unsigned int chunk
    bint is_read
    int fd
    char *buf           # the O_DIRECT middle: its memory, length and file offset
    long long nbytes
    long long offset
    long long total     # requests it takes
    long long prepared
    long long completed
    Outcome out         # once failed, no more of its requests start
    bint direct         # ``fd`` is O_DIRECT (always read_iter/write_iter in the kernel)
    int fixed_slot      # io_uring: the first registered buffer holding its memory, or -1
    long long fixed_delta   # what to add to ``buf`` for the address registered there
    char *fixed_base    # the registered address of slot ``fixed_slot``'s start


cdef inline void _fail(Outcome *out, int err, long long at, long long requested,
                       long long got) noexcept nogil:
    out.failed = True
    out.err = err
    out.at_offset = at
    out.requested = requested
    out.got = got


cdef inline void _split(long long offset, long long end, long long a, long long *middle_start,
                        long long *middle_end) noexcept nogil:
    middle_start[0] = min(end, (offset + a - 1) // a * a)
    middle_end[0] = max(middle_start[0], end // a * a)


cdef inline void _plain_transfer(bint is_read, int fd, char *buf, long long nbytes,
                                 long long offset, Outcome *out) noexcept nogil:
    """pread/pwrite until done; a read that meets end of file is a short transfer. A
    failure says what a kernel AIO request of the same bytes would: this offset, these
    bytes, and how many of them moved."""
    cdef long long done = 0
    cdef long ret
    while done < nbytes:
        if is_read:
            ret = nvmeswap_pread(fd, buf + done, nbytes - done, offset + done)
        else:
            ret = nvmeswap_pwrite(fd, buf + done, nbytes - done, offset + done)
        if ret == -EINTR:
            continue
        if ret < 0:
            _fail(out, <int>-ret, offset, nbytes, done)
            return
        if ret == 0:
            _fail(out, 0, offset, nbytes, done)
            return
        done += ret


cdef inline bint _write_rest(int fd, char *buf, long long offset, long long nbytes,
                             long long wrote, Outcome *out) noexcept nogil:
    """Note [short writes]: the kernel cuts a write request short where a limit falls
    inside it (the filesystem's largest file, the file-size limit, the disk's room), and a
    short count does not say which. Asked again, the rest is refused with the limit's own
    errno (EFBIG, ENOSPC, EDQUOT), as the synchronous road reports it. So a request that
    wrote ``wrote`` of its ``nbytes`` has the rest written here with pwrite: True if it
    went, else ``out`` says how it failed."""
    cdef Outcome rest
    rest.failed = False
    _plain_transfer(False, fd, buf + wrote, nbytes - wrote, offset + wrote, &rest)
    if rest.failed:
        out[0] = rest
    return not rest.failed


cdef inline void _move_edges(bint is_read, int buffered_fd, size_t address, size_t nbytes,
                             long long offset, size_t alignment, Outcome *out,
                             long long *middle_start, long long *middle_end):
    """Check a transfer's alignment, move its unaligned head and tail through the
    buffered descriptor (Note [O_DIRECT tail]), and say where its aligned middle is.
    ``out`` starts as the whole transfer's success."""
    cdef long long end = offset + <long long>nbytes
    out.failed = False
    out.err = 0
    out.at_offset = offset
    out.requested = out.got = <long long>nbytes
    middle_start[0] = middle_end[0] = offset
    if alignment == 0 or (address - <size_t>offset) % alignment:
        _fail(out, EINVAL, offset, nbytes, 0)
        return
    _split(offset, end, <long long>alignment, middle_start, middle_end)
    if (middle_start[0] > offset or middle_end[0] < end) and buffered_fd < 0:
        _fail(out, EINVAL, offset, nbytes, 0)
        return
    with nogil:
        if middle_start[0] > offset:
            _plain_transfer(is_read, buffered_fd, <char *>address, middle_start[0] - offset,
                            offset, out)
        if not out.failed and end > middle_end[0]:
            _plain_transfer(is_read, buffered_fd, <char *>address + (middle_end[0] - offset),
                            end - middle_end[0], middle_end[0], out)


cdef inline void _begin_transfer(Transfer *t, unsigned long long op_id, unsigned int chunk,
                                 bint is_read, int direct_fd, int buffered_fd, size_t address,
                                 size_t nbytes, long long offset, size_t alignment,
                                 long long block_size):
    """An engine's new transfer: its head and tail moved now (``_move_edges``), its
    aligned middle left as ``total`` requests of ``block_size`` on ``direct_fd``."""
    cdef long long middle_start, middle_end
    t.op_id = op_id
    t.chunk = chunk
    t.is_read = is_read
    t.total = t.prepared = t.completed = 0
    _move_edges(is_read, buffered_fd, address, nbytes, offset, alignment, &t.out,
                &middle_start, &middle_end)
    if not t.out.failed and middle_end > middle_start:
        t.fd = direct_fd
        t.buf = <char *>address + (middle_start - offset)
        t.nbytes = middle_end - middle_start
        t.offset = middle_start
        t.total = (t.nbytes + block_size - 1) // block_size


cdef inline bint _transfer_ended(Transfer *t) noexcept nogil:
    """Every request it started has completed, and none is left to start."""
    return t.completed == t.prepared and (t.prepared == t.total or t.out.failed)


cdef inline int _count_many(addresses, nbytes, offsets) except -1:
    """How many requests a queue's ``post_many`` names; ValueError if its lists disagree."""
    cdef Py_ssize_t count = len(addresses)
    if len(offsets) != count or (not isinstance(nbytes, int) and len(nbytes) != count):
        raise ValueError("post_many needs as many offsets (and sizes, unless one size is "
                         "given for all) as addresses")
    return <int>count


cdef inline aio_context_t _aio_context(int nr_events) except? 0:
    """A new kernel AIO context for ``nr_events`` requests in flight."""
    cdef aio_context_t ctx = 0
    cdef long ret = nvmeswap_io_setup(nr_events, &ctx)
    if ret < 0:
        raise errno_error(<int>-ret, "io_setup")
    return ctx


cdef inline bint _failed(io_event *event, iocb *cb, Outcome *out) noexcept nogil:
    """Whether a completed request failed or came back short (a write's rest is tried
    again first: ``_write_rest``); if so, ``out`` says how."""
    cdef long long expected = <long long>cb.aio_nbytes
    if event.res == expected:
        return False
    if event.res >= 0 and cb.aio_lio_opcode == IOCB_CMD_PWRITE:
        return not _write_rest(<int>cb.aio_fildes, <char *><size_t>cb.aio_buf, cb.aio_offset,
                               expected, event.res, out)
    if event.res < 0:
        _fail(out, <int>-event.res, cb.aio_offset, expected, 0)
    else:
        _fail(out, 0, cb.aio_offset, expected, event.res)
    return True


cdef inline void _clear_iocb(iocb *cb) noexcept nogil:
    cdef char *p = <char *>cb
    cdef size_t i
    for i in range(sizeof(iocb)):
        p[i] = 0
