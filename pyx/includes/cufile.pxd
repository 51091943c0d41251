# cdeps/cufile_shim.h: cuFile's types and a dlopen'ed function table.
from posix.types cimport off_t


cdef extern from "cufile_shim.h" nogil:
    ctypedef struct nvmeswap_CUfileError_t:
        int err
        int cu_err

    ctypedef void *nvmeswap_CUfileHandle_t

    union descr_handle:
        int fd
        void *handle

    ctypedef struct nvmeswap_CUfileDescr_t:
        int type
        descr_handle handle
        const void *fs_ops

    ctypedef struct nvmeswap_cufile_table:
        void *library
        nvmeswap_CUfileError_t (*driver_open)()
        nvmeswap_CUfileError_t (*driver_close)()
        nvmeswap_CUfileError_t (*handle_register)(nvmeswap_CUfileHandle_t *,
                                                  nvmeswap_CUfileDescr_t *)
        void (*handle_deregister)(nvmeswap_CUfileHandle_t)
        nvmeswap_CUfileError_t (*buf_register)(const void *, size_t, int)
        nvmeswap_CUfileError_t (*buf_deregister)(const void *)
        ssize_t (*read)(nvmeswap_CUfileHandle_t, void *, size_t, off_t, off_t) noexcept nogil
        ssize_t (*write)(nvmeswap_CUfileHandle_t, const void *, size_t, off_t, off_t) noexcept nogil

    int nvmeswap_cufile_load(const char *path, nvmeswap_cufile_table *table, char *why,
                             size_t why_len)
