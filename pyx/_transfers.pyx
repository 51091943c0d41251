# cython: language_level=3, boundscheck=False, wraparound=False
"""Transfers in the calling thread, and the record of a transfer's outcome.

A transfer moves ``nbytes`` between memory at ``address`` and a file at ``offset``: its
aligned middle on the O_DIRECT descriptor, an unaligned head or tail with plain
pread/pwrite on a buffered descriptor (Note [O_DIRECT tail] in nvmeswap/io/files.py).
Here all of it runs with pread/pwrite in the calling thread, GIL released; the workers'
and the caller's kernel AIO queues are in pyx/_queues.pyx.

Results cross into Python one way, in this extension and in nvmeswap._queues:

- a failure of the call itself raises ``OSError`` (pyx/_check.pxd's ``errno_error``,
  naming the system call); no function returns an errno;
- a transfer's outcome is a ``Completion``, failed (an errno) or short (fewer bytes
  got than requested) included;
- ``None`` means "not taken here": the caller runs the operation the ordinary way.
"""
from posix.unistd cimport close
from posix.fcntl cimport open as open_file, fcntl, F_SETFL, O_RDONLY, O_WRONLY, O_CLOEXEC
from posix.fcntl cimport O_NONBLOCK
from posix.stat cimport struct_stat, fstat, stat, S_ISREG

from _check cimport errno_error
from _transfer_steps cimport Outcome, _move_edges, _plain_transfer, _split
from includes.kernel_aio cimport nvmeswap_fallocate, O_DIRECT


cdef class Completion:
    """The outcome of one transfer (one chunk of operation ``op_id``), whichever road it
    took: a worker's engine, the caller queue, the calling thread, cuFile.

    On success ``err`` is 0 and ``at_offset``, ``requested`` and ``got`` describe the whole
    transfer (``got == requested``). On failure they describe the first failure: its errno
    (0 for a short transfer: a read that met the end of the file), the file offset where
    it happened, and how many of the bytes requested there came back.
    """

    def __init__(self, unsigned long long op_id, unsigned int chunk, int err,
                 long long at_offset, long long requested, long long got):
        self.op_id = op_id
        self.chunk = chunk
        self.err = err
        self.at_offset = at_offset
        self.requested = requested
        self.got = got

    @property
    def failed(self):
        """Whether the transfer failed (``err``) or came back short (``got < requested``)."""
        return self.err != 0 or self.got != self.requested

    def __repr__(self):
        return (f"Completion(op_id={self.op_id}, chunk={self.chunk}, err={self.err}, "
                f"at_offset={self.at_offset}, requested={self.requested}, got={self.got})")


def transfer_in_caller(unsigned long long op_id, unsigned int chunk, bint is_read,
                       int direct_fd, int buffered_fd, size_t address, size_t nbytes,
                       long long offset, size_t alignment):
    """``AioEngine.transfer`` with plain pread/pwrite in the calling thread, GIL released;
    returns its ``Completion``.

    For operations of one request, where a round trip to a worker costs more than it gains.
    """
    cdef Outcome out
    cdef long long middle_start, middle_end
    _move_edges(is_read, buffered_fd, address, nbytes, offset, alignment, &out,
                &middle_start, &middle_end)
    if not out.failed and middle_end > middle_start:
        with nogil:
            _plain_transfer(is_read, direct_fd, <char *>address + (middle_start - offset),
                            middle_end - middle_start, middle_start, &out)
    return completion(op_id, chunk, out.err, out.at_offset, out.requested, out.got)


def quick_transfer(bint is_read, bytes path, size_t address, size_t nbytes,
                   long long offset, unsigned long long device=0,
                   unsigned long long inode=0):
    """Note [quick synchronous operations] (io/quick.py): open ``path`` with O_DIRECT,
    move ``nbytes`` at ``offset`` with pread/pwrite, close; all without the GIL.

    Returns True when the bytes moved. None means nothing was settled here: the file
    could not be opened this way, is not a regular file, is too short (a read) or
    would grow (a write), is not the file ``device`` and ``inode`` name (when ``inode``
    is given), or the transfer failed; the caller runs the operation the ordinary way,
    which says why (both directions are safe to repeat).
    """
    cdef const char *name = path
    cdef int fd
    cdef struct_stat info
    cdef Outcome out
    out.failed = True
    with nogil:
        fd = _open_within(name, is_read, offset + <long long>nbytes, device, inode, &info)
        if fd >= 0:
            out.failed = False
            _plain_transfer(is_read, fd, <char *>address, nbytes, offset, &out)
            close(fd)
    return None if out.failed else True


