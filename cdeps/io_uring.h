/* io_uring, called directly so that neither liburing nor the build machine's
 * <linux/io_uring.h> is needed: the three system calls, the kernel's structures and
 * constants as the ABI fixes them (declared here, under our own names, so that older
 * headers do not matter), the mapping of the rings, and their memory barriers.
 *
 * Every function returns a non-negative result or -errno, never -1 with errno set (the
 * convention of cdeps/kernel_aio.h and of liburing's src/arch/generic/syscall.h).
 *
 * The rings are shared with the kernel: the submission queue's tail and the completion
 * queue's head are ours, the other two ends the kernel's. Ours are published with a
 * release store after the entries they cover are written; theirs are read with an
 * acquire load before the entries they cover are read (liburing's barrier.h).
 */
#ifndef NVMESWAP_IO_URING_H
#define NVMESWAP_IO_URING_H

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>

/* The same numbers on x86-64, arm64 and every architecture of the generic table. */
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

#define NVMESWAP_IORING_SETUP_CQSIZE        (1U << 3)
#define NVMESWAP_IORING_SETUP_R_DISABLED    (1U << 6)   /* Linux 5.10 */
#define NVMESWAP_IORING_SETUP_COOP_TASKRUN  (1U << 8)   /* Linux 5.19 */
#define NVMESWAP_IORING_SETUP_SINGLE_ISSUER (1U << 12)  /* Linux 6.0 */
#define NVMESWAP_IORING_SETUP_DEFER_TASKRUN (1U << 13)  /* Linux 6.1 */
#define NVMESWAP_IORING_FEAT_SINGLE_MMAP    (1U << 0)
#define NVMESWAP_IORING_FEAT_NODROP         (1U << 1)
#define NVMESWAP_IORING_FEAT_RW_CUR_POS     (1U << 3)   /* Linux 5.6: IORING_OP_READ/WRITE */
#define NVMESWAP_IORING_ENTER_GETEVENTS     (1U << 0)
#define NVMESWAP_IORING_OFF_SQ_RING         0ULL
#define NVMESWAP_IORING_OFF_CQ_RING         0x8000000ULL
#define NVMESWAP_IORING_OFF_SQES            0x10000000ULL
#define NVMESWAP_IORING_OP_NOP              0
#define NVMESWAP_IORING_OP_READ_FIXED       4
#define NVMESWAP_IORING_OP_WRITE_FIXED      5
#define NVMESWAP_IORING_OP_READ             22
#define NVMESWAP_IORING_OP_WRITE            23
#define NVMESWAP_IORING_REGISTER_BUFFERS    0
#define NVMESWAP_IORING_UNREGISTER_BUFFERS  1
#define NVMESWAP_IORING_REGISTER_EVENTFD    4
#define NVMESWAP_IORING_REGISTER_BUFFERS2   15          /* Linux 5.13 */
#define NVMESWAP_IORING_REGISTER_BUFFERS_UPDATE 16      /* Linux 5.13 */
#define NVMESWAP_IORING_RSRC_REGISTER_SPARSE (1U << 0)  /* Linux 5.19 */
#define NVMESWAP_IORING_REGISTER_ENABLE_RINGS 12        /* Linux 5.10 */
#define NVMESWAP_IORING_REGISTER_CLONE_BUFFERS 30       /* Linux 6.12 */
#define NVMESWAP_IORING_REGISTER_DST_REPLACE (1U << 1)  /* Linux 6.13: a range, replacing */
#define NVMESWAP_IORING_MAX_FIXED_BUFFER    (1UL << 30) /* the most one registered buffer holds */

struct nvmeswap_io_sqring_offsets {
    uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
    uint64_t user_addr;
};

struct nvmeswap_io_cqring_offsets {
    uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
    uint64_t user_addr;
};

struct nvmeswap_io_uring_params {
    uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd;
    uint32_t resv[3];
    struct nvmeswap_io_sqring_offsets sq_off;
    struct nvmeswap_io_cqring_offsets cq_off;
};

/* A submission queue entry, 64 bytes; the fields of a read or write. */
struct nvmeswap_io_uring_sqe {
    uint8_t opcode;
    uint8_t flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off;
    uint64_t addr;
    uint32_t len;
    uint32_t rw_flags;
    uint64_t user_data;
    uint16_t buf_index;
    uint16_t personality;
    int32_t splice_fd_in;
    uint64_t addr3;
    uint64_t pad2;
};

