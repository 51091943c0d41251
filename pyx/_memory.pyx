# cython: language_level=3, boundscheck=False, wraparound=False
"""Shared mappings that the parent and its workers both see, and raw copies between them.

A failure of a call raises ``OSError`` (pyx/_check.pxd's ``errno_error``, naming the
system call), as in nvmeswap._queues and nvmeswap._transfers; no function returns an errno.
"""
from cpython.buffer cimport (
    PyObject_GetBuffer, PyBuffer_Release, PyBuffer_FillInfo,
    PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBUF_SIMPLE,
)
from libc.errno cimport errno, EINVAL, ENOSYS
from libc.string cimport memcpy, memcmp
import os
import weakref

from _check cimport errno_error
from posix.types cimport off_t

from includes.mman cimport (
    mmap, munmap, mlock, munlock, fallocate, MAP_FAILED, MAP_FIXED, MAP_PRIVATE,
    PROT_READ, PROT_WRITE,
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, nvmeswap_mlock_on_fault, nvmeswap_map_shared,
    nvmeswap_populate,
)


cdef class Mapping:
    """A read-write ``MAP_SHARED`` mapping of ``size`` bytes at ``offset`` (page-aligned)
    of a file descriptor, exposed as a buffer.

    The mapping lives until this object is garbage: tensors and arrays made from it
    hold a reference, so freeing a locked tensor never leaves one pointing at nothing.
    Weak-referenceable, so that the owner of the file's range learns when it is gone.

    Note [locked memory across fork]: other memory is copy-on-write across fork(), but a
    shared mapping stays shared, so a forked child (a DataLoader worker, say) writing
    into its copy of a locked tensor would change its parent's tensor, and the file the
    parent writes from it. With ``private_after_fork`` (the caller keeps ``fd`` open as
    long as the mapping lives), a forked child maps the same range of the file privately
    at the same address: the child's writes stay in the child, and nothing is copied
    until it writes. Unlike ordinary fork memory, a page the child has not written still
    shows what the parent writes there later.

    Note [huge pages]: the kernel pins the pages of every direct transfer (kernel AIO's,
    at each request; io_uring's fixed buffers once), and a worker builds a page-table
    entry for each page it maps: with 4 KiB pages most of a worker's CPU per byte (perf:
    ~47 % of its samples pinning pages, docs/performance.md). Memfd memory comes in
    transparent huge pages of 2 MiB where the system allows it for shared memory
    (/sys/kernel/mm/transparent_hugepage/shmem_enabled: ``advise``, with the
    MADV_HUGEPAGE this mapping asks for, or ``always``; the default ``never`` keeps 4 KiB
    pages). A mapping of 2 MiB or more is placed so that the file's 2 MiB boundaries
    fall on the address space's (cdeps/huge_pages.h), in the parent and in every worker
    alike: a huge page is then one entry and one pin. ``nvmeswap report`` says which
    setting the machine has.
    """
    cdef char *base
    cdef readonly size_t size
    cdef readonly bint locked
    cdef int fd
    cdef off_t offset
    cdef object __weakref__

    def __cinit__(self, int fd, size_t size, off_t offset=0, bint private_after_fork=False):
        self.base = NULL
        self.size = size
        self.locked = False
        self.fd = fd
        self.offset = offset
        cdef void *p
        with nogil:
            p = nvmeswap_map_shared(fd, size, offset)     # Note [huge pages]
        if p == MAP_FAILED:
            raise errno_error(errno, "mmap")
        self.base = <char *>p
        if private_after_fork:
            _private_after_fork.add(self)

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.size)

    cdef void _make_private(self) noexcept nogil:
        # Same address, same bytes, now copy-on-write; on failure it stays shared.
        mmap(self.base, self.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, self.fd,
             self.offset)
        self.locked = False     # page locks are not inherited

    @property
    def address(self):
        return <size_t>self.base

    def lock(self, bint on_fault=False):
        """Page-lock the mapping; ``OSError`` with the errno that refused it (ENOMEM,
        EPERM: over RLIMIT_MEMLOCK). ``on_fault``: lock each page as it is first touched
        instead of all of them now.

        Note [parallel population]: locking all of a fresh mapping now means making every
        page, and a shared memory page costs ~2.5 us to allocate, zero and insert (0.6 s a
        GiB here); mlock(2) makes them one by one in the calling thread. So the range is
        locked on fault (the limit checked for all of it at once) and then faulted in
        from one thread per CPU, 32 MiB or more each (MADV_POPULATE_WRITE): the same
        locked, present pages, in 0.32 s a GiB on 2 CPUs
        (bench/studies/locked_allocation.py). Where the kernel lacks either call,
        mlock(2) does it all as before.
        """
        cdef int err
        cdef int threads = len(os.sched_getaffinity(0))
        with nogil:
            err = nvmeswap_mlock_on_fault(self.base, self.size)
            if err == 0 and not on_fault:
                err = nvmeswap_populate(self.base, self.size, threads)
                if err == EINVAL:       # no MADV_POPULATE_WRITE: mlock(2) faults them in
                    err = 0 if mlock(self.base, self.size) == 0 else errno
                if err != 0:            # not locked after all, as the error says
                    munlock(self.base, self.size)
            elif err == ENOSYS or err == EINVAL:     # no mlock2 here: lock it all now
                err = 0 if mlock(self.base, self.size) == 0 else errno
        if err != 0:
            raise errno_error(err, "mlock")
        self.locked = True

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, self.base, self.size, 0, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass


_private_after_fork = weakref.WeakSet()


def _privatize_in_child():
    """Note [locked memory across fork]."""
    cdef Mapping mapping
    for mapping in list(_private_after_fork):
        mapping._make_private()


os.register_at_fork(after_in_child=_privatize_in_child)


def punch_hole(int fd, off_t offset, off_t length):
    """Give back the memory of ``[offset, offset + length)`` of a memfd, keeping its size
    (the range reads as zeros); ``OSError`` with the errno that refused it."""
    cdef int ret, err = 0
    with nogil:
        ret = fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
        if ret != 0:
            err = errno
    if err:
        raise errno_error(err, "fallocate")


def buffer_address(obj, bint writable):
    """Return ``(address, nbytes)`` of a C-contiguous buffer-protocol object.

    The address stays valid only while the caller keeps ``obj`` alive.
    """
    cdef Py_buffer view
    cdef int flags = PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    PyObject_GetBuffer(obj, &view, flags)
    try:
        return <size_t>view.buf, <size_t>view.len
    finally:
        PyBuffer_Release(&view)


def lock_range(size_t address, size_t nbytes):
    """Page-lock ``nbytes`` of memory at ``address`` (mlock(2)): cheap for pages already
    present; ``OSError`` with the errno that refused it (ENOMEM, EPERM: over
    RLIMIT_MEMLOCK). The lock goes with the mapping."""
    cdef int err = 0
    with nogil:
        if mlock(<const void *>address, nbytes) != 0:
            err = errno
    if err:
        raise errno_error(err, "mlock")


def copy_memory(size_t destination, size_t source, size_t nbytes):
    """memcpy without the GIL; both ranges must be valid and must not overlap."""
    with nogil:
        memcpy(<void *>destination, <const void *>source, nbytes)


def first_difference(size_t a, size_t b, size_t nbytes):
    """Index of the first byte where the two ranges differ, or -1 if they are equal."""
    cdef size_t step = 1 << 16, start = 0, i, n
    cdef const unsigned char *pa = <const unsigned char *>a
    cdef const unsigned char *pb = <const unsigned char *>b
    cdef int differs = 0
    with nogil:
        while start < nbytes:
            n = min(step, nbytes - start)
            if memcmp(pa + start, pb + start, n) != 0:
                differs = 1
                break
            start += n
    if not differs:
        return -1
    for i in range(start, start + n):
        if pa[i] != pb[i]:
            return i
    return -1
