/* Shared mappings that can be backed by transparent huge pages (Note [huge pages] in
 * pyx/_memory.pyx). A memfd's huge pages sit at 2 MiB boundaries of the file; a mapping
 * can use one whole (one page-table entry, one pin per 2 MiB) only where those
 * boundaries fall on 2 MiB boundaries of the address space, so a mapping of 2 MiB or
 * more is placed there, and marked MADV_HUGEPAGE for shmem_enabled=advise. Where huge
 * pages are off (shmem_enabled=never, the kernel's default) nothing changes.
 */
#ifndef NVMESWAP_HUGE_PAGES_H
#define NVMESWAP_HUGE_PAGES_H

#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/types.h>

#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif

#define NVMESWAP_HUGE_PAGE (2UL << 20)

/* mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, offset), placed and advised
 * as above; MAP_FAILED and errno as mmap's. */
static inline void *nvmeswap_map_shared(int fd, size_t len, off_t offset)
{
    const int prot = PROT_READ | PROT_WRITE;
    if (len < NVMESWAP_HUGE_PAGE)
        return mmap(NULL, len, prot, MAP_SHARED, fd, offset);
    /* Reserve room for any placement, map into it, give back the rest. */
    size_t span = len + NVMESWAP_HUGE_PAGE;
    char *area = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (area == MAP_FAILED)
        return mmap(NULL, len, prot, MAP_SHARED, fd, offset);
    uintptr_t start = (uintptr_t)area;
    uintptr_t addr = (start & ~(NVMESWAP_HUGE_PAGE - 1))
                     + ((uintptr_t)offset & (NVMESWAP_HUGE_PAGE - 1));
    if (addr < start)
        addr += NVMESWAP_HUGE_PAGE;
    void *p = mmap((void *)addr, len, prot, MAP_SHARED | MAP_FIXED, fd, offset);
    if (p == MAP_FAILED) {
        int err = errno;
        munmap(area, span);
        errno = err;
        return MAP_FAILED;
    }
    if (addr > start)
        munmap(area, addr - start);
    if (addr + len < start + span)
        munmap((void *)(addr + len), start + span - (addr + len));
    madvise(p, len, MADV_HUGEPAGE);     /* refused where the kernel has no THP: fine */
    return p;
}

#endif