struct nvmeswap_io_uring_cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
};

/* A table of registered buffers (IORING_REGISTER_BUFFERS2), and a change to its slots
 * (IORING_REGISTER_BUFFERS_UPDATE). */
struct nvmeswap_io_uring_rsrc_register {
    uint32_t nr;
    uint32_t flags;
    uint64_t resv2;
    uint64_t data;
    uint64_t tags;
};

struct nvmeswap_io_uring_rsrc_update2 {
    uint32_t offset;
    uint32_t resv;
    uint64_t data;
    uint64_t tags;
    uint32_t nr;
    uint32_t resv2;
};

/* IORING_REGISTER_CLONE_BUFFERS' argument. */
struct nvmeswap_io_uring_clone_buffers {
    uint32_t src_fd;
    uint32_t flags;
    uint32_t src_off;
    uint32_t dst_off;
    uint32_t nr;
    uint32_t pad[3];
};

_Static_assert(sizeof(struct nvmeswap_io_uring_clone_buffers) == 32, "clone_buffers: 32 bytes");
_Static_assert(sizeof(struct nvmeswap_io_uring_params) == 120, "io_uring_params is 120 bytes");
_Static_assert(sizeof(struct nvmeswap_io_uring_sqe) == 64, "an SQE is 64 bytes");
_Static_assert(sizeof(struct nvmeswap_io_uring_cqe) == 16, "a CQE is 16 bytes");
_Static_assert(sizeof(struct nvmeswap_io_uring_rsrc_register) == 32, "rsrc_register: 32 bytes");
_Static_assert(sizeof(struct nvmeswap_io_uring_rsrc_update2) == 32, "rsrc_update2: 32 bytes");

static inline long nvmeswap_uring_result(long ret)
{
    return ret < 0 ? -errno : ret;
}

static inline long nvmeswap_io_uring_setup(unsigned entries, struct nvmeswap_io_uring_params *p)
{
    return nvmeswap_uring_result(syscall(__NR_io_uring_setup, entries, p));
}

static inline long nvmeswap_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete,
                                           unsigned flags)
{
    return nvmeswap_uring_result(syscall(__NR_io_uring_enter, fd, to_submit, min_complete,
                                         flags, NULL, 0));
}

static inline long nvmeswap_io_uring_register(int fd, unsigned opcode, const void *arg,
                                              unsigned nr_args)
{
    return nvmeswap_uring_result(syscall(__NR_io_uring_register, fd, opcode, arg, nr_args));
}

/* One ring as this process sees it: the kernel's ends of both queues are pointers into
 * the mapping; ``sq_tail`` is our copy of the submission tail, published by
 * nvmeswap_uring_publish. */
typedef struct {
    int fd;
    unsigned flags;         /* the IORING_SETUP_* flags asked for and taken, CQSIZE aside */
    unsigned features;
    unsigned sq_entries;
    unsigned sq_tail;
    unsigned *sq_khead, *sq_ktail, *sq_mask;
    struct nvmeswap_io_uring_sqe *sqes;
    unsigned *cq_khead, *cq_ktail, *cq_mask;
    struct nvmeswap_io_uring_cqe *cqes;
    void *rings;            /* SQ and CQ rings (one mapping with IORING_FEAT_SINGLE_MMAP) */
    size_t rings_size;
    void *cq_ring;          /* a second mapping on kernels without it, else NULL */
    size_t cq_ring_size;
    size_t sqes_size;
} nvmeswap_uring;

static inline unsigned nvmeswap_load_acquire(const unsigned *p)
{
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

static inline void nvmeswap_store_release(unsigned *p, unsigned v)
{
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

/* Unmap and close what nvmeswap_uring_open made; safe on a ring it failed to open. */
static inline void nvmeswap_uring_close(nvmeswap_uring *ring)
{
    if (ring->sqes)
        munmap(ring->sqes, ring->sqes_size);
    if (ring->cq_ring)
        munmap(ring->cq_ring, ring->cq_ring_size);
    if (ring->rings)
        munmap(ring->rings, ring->rings_size);
    if (ring->fd >= 0)
        close(ring->fd);
    memset(ring, 0, sizeof *ring);
    ring->fd = -1;
}

static inline long nvmeswap_uring_map(nvmeswap_uring *ring, int fd, unsigned long long offset,
                                      size_t size, void **at)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, offset);
    if (p == MAP_FAILED)
        return -errno;
    *at = p;
    return 0;
}

