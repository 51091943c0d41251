/* Kernel AIO system calls, called directly so that no libaio package is needed.
 *
 * Every function returns a non-negative result or -errno, never -1 with errno set,
 * so callers inside nogil sections never have to read errno later
 * (the convention of liburing's src/arch/generic/syscall.h).
 */
#ifndef NVMESWAP_KERNEL_AIO_H
#define NVMESWAP_KERNEL_AIO_H

#include <errno.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <linux/aio_abi.h>

static inline long nvmeswap_sys_result(long ret)
{
    return ret < 0 ? -errno : ret;
}

static inline long nvmeswap_io_setup(unsigned nr_events, aio_context_t *ctx)
{
    return nvmeswap_sys_result(syscall(SYS_io_setup, nr_events, ctx));
}

static inline long nvmeswap_io_destroy(aio_context_t ctx)
{
    return nvmeswap_sys_result(syscall(SYS_io_destroy, ctx));
}

static inline long nvmeswap_io_submit(aio_context_t ctx, long nr, struct iocb **iocbs)
{
    return nvmeswap_sys_result(syscall(SYS_io_submit, ctx, nr, iocbs));
}

static inline long nvmeswap_io_getevents(aio_context_t ctx, long min_nr, long nr,
                                         struct io_event *events, struct timespec *timeout)
{
    return nvmeswap_sys_result(syscall(SYS_io_getevents, ctx, min_nr, nr, events, timeout));
}

/* An eventfd the kernel signals as AIO requests complete (IOCB_FLAG_RESFD). */
static inline long nvmeswap_eventfd(void)
{
    return nvmeswap_sys_result(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
}

/* pread/pwrite that return -errno, for the unaligned head and tail of a transfer. */
static inline long nvmeswap_pread(int fd, void *buf, size_t count, off_t offset)
{
    return nvmeswap_sys_result(pread(fd, buf, count, offset));
}

static inline long nvmeswap_pwrite(int fd, const void *buf, size_t count, off_t offset)
{
    return nvmeswap_sys_result(pwrite(fd, buf, count, offset));
}

/* Allocate blocks for [offset, offset + len) and extend the file to cover them. */
static inline long nvmeswap_fallocate(int fd, off_t offset, off_t len)
{
    return nvmeswap_sys_result(fallocate(fd, 0, offset, len));
}

#endif
