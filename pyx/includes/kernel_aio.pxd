# The kernel AIO system calls of cdeps/kernel_aio.h; only the fields nvmeswap uses.
from posix.types cimport off_t


cdef extern from "kernel_aio.h" nogil:
    ctypedef unsigned long aio_context_t

    enum:
        IOCB_CMD_PREAD
        IOCB_CMD_PWRITE
        IOCB_FLAG_RESFD
        O_DIRECT

    struct iocb:
        unsigned long long aio_data
        unsigned short aio_lio_opcode
        unsigned int aio_flags
        unsigned int aio_resfd
        unsigned int aio_fildes
        unsigned long long aio_buf
        unsigned long long aio_nbytes
        long long aio_offset

    struct io_event:
        unsigned long long data
        unsigned long long obj
        long long res
        long long res2

    struct timespec:
        long tv_sec
        long tv_nsec

    long nvmeswap_io_setup(unsigned nr_events, aio_context_t *ctx)
    long nvmeswap_io_destroy(aio_context_t ctx)
    long nvmeswap_io_submit(aio_context_t ctx, long nr, iocb **iocbs)
    long nvmeswap_io_getevents(aio_context_t ctx, long min_nr, long nr,
                               io_event *events, timespec *timeout)
    long nvmeswap_eventfd()
    long nvmeswap_pread(int fd, void *buf, size_t count, off_t offset)
    long nvmeswap_pwrite(int fd, const void *buf, size_t count, off_t offset)
    long nvmeswap_fallocate(int fd, off_t offset, off_t len)