/* Make a ring of ``entries`` submission and ``cq_entries`` completion slots (each rounded
 * up to a power of two by the kernel), not mapped: its descriptor, or -errno; ``*p`` says
 * how to map it. ``*flags`` (IORING_SETUP_*) that an older kernel refuses are dropped:
 * it says which were taken. */
static inline long nvmeswap_uring_setup(unsigned entries, unsigned cq_entries, unsigned *flags,
                                        struct nvmeswap_io_uring_params *p)
{
    long ret;
    for (;;) {
        memset(p, 0, sizeof *p);
        p->flags = NVMESWAP_IORING_SETUP_CQSIZE | *flags;
        p->cq_entries = cq_entries;
        ret = nvmeswap_io_uring_setup(entries, p);
        if (ret != -EINVAL || !*flags)
            return ret;
        *flags = 0;
    }
}

/* Map the ring ``fd`` made with ``p`` and ``flags`` (by nvmeswap_uring_setup, here or in
 * another process) into ``ring``, which then owns the descriptor; 0 or -errno (then
 * nothing is left mapped, and the descriptor is closed). */
static inline long nvmeswap_uring_adopt(nvmeswap_uring *ring, int fd,
                                        const struct nvmeswap_io_uring_params *p, unsigned flags)
{
    long ret;
    memset(ring, 0, sizeof *ring);
    ring->fd = fd;
    ring->flags = flags;
    ring->features = p->features;
    ring->sq_entries = p->sq_entries;
    size_t sq_size = p->sq_off.array + p->sq_entries * sizeof(unsigned);
    size_t cq_size = p->cq_off.cqes + p->cq_entries * sizeof(struct nvmeswap_io_uring_cqe);
    int single = (p->features & NVMESWAP_IORING_FEAT_SINGLE_MMAP) != 0;
    ring->rings_size = single && cq_size > sq_size ? cq_size : sq_size;
    ret = nvmeswap_uring_map(ring, ring->fd, NVMESWAP_IORING_OFF_SQ_RING, ring->rings_size,
                             &ring->rings);
    char *cq = (char *)ring->rings;
    if (ret == 0 && !single) {
        ring->cq_ring_size = cq_size;
        ret = nvmeswap_uring_map(ring, ring->fd, NVMESWAP_IORING_OFF_CQ_RING, cq_size,
                                 &ring->cq_ring);
        cq = (char *)ring->cq_ring;
    }
    if (ret == 0) {
        ring->sqes_size = p->sq_entries * sizeof(struct nvmeswap_io_uring_sqe);
        ret = nvmeswap_uring_map(ring, ring->fd, NVMESWAP_IORING_OFF_SQES, ring->sqes_size,
                                 (void **)&ring->sqes);
    }
    if (ret < 0) {
        nvmeswap_uring_close(ring);
        return ret;
    }
    char *sq = (char *)ring->rings;
    ring->sq_khead = (unsigned *)(sq + p->sq_off.head);
    ring->sq_ktail = (unsigned *)(sq + p->sq_off.tail);
    ring->sq_mask = (unsigned *)(sq + p->sq_off.ring_mask);
    ring->cq_khead = (unsigned *)(cq + p->cq_off.head);
    ring->cq_ktail = (unsigned *)(cq + p->cq_off.tail);
    ring->cq_mask = (unsigned *)(cq + p->cq_off.ring_mask);
    ring->cqes = (struct nvmeswap_io_uring_cqe *)(cq + p->cq_off.cqes);
    /* Slot i of the submission array names SQE i, once and for all (as liburing does). */
    unsigned *array = (unsigned *)(sq + p->sq_off.array);
    for (unsigned i = 0; i < p->sq_entries; i++)
        array[i] = i;
    ring->sq_tail = *ring->sq_ktail;
    return 0;
}

/* A ring made and mapped here; 0 or -errno (nothing left open). */
static inline long nvmeswap_uring_open(nvmeswap_uring *ring, unsigned entries,
                                       unsigned cq_entries, unsigned flags)
{
    struct nvmeswap_io_uring_params p;
    long ret = nvmeswap_uring_setup(entries, cq_entries, &flags, &p);
    if (ret < 0) {
        memset(ring, 0, sizeof *ring);
        ring->fd = -1;
        return ret;
    }
    return nvmeswap_uring_adopt(ring, (int)ret, &p, flags);
}

