/* mlock2(MLOCK_ONFAULT) through the system call, for C libraries that lack the wrapper.
 * Returns 0 or the errno. The pages are locked as they are first touched, so locking a
 * large range costs nothing up front; RLIMIT_MEMLOCK is still checked for all of it now.
 * And the population of a range from several threads at once.
 */
#ifndef NVMESWAP_MEMORY_LOCK_H
#define NVMESWAP_MEMORY_LOCK_H

#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 0x01
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static inline int nvmeswap_mlock_on_fault(const void *addr, size_t len)
{
    return syscall(SYS_mlock2, addr, len, MLOCK_ONFAULT) == 0 ? 0 : errno;
}

/* Populating, in parts (Note [parallel population] in pyx/_memory.pyx). */
#define NVMESWAP_POPULATE_THREADS_MAX 16
#define NVMESWAP_POPULATE_PART_MIN (32UL << 20)
#define NVMESWAP_POPULATE_BOUNDARY (2UL << 20)     /* parts keep huge pages whole */

typedef struct {
    char *addr;
    size_t len;
    int err;
} nvmeswap_populate_part;

static void *nvmeswap_populate_one(void *arg)
{
    nvmeswap_populate_part *part = arg;
    part->err = madvise(part->addr, part->len, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
    return NULL;
}

/* Fault in every page of [addr, addr + len) for writing, from up to ``threads`` threads
 * (parts of at least 32 MiB). Returns 0 or the first errno: EINVAL where the kernel has
 * no MADV_POPULATE_WRITE (before Linux 5.14). A thread that cannot be started leaves its
 * part to the calling thread. */
static inline int nvmeswap_populate(void *addr, size_t len, int threads)
{
    nvmeswap_populate_part parts[NVMESWAP_POPULATE_THREADS_MAX];
    pthread_t ids[NVMESWAP_POPULATE_THREADS_MAX];
    int started[NVMESWAP_POPULATE_THREADS_MAX];
    size_t count = len / NVMESWAP_POPULATE_PART_MIN, each, start = 0;
    int i, err = 0;
    if (threads > NVMESWAP_POPULATE_THREADS_MAX)
        threads = NVMESWAP_POPULATE_THREADS_MAX;
    if (count > (size_t)threads)
        count = (size_t)threads;
    if (count < 1)
        count = 1;
    each = (len / count + NVMESWAP_POPULATE_BOUNDARY - 1) & ~(NVMESWAP_POPULATE_BOUNDARY - 1);
    for (i = 0; i < (int)count; i++) {
        size_t n = start >= len ? 0 : (len - start < each ? len - start : each);
        parts[i].addr = (char *)addr + start;
        parts[i].len = n;
        parts[i].err = 0;
        start += n;
        /* Part 0 is the calling thread's own. */
        started[i] = i > 0 && n > 0
                     && pthread_create(&ids[i], NULL, nvmeswap_populate_one, &parts[i]) == 0;
    }
    for (i = 0; i < (int)count; i++)
        if (!started[i] && parts[i].len > 0)
            nvmeswap_populate_one(&parts[i]);
    for (i = 0; i < (int)count; i++) {
        if (started[i])
            pthread_join(ids[i], NULL);
        if (err == 0)
            err = parts[i].err;
    }
    return err;
}

#endif
