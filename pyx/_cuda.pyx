# cython: language_level=3
"""The CUDA driver's IPC calls through a dlopen'ed function table (cdeps/cuda_driver_shim.h).

gds_handle exports the allocation that holds a CUDA tensor; its workers open it in
their own context and hand the mapped address to cuFile. Each failure becomes
``nvmeswap.CudaError`` with the driver's name for it.
"""
from libc.string cimport memcpy, memset

from includes.cuda_driver cimport (
    NVMESWAP_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, nvmeswap_CUcontext, nvmeswap_CUdeviceptr,
    nvmeswap_CUipcMemHandle, nvmeswap_CUresult, nvmeswap_cuda_load, nvmeswap_cuda_table,
)
import os

from nvmeswap.errors import CudaError

cdef nvmeswap_cuda_table table
memset(&table, 0, sizeof(table))
IPC_HANDLE_SIZE = sizeof(nvmeswap_CUipcMemHandle)
_contexts = {}


def load(path):
    """Load the driver from ``path``; return ``(True, "")`` or ``(False, why)``."""
    cdef char why[512]
    if table.library != NULL:
        return True, ""
    if nvmeswap_cuda_load(os.fsencode(path), &table, why, sizeof(why)) != 0:
        return False, why.decode(errors="replace")
    return True, ""


def loaded():
    return table.library != NULL


cdef _check(nvmeswap_CUresult result, what):
    if result != 0:
        raise CudaError(result, what, error_name(result))


cdef _require():
    if table.library == NULL:
        raise RuntimeError("the CUDA driver is not loaded (see nvmeswap.gds_available())")


def initialize():
    _require()
    _check(table.init(0), "cuInit")


cdef nvmeswap_CUcontext _primary_context(int ordinal) except? NULL:
    """Device ``ordinal``'s primary context (the one torch uses), retained once."""
    cdef int device
    cdef nvmeswap_CUcontext context
    _require()
    if ordinal not in _contexts:
        initialize()
        _check(table.device_get(&device, ordinal), "cuDeviceGet")
        _check(table.primary_ctx_retain(&context, device), "cuDevicePrimaryCtxRetain")
        _contexts[ordinal] = <size_t>context
    return <nvmeswap_CUcontext><size_t>_contexts[ordinal]


def use_device(int ordinal):
    """Make device ``ordinal``'s primary context current in this thread (in workers)."""
    _check(table.ctx_set_current(_primary_context(ordinal)), "cuCtxSetCurrent")


def export(size_t address, int ordinal):
    """The allocation holding ``address`` on device ``ordinal``: ``(ipc handle bytes, base
    address, size)``. The caller's current context is left as it was."""
    cdef nvmeswap_CUdeviceptr base = 0
    cdef size_t size = 0
    cdef nvmeswap_CUipcMemHandle handle
    cdef nvmeswap_CUcontext popped
    _check(table.ctx_push_current(_primary_context(ordinal)), "cuCtxPushCurrent")
    try:
        _check(table.mem_get_address_range(&base, &size, address), "cuMemGetAddressRange")
        _check(table.ipc_get_mem_handle(&handle, base), "cuIpcGetMemHandle")
    finally:
        table.ctx_pop_current(&popped)
    return (<char *>&handle)[:sizeof(handle)], <size_t>base, size


def open_handle(bytes handle_bytes):
    """Map another process's exported allocation here; returns its base address."""
    cdef nvmeswap_CUipcMemHandle handle
    cdef nvmeswap_CUdeviceptr base = 0
    _require()
    if len(handle_bytes) != sizeof(handle):
        raise ValueError(f"an IPC handle is {sizeof(handle)} bytes, got {len(handle_bytes)}")
    memcpy(&handle, <const char *>handle_bytes, sizeof(handle))
    _check(table.ipc_open_mem_handle(&base, handle, NVMESWAP_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
           "cuIpcOpenMemHandle")
    return <size_t>base


def close_handle(size_t base):
    _require()
    _check(table.ipc_close_mem_handle(base), "cuIpcCloseMemHandle")


def copy_to_host(size_t address, size_t nbytes):
    """``nbytes`` of device memory at ``address`` as bytes (for a transfer's unaligned ends)."""
    cdef bytearray data = bytearray(nbytes)
    cdef char *destination = data
    cdef nvmeswap_CUresult result
    _require()
    with nogil:
        result = table.memcpy_dtoh(destination, address, nbytes)
    _check(result, "cuMemcpyDtoH")
    return bytes(data)


def copy_to_device(size_t address, const unsigned char[::1] data):
    """Copy ``data`` to device memory at ``address``; returns once the bytes are there.

    From pageable memory, cuMemcpyHtoD may return once the bytes are staged for DMA,
    before they land: another process (the parent that reads the tensor after ``wait()``)
    could see the old bytes. Synchronizing the context waits for the DMA."""
    cdef nvmeswap_CUresult result, synced = 0
    _require()
    if data.shape[0] == 0:
        return
    with nogil:
        result = table.memcpy_htod(address, &data[0], data.shape[0])
        if result == 0:
            synced = table.ctx_synchronize()
    _check(result, "cuMemcpyHtoD")
    _check(synced, "cuCtxSynchronize")


def error_name(int code):
    """The driver's name for ``code`` (CUDA_ERROR_...), when the driver is loaded."""
    cdef const char *name = NULL
    if table.library != NULL and table.get_error_name(code, &name) == 0 and name != NULL:
        return name.decode(errors="replace")
    return f"CUDA driver error {code}"