/* Start a ring made with IORING_SETUP_R_DISABLED: with SINGLE_ISSUER, the calling thread
 * becomes the one that submits. 0 or -errno. */
static inline long nvmeswap_uring_enable(nvmeswap_uring *ring)
{
    return nvmeswap_io_uring_register(ring->fd, NVMESWAP_IORING_REGISTER_ENABLE_RINGS, NULL, 0);
}

/* Slots ``first`` .. ``first + nr - 1`` of the table hold what those of ring ``src_fd``
 * hold (the same pinned pages, no pinning again); the kernel takes it only where both
 * rings were made by one process. 0 or -errno. */
static inline long nvmeswap_uring_clone_buffers(nvmeswap_uring *ring, int src_fd, unsigned first,
                                                unsigned nr)
{
    struct nvmeswap_io_uring_clone_buffers clone;
    memset(&clone, 0, sizeof clone);
    clone.src_fd = (uint32_t)src_fd;
    clone.flags = NVMESWAP_IORING_REGISTER_DST_REPLACE;
    clone.src_off = first;
    clone.dst_off = first;
    clone.nr = nr;
    long ret = nvmeswap_io_uring_register(ring->fd, NVMESWAP_IORING_REGISTER_CLONE_BUFFERS,
                                          &clone, 1);
    return ret < 0 ? ret : 0;
}

/* The next submission entry, cleared, or NULL if every one is written and not yet taken
 * by the kernel. It reaches the kernel after nvmeswap_uring_publish. */
static inline struct nvmeswap_io_uring_sqe *nvmeswap_uring_next_sqe(nvmeswap_uring *ring)
{
    if (ring->sq_tail - nvmeswap_load_acquire(ring->sq_khead) >= ring->sq_entries)
        return NULL;
    struct nvmeswap_io_uring_sqe *sqe = &ring->sqes[ring->sq_tail & *ring->sq_mask];
    memset(sqe, 0, sizeof *sqe);
    ring->sq_tail++;
    return sqe;
}

/* A read or write of ``len`` bytes at ``addr`` and file ``offset`` (READ/WRITE opcodes;
 * the _FIXED ones with ``buf_index`` of the registered buffer that holds them). */
static inline void nvmeswap_uring_prep_rw(struct nvmeswap_io_uring_sqe *sqe, int opcode, int fd,
                                          unsigned long long addr, unsigned len,
                                          unsigned long long offset, unsigned long long data)
{
    sqe->opcode = (uint8_t)opcode;
    sqe->fd = fd;
    sqe->addr = addr;
    sqe->len = len;
    sqe->off = offset;
    sqe->user_data = data;
}

/* Hand the entries written so far to the kernel (it reads them at the next enter). */
static inline void nvmeswap_uring_publish(nvmeswap_uring *ring)
{
    nvmeswap_store_release(ring->sq_ktail, ring->sq_tail);
}

/* Entries published and not yet taken by the kernel. */
static inline unsigned nvmeswap_uring_unsubmitted(nvmeswap_uring *ring)
{
    return nvmeswap_load_acquire(ring->sq_ktail) - nvmeswap_load_acquire(ring->sq_khead);
}

/* Completions ready to be read. */
static inline unsigned nvmeswap_uring_cq_ready(nvmeswap_uring *ring)
{
    return nvmeswap_load_acquire(ring->cq_ktail) - *ring->cq_khead;
}

/* The ``i``-th completion ready (i < nvmeswap_uring_cq_ready). */
static inline struct nvmeswap_io_uring_cqe *nvmeswap_uring_cqe(nvmeswap_uring *ring, unsigned i)
{
    return &ring->cqes[(*ring->cq_khead + i) & *ring->cq_mask];
}

/* The first ``n`` completions are read: give their slots back to the kernel. */
static inline void nvmeswap_uring_cq_advance(nvmeswap_uring *ring, unsigned n)
{
    nvmeswap_store_release(ring->cq_khead, *ring->cq_khead + n);
}

/* Submit up to ``to_submit`` published entries and, with ``wait_nr``, wait until that many
 * completions are ready; how many entries were submitted, or -errno. */
