# cython: language_level=3
"""cuFile through a dlopen'ed function table (cdeps/cufile_shim.h); nothing here needs CUDA
to build or import. Each call turns a cuFile error into ``nvmeswap.CuFileError``."""
from libc.errno cimport errno
from posix.types cimport off_t

from _check cimport errno_error
from includes.cufile cimport (
    nvmeswap_CUfileDescr_t, nvmeswap_CUfileError_t, nvmeswap_CUfileHandle_t,
    nvmeswap_cufile_load, nvmeswap_cufile_table,
)
from libc.string cimport memset
import os

from nvmeswap.errors import CuFileError

cdef nvmeswap_cufile_table table
memset(&table, 0, sizeof(table))
cdef int CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1


def load(path):
    """Load cuFile from ``path``; return ``(True, "")`` or ``(False, why)``."""
    cdef char why[512]
    encoded = os.fsencode(path)
    if nvmeswap_cufile_load(encoded, &table, why, sizeof(why)) != 0:
        return False, why.decode(errors="replace")
    return True, ""


def loaded():
    return table.library != NULL


cdef _require():
    if table.library == NULL:
        raise RuntimeError("cuFile is not loaded (see nvmeswap.gds_available())")


cdef _check(nvmeswap_CUfileError_t status, what):
    if status.err != 0:
        raise CuFileError(status.err, what, status.cu_err)


def driver_open():
    _require()
    _check(table.driver_open(), "cuFileDriverOpen")


def driver_close():
    _require()
    _check(table.driver_close(), "cuFileDriverClose")


def handle_register(int fd):
    """Register an open file descriptor; returns the cuFile handle as an int."""
    cdef nvmeswap_CUfileDescr_t description
    cdef nvmeswap_CUfileHandle_t handle = NULL
    _require()
    memset(&description, 0, sizeof(description))
    description.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD
    description.handle.fd = fd
    _check(table.handle_register(&handle, &description), "cuFileHandleRegister")
    return <size_t>handle


def handle_deregister(size_t handle):
    _require()
    table.handle_deregister(<nvmeswap_CUfileHandle_t>handle)


def buf_register(size_t address, size_t nbytes, int flags=0):
    _require()
    _check(table.buf_register(<const void *>address, nbytes, flags), "cuFileBufRegister")


def buf_deregister(size_t address):
    _require()
    _check(table.buf_deregister(<const void *>address), "cuFileBufDeregister")


def read(size_t handle, size_t base, size_t nbytes, off_t file_offset, off_t base_offset):
    """cuFileRead without the GIL; returns the bytes read."""
    cdef ssize_t ret
    _require()
    with nogil:
        ret = table.read(<nvmeswap_CUfileHandle_t>handle, <void *>base, nbytes, file_offset,
                         base_offset)
    return _io_result(ret, errno, "cuFileRead")


def write(size_t handle, size_t base, size_t nbytes, off_t file_offset, off_t base_offset):
    """cuFileWrite without the GIL; returns the bytes written."""
    cdef ssize_t ret
    _require()
    with nogil:
        ret = table.write(<nvmeswap_CUfileHandle_t>handle, <const void *>base, nbytes,
                          file_offset, base_offset)
    return _io_result(ret, errno, "cuFileWrite")


cdef _io_result(ssize_t ret, int err, what):
    # cuFileRead/Write: -1 with errno for a system error, -code for a cuFile error.
    if ret == -1:
        raise errno_error(err, what)
    if ret < 0:
        raise CuFileError(-ret, what)
    return ret
