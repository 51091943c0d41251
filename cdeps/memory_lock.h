/* mlock2(MLOCK_ONFAULT) through the system call, for C libraries that lack the wrapper.
 * Returns 0 or the errno. The pages are locked as they are first touched, so locking a
 * large range costs nothing up front; RLIMIT_MEMLOCK is still checked for all of it now.
 */
#ifndef NVMESWAP_MEMORY_LOCK_H
#define NVMESWAP_MEMORY_LOCK_H

#include <errno.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 0x01
#endif

static inline int nvmeswap_mlock_on_fault(const void *addr, size_t len)
{
    return syscall(SYS_mlock2, addr, len, MLOCK_ONFAULT) == 0 ? 0 : errno;
}

#endif