def open_for_direct_read(bytes path, long long end):
    """Note [quick asynchronous reads] (io/quick.py): ``path`` opened for reading with
    O_DIRECT, as ``(fd, size, device, inode)``, if it is a regular file of at least
    ``end`` bytes; else None (nothing is left open). The caller closes the descriptor."""
    cdef const char *name = path
    cdef int fd
    cdef struct_stat info
    with nogil:
        fd = _open_within(name, True, end, 0, 0, &info)
    if fd < 0:
        return None
    return (fd, info.st_size, info.st_dev, info.st_ino)


def still_names(bytes path, unsigned long long device, unsigned long long inode,
                long long end):
    """Whether ``path`` names the regular file ``device``/``inode`` now, at least ``end``
    bytes long: one stat(2), where opening it again would take four system calls (Note
    [shared read descriptors] in nvmeswap/io/quick.py)."""
    cdef const char *name = path
    cdef struct_stat info
    cdef int ret
    with nogil:
        ret = stat(name, &info)
    return (ret == 0 and S_ISREG(info.st_mode) and info.st_dev == device
            and info.st_ino == inode and end <= info.st_size)


cdef int _open_within(const char *name, bint is_read, long long end,
                      unsigned long long device, unsigned long long inode,
                      struct_stat *info) noexcept nogil:
    """``name`` opened with O_DIRECT if it is a regular file that reaches ``end`` (and is
    the file ``device`` and ``inode`` name, when ``inode`` is given); else -1, nothing
    left open."""
    cdef int flags = (O_RDONLY if is_read else O_WRONLY) | O_CLOEXEC | O_DIRECT
    # O_NONBLOCK: opening a FIFO must not wait for a peer; fstat refuses it below.
    cdef int fd = open_file(name, flags | O_NONBLOCK)
    if fd < 0:
        return -1
    if (fstat(fd, info) == 0 and S_ISREG(info.st_mode)
            and (inode == 0 or (info.st_dev == device and info.st_ino == inode))
            and end <= info.st_size
            and fcntl(fd, F_SETFL, flags) == 0):
        return fd
    close(fd)
    return -1


def preallocate(int fd, long long offset, long long length):
    """fallocate(2) without glibc's fallback of writing zeros; raises ``OSError`` with the
    errno that refused it (EOPNOTSUPP where the filesystem has no fallocate)."""
    cdef long ret
    with nogil:
        ret = nvmeswap_fallocate(fd, offset, length)
    if ret < 0:
        raise errno_error(<int>-ret, "fallocate")


def direct_split(long long offset, long long nbytes, long long alignment):
    """``(middle_start, middle_end)``: the file range of ``[offset, offset + nbytes)`` that
    O_DIRECT can move; the head before it and the tail after it (each under one block)
    go through the buffered descriptor (Note [O_DIRECT tail]). Used by both workers."""
    cdef long long middle_start, middle_end
    _split(offset, offset + nbytes, alignment, &middle_start, &middle_end)
    return middle_start, middle_end


def post_to_run(queue, run, buffer, long long offset):
    """Post one more read of ``run`` (Note [quick read runs] in nvmeswap/io/quick.py) to
    the caller queue, into ``buffer`` (an IoBuffer) from ``offset``; False if the queue
    took none. The run counts it in the same call, before the post (a post that fails
    after its request went out still has it counted), and no Python code runs between
    them: no signal handler can leave a read in flight that the books do not know of.
    Called with the books' lock held."""
    cdef Py_ssize_t index = len(run.chunks)
    cdef size_t address = buffer.address
    cdef long long nbytes = buffer.nbytes
    span = run.buffer
    cdef long long start = run.file_offset
    cdef long long end = start + span.nbytes
    previous = (start, span.nbytes)
    # Where the read lands, as an offset from the run's first buffer (region_offset_of).
    run.chunks.append((<long long>(address - run.region.address) - run.region_offset,
                       nbytes))
    span.owner.append(buffer)      # the caller's memory, held until the run ends
    if offset < start:
        start = offset
    if offset + nbytes > end:
        end = offset + nbytes
    run.file_offset = start
    span.nbytes = end - start
    run.count += 1
    run.remaining += 1
    if queue.post(run.op_id, index, True, run.file.direct_fd, address, nbytes, offset):
        return True
    # Not taken: as it was.
    run.remaining -= 1
    run.count -= 1
    run.file_offset, span.nbytes = previous
    span.owner.pop()
    run.chunks.pop()
    return False
