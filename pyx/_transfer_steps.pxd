# The steps of a transfer, written once for both extensions: its outcome, the O_DIRECT
# split and the buffered edges (pyx/_queues.pyx and pyx/_transfers.pyx), a kernel AIO
# context and its requests (both queues of pyx/_queues.pyx). Inline: nothing is
# imported at run time.
from libc.errno cimport EINTR, EINVAL

from _check cimport errno_error
from includes.kernel_aio cimport (
    aio_context_t, iocb, io_event, nvmeswap_io_setup, nvmeswap_pread, nvmeswap_pwrite,
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


cdef inline aio_context_t _aio_context(int nr_events) except? 0:
    """A new kernel AIO context for ``nr_events`` requests in flight."""
    cdef aio_context_t ctx = 0
    cdef long ret = nvmeswap_io_setup(nr_events, &ctx)
    if ret < 0:
        raise errno_error(<int>-ret, "io_setup")
    return ctx


cdef inline bint _failed(io_event *event, iocb *cb, Outcome *out) noexcept nogil:
    """Whether a completed request failed or came back short; if so, ``out`` says how."""
    cdef long long expected = <long long>cb.aio_nbytes
    if event.res == expected:
        return False
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
