# io_uring as cdeps/io_uring.h calls it; only what nvmeswap uses.


cdef extern from "io_uring.h" nogil:
    enum:
        NVMESWAP_IORING_OP_READ
        NVMESWAP_IORING_OP_WRITE
        NVMESWAP_IORING_SETUP_COOP_TASKRUN
        NVMESWAP_IORING_SETUP_R_DISABLED
        NVMESWAP_IORING_SETUP_SINGLE_ISSUER
        NVMESWAP_IORING_SETUP_DEFER_TASKRUN
        NVMESWAP_IORING_MAX_FIXED_BUFFER

    struct nvmeswap_io_uring_sqe:
        pass

    struct nvmeswap_io_uring_cqe:
        unsigned long long user_data
        int res

    ctypedef struct nvmeswap_uring:
        int fd
        unsigned flags

    struct nvmeswap_io_uring_params:
        pass

    long nvmeswap_uring_open(nvmeswap_uring *ring, unsigned entries, unsigned cq_entries,
                             unsigned flags)
    void nvmeswap_uring_close(nvmeswap_uring *ring)
    long nvmeswap_uring_setup(unsigned entries, unsigned cq_entries, unsigned *flags,
                              nvmeswap_io_uring_params *p)
    long nvmeswap_uring_adopt(nvmeswap_uring *ring, int fd, const nvmeswap_io_uring_params *p,
                              unsigned flags)
    long nvmeswap_uring_enable(nvmeswap_uring *ring)
    long nvmeswap_uring_clone_buffers(nvmeswap_uring *ring, int src_fd, unsigned first,
                                      unsigned nr)
    nvmeswap_io_uring_sqe *nvmeswap_uring_next_sqe(nvmeswap_uring *ring)
    void nvmeswap_uring_prep_rw(nvmeswap_io_uring_sqe *sqe, int opcode, int fd,
                                unsigned long long addr, unsigned len,
                                unsigned long long offset, unsigned long long data)
    void nvmeswap_uring_publish(nvmeswap_uring *ring)
    unsigned nvmeswap_uring_unsubmitted(nvmeswap_uring *ring)
    unsigned nvmeswap_uring_cq_ready(nvmeswap_uring *ring)
    nvmeswap_io_uring_cqe *nvmeswap_uring_cqe(nvmeswap_uring *ring, unsigned i)
    void nvmeswap_uring_cq_advance(nvmeswap_uring *ring, unsigned n)
    long nvmeswap_uring_enter(nvmeswap_uring *ring, unsigned to_submit, unsigned wait_nr)
    long nvmeswap_uring_register_eventfd(nvmeswap_uring *ring, int eventfd)
    long nvmeswap_uring_buffer_table(nvmeswap_uring *ring, unsigned nr)
    long nvmeswap_uring_set_buffer(nvmeswap_uring *ring, unsigned index, void *base, size_t len)
    void nvmeswap_uring_prep_fixed(nvmeswap_io_uring_sqe *sqe, unsigned index)
    long nvmeswap_uring_probe(int eventfd, const char **which)
