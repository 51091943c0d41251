# cdeps/cuda_driver_shim.h: the CUDA driver calls for IPC, and a dlopen'ed function table.

cdef extern from "cuda_driver_shim.h" nogil:
    ctypedef int nvmeswap_CUresult
    ctypedef unsigned long long nvmeswap_CUdeviceptr
    ctypedef void *nvmeswap_CUcontext

    ctypedef struct nvmeswap_CUipcMemHandle:
        char reserved[64]

    int NVMESWAP_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

    ctypedef struct nvmeswap_cuda_table:
        void *library
        nvmeswap_CUresult (*init)(unsigned int)
        nvmeswap_CUresult (*device_get)(int *, int)
        nvmeswap_CUresult (*primary_ctx_retain)(nvmeswap_CUcontext *, int)
        nvmeswap_CUresult (*ctx_set_current)(nvmeswap_CUcontext)
        nvmeswap_CUresult (*ctx_push_current)(nvmeswap_CUcontext)
        nvmeswap_CUresult (*ctx_pop_current)(nvmeswap_CUcontext *)
        nvmeswap_CUresult (*mem_get_address_range)(nvmeswap_CUdeviceptr *, size_t *,
                                                   nvmeswap_CUdeviceptr)
        nvmeswap_CUresult (*ipc_get_mem_handle)(nvmeswap_CUipcMemHandle *, nvmeswap_CUdeviceptr)
        nvmeswap_CUresult (*ipc_open_mem_handle)(nvmeswap_CUdeviceptr *, nvmeswap_CUipcMemHandle,
                                                 unsigned int)
        nvmeswap_CUresult (*ipc_close_mem_handle)(nvmeswap_CUdeviceptr)
        nvmeswap_CUresult (*get_error_name)(nvmeswap_CUresult, const char **)
        nvmeswap_CUresult (*memcpy_dtoh)(void *, nvmeswap_CUdeviceptr, size_t) noexcept nogil
        nvmeswap_CUresult (*memcpy_htod)(nvmeswap_CUdeviceptr, const void *, size_t) noexcept nogil
        nvmeswap_CUresult (*ctx_synchronize)() noexcept nogil

    int nvmeswap_cuda_load(const char *path, nvmeswap_cuda_table *table, char *why,
                           size_t why_len)
