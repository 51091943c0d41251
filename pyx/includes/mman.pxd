# mmap/mlock and friends; only what nvmeswap uses.
from posix.types cimport off_t


cdef extern from "<sys/mman.h>" nogil:
    enum:
        PROT_READ
        PROT_WRITE
        MAP_SHARED
        MAP_PRIVATE
        MAP_FIXED
    void *MAP_FAILED
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset)
    int munmap(void *addr, size_t length)
    int mlock(const void *addr, size_t length)
    int munlock(const void *addr, size_t length)


cdef extern from "<fcntl.h>" nogil:
    enum:
        FALLOC_FL_KEEP_SIZE
        FALLOC_FL_PUNCH_HOLE
    int fallocate(int fd, int mode, off_t offset, off_t length)


cdef extern from "memory_lock.h" nogil:
    int nvmeswap_mlock_on_fault(const void *addr, size_t length)
    int nvmeswap_populate(void *addr, size_t length, int threads)


cdef extern from "huge_pages.h" nogil:
    void *nvmeswap_map_shared(int fd, size_t length, off_t offset)
