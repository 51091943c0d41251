/* The CUDA driver API calls nvmeswap needs for GPUDirect Storage, loaded at run time.
 *
 * gds_handle's workers reach the caller's CUDA tensors through CUDA IPC: the parent
 * exports the allocation holding a tensor, each worker maps it into its own context.
 * The unaligned head and tail of a transfer (under a block each) are copied with
 * cuMemcpy and go through the file's buffered descriptor (Note [O_DIRECT tail]); a copy
 * to the device from pageable memory may return before its bytes land, so the context is
 * synchronized after it (pyx/_cuda.pyx, copy_to_device).
 * Our own declarations of the few types used, and a table filled from libcuda.so.1
 * with dlopen, so that nothing here is needed to build or import nvmeswap.
 */
#ifndef NVMESWAP_CUDA_DRIVER_SHIM_H
#define NVMESWAP_CUDA_DRIVER_SHIM_H

#include <string.h>

#include "dlopen_table.h"

typedef int nvmeswap_CUresult;                  /* CUDA_SUCCESS is 0 */
typedef unsigned long long nvmeswap_CUdeviceptr;
typedef void *nvmeswap_CUcontext;
typedef struct { char reserved[64]; } nvmeswap_CUipcMemHandle;

#define NVMESWAP_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1

typedef struct {
    void *library;
    nvmeswap_CUresult (*init)(unsigned int);
    nvmeswap_CUresult (*device_get)(int *, int);
    nvmeswap_CUresult (*primary_ctx_retain)(nvmeswap_CUcontext *, int);
    nvmeswap_CUresult (*ctx_set_current)(nvmeswap_CUcontext);
    nvmeswap_CUresult (*ctx_push_current)(nvmeswap_CUcontext);
    nvmeswap_CUresult (*ctx_pop_current)(nvmeswap_CUcontext *);
    nvmeswap_CUresult (*mem_get_address_range)(nvmeswap_CUdeviceptr *, size_t *,
                                               nvmeswap_CUdeviceptr);
    nvmeswap_CUresult (*ipc_get_mem_handle)(nvmeswap_CUipcMemHandle *, nvmeswap_CUdeviceptr);
    nvmeswap_CUresult (*ipc_open_mem_handle)(nvmeswap_CUdeviceptr *, nvmeswap_CUipcMemHandle,
                                             unsigned int);
    nvmeswap_CUresult (*ipc_close_mem_handle)(nvmeswap_CUdeviceptr);
    nvmeswap_CUresult (*get_error_name)(nvmeswap_CUresult, const char **);
    nvmeswap_CUresult (*memcpy_dtoh)(void *, nvmeswap_CUdeviceptr, size_t);
    nvmeswap_CUresult (*memcpy_htod)(nvmeswap_CUdeviceptr, const void *, size_t);
    nvmeswap_CUresult (*ctx_synchronize)(void);
} nvmeswap_cuda_table;

/* Fill ``table`` from the library at ``path``; 0 on success, else -1 with ``why`` set. */
static inline int nvmeswap_cuda_load(const char *path, nvmeswap_cuda_table *table, char *why,
                                     size_t why_len)
{
    /* The _v2 names are what cuda.h's macros resolve to since CUDA 4 and 11. */
    const char *names[] = {"cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                           "cuCtxSetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
                           "cuMemGetAddressRange_v2", "cuIpcGetMemHandle",
                           "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle", "cuGetErrorName",
                           "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuCtxSynchronize"};
    void **slots[] = {(void **)&table->init, (void **)&table->device_get,
                      (void **)&table->primary_ctx_retain, (void **)&table->ctx_set_current,
                      (void **)&table->ctx_push_current, (void **)&table->ctx_pop_current,
                      (void **)&table->mem_get_address_range,
                      (void **)&table->ipc_get_mem_handle, (void **)&table->ipc_open_mem_handle,
                      (void **)&table->ipc_close_mem_handle, (void **)&table->get_error_name,
                      (void **)&table->memcpy_dtoh, (void **)&table->memcpy_htod,
                      (void **)&table->ctx_synchronize};
    memset(table, 0, sizeof(*table));
    table->library = nvmeswap_dlopen_table(path, names, slots, sizeof(names) / sizeof(names[0]),
                                           why, why_len);
    return table->library == NULL ? -1 : 0;
}

#endif