static inline long nvmeswap_uring_enter(nvmeswap_uring *ring, unsigned to_submit,
                                        unsigned wait_nr)
{
    /* With DEFER_TASKRUN completions are posted only in an enter that gets events. */
    int get = wait_nr || (ring->flags & NVMESWAP_IORING_SETUP_DEFER_TASKRUN);
    return nvmeswap_io_uring_enter(ring->fd, to_submit, wait_nr,
                                   get ? NVMESWAP_IORING_ENTER_GETEVENTS : 0);
}

/* An empty table of ``nr`` registered buffers; 0 or -errno. */
static inline long nvmeswap_uring_buffer_table(nvmeswap_uring *ring, unsigned nr)
{
    struct nvmeswap_io_uring_rsrc_register table;
    memset(&table, 0, sizeof table);
    table.nr = nr;
    table.flags = NVMESWAP_IORING_RSRC_REGISTER_SPARSE;
    return nvmeswap_io_uring_register(ring->fd, NVMESWAP_IORING_REGISTER_BUFFERS2, &table,
                                      sizeof table);
}

/* Slot ``index`` of the table holds ``len`` bytes at ``base`` (pinned by the kernel until
 * the slot changes; NULL and 0 empty it); 0 or -errno. */
static inline long nvmeswap_uring_set_buffer(nvmeswap_uring *ring, unsigned index, void *base,
                                             size_t len)
{
    struct iovec iov = {base, len};
    struct nvmeswap_io_uring_rsrc_update2 update;
    memset(&update, 0, sizeof update);
    update.offset = index;
    update.data = (uint64_t)(uintptr_t)&iov;
    update.nr = 1;
    long ret = nvmeswap_io_uring_register(ring->fd, NVMESWAP_IORING_REGISTER_BUFFERS_UPDATE,
                                          &update, sizeof update);
    return ret < 0 ? ret : 0;
}

/* Make a prepared read or write use registered buffer ``index``, which holds its bytes. */
static inline void nvmeswap_uring_prep_fixed(struct nvmeswap_io_uring_sqe *sqe, unsigned index)
{
    sqe->opcode = sqe->opcode == NVMESWAP_IORING_OP_READ ? NVMESWAP_IORING_OP_READ_FIXED
                                                         : NVMESWAP_IORING_OP_WRITE_FIXED;
    sqe->buf_index = (uint16_t)index;
}

/* Have the kernel signal ``eventfd`` as completions are posted. */
static inline long nvmeswap_uring_register_eventfd(nvmeswap_uring *ring, int eventfd)
{
    return nvmeswap_io_uring_register(ring->fd, NVMESWAP_IORING_REGISTER_EVENTFD, &eventfd, 1);
}

/* Whether io_uring works here: a ring made, an eventfd registered, a no-op submitted and
 * completed. 0, or the -errno of the first call refused (-EOPNOTSUPP: a kernel older than
 * Linux 5.6, whose io_uring has no IORING_OP_READ/WRITE); ``*which`` names that call. */
static inline long nvmeswap_uring_probe(int eventfd, const char **which)
{
    nvmeswap_uring ring;
    long ret;
    *which = "io_uring_setup";
    ret = nvmeswap_uring_open(&ring, 2, 4, 0);
    if (ret < 0)
        return ret;
    if (!(ring.features & NVMESWAP_IORING_FEAT_RW_CUR_POS)
            || !(ring.features & NVMESWAP_IORING_FEAT_NODROP)) {
        nvmeswap_uring_close(&ring);
        return -EOPNOTSUPP;
    }
    *which = "io_uring_register";
    ret = nvmeswap_uring_register_eventfd(&ring, eventfd);
    if (ret >= 0) {
        struct nvmeswap_io_uring_sqe *sqe = nvmeswap_uring_next_sqe(&ring);
        sqe->opcode = NVMESWAP_IORING_OP_NOP;
        nvmeswap_uring_publish(&ring);
        *which = "io_uring_enter";
        do {
            ret = nvmeswap_uring_enter(&ring, 1, 1);
        } while (ret == -EINTR);
        if (ret >= 0 && nvmeswap_uring_cq_ready(&ring) != 1)
            ret = -EIO;
    }
    nvmeswap_uring_close(&ring);
    return ret < 0 ? ret : 0;
}

#endif
