"""The exceptions and warnings nvmeswap raises, and the one place errno becomes an exception."""
import errno
import os
import sys
import warnings
from typing import ClassVar

_warned = set()
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep

# The code spaces of an error code from a worker: an errno (below CUFILE_ERROR), or one of
# these plus cuFile's or the CUDA driver's own code.
CUFILE_ERROR = 1 << 16
CUDA_ERROR = 1 << 20


class WorkerDied(RuntimeError):
    """A worker process died; every operation outstanding at that moment failed with it."""


class ValidationError(Exception):
    """``validate=True`` found bytes in the file that differ from the buffer."""

    def __init__(self, message, filename, offset):
        super().__init__(message)
        self.filename = filename
        self.offset = offset

    def __reduce__(self):   # from another process (a pool's worker) as it was raised
        return type(self), (self.args[0], self.filename, self.offset)


class MemoryBudgetError(MemoryError):
    """A handle was asked to lock or map more than its ``memory_budget``."""


class ShortFileError(OSError):
    """A read asked for bytes beyond the end of the file."""

    def __str__(self):
        return self.args[0]


class CuFileError(OSError):
    """A cuFile call failed; ``name`` is cuFile's name for ``code`` (CU_FILE_...)."""

    NAMES: ClassVar[dict] = {
        5001: "CU_FILE_DRIVER_NOT_INITIALIZED", 5002: "CU_FILE_DRIVER_INVALID_PROPS",
        5003: "CU_FILE_DRIVER_UNSUPPORTED_LIMIT", 5004: "CU_FILE_DRIVER_VERSION_MISMATCH",
        5005: "CU_FILE_DRIVER_VERSION_READ_ERROR", 5006: "CU_FILE_DRIVER_CLOSING",
        5007: "CU_FILE_PLATFORM_NOT_SUPPORTED", 5008: "CU_FILE_IO_NOT_SUPPORTED",
        5009: "CU_FILE_DEVICE_NOT_SUPPORTED", 5010: "CU_FILE_NVFS_DRIVER_ERROR",
        5011: "CU_FILE_CUDA_DRIVER_ERROR", 5012: "CU_FILE_CUDA_POINTER_INVALID",
        5013: "CU_FILE_CUDA_MEMORY_TYPE_INVALID", 5014: "CU_FILE_CUDA_POINTER_RANGE_ERROR",
        5015: "CU_FILE_CUDA_CONTEXT_MISMATCH", 5016: "CU_FILE_INVALID_MAPPING_SIZE",
        5017: "CU_FILE_INVALID_MAPPING_RANGE", 5018: "CU_FILE_INVALID_FILE_TYPE",
        5019: "CU_FILE_INVALID_FILE_OPEN_FLAG", 5020: "CU_FILE_DIO_NOT_SET",
        5022: "CU_FILE_INVALID_VALUE", 5023: "CU_FILE_MEMORY_ALREADY_REGISTERED",
        5024: "CU_FILE_MEMORY_NOT_REGISTERED", 5025: "CU_FILE_PERMISSION_DENIED",
        5026: "CU_FILE_DRIVER_ALREADY_OPEN", 5027: "CU_FILE_HANDLE_NOT_REGISTERED",
        5028: "CU_FILE_HANDLE_ALREADY_REGISTERED", 5029: "CU_FILE_DEVICE_NOT_FOUND",
        5030: "CU_FILE_INTERNAL_ERROR", 5031: "CU_FILE_GETNEWFD_FAILED",
        5033: "CU_FILE_NVFS_SETUP_ERROR", 5034: "CU_FILE_IO_DISABLED",
    }

    def __init__(self, code, call, cuda_error=0):
        self.code = code
        self.call = call
        self.cuda_error = cuda_error
        self.name = self.NAMES.get(code, f"cuFile error {code}")
        detail = f" (CUDA error {cuda_error})" if code == 5011 and cuda_error else ""
        super().__init__(f"{call} failed: {self.name}{detail}")

    def __str__(self):
        return self.args[0]

    def __reduce__(self):
        return type(self), (self.code, self.call, self.cuda_error)


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``name`` is the driver's name for ``code`` (CUDA_ERROR_...)."""

    def __init__(self, code, call, name):
        self.code = code
        self.call = call
        self.name = name
        super().__init__(f"{call} failed: {name}")

    def __reduce__(self):
        return type(self), (self.code, self.call, self.name)


class GdsFallbackWarning(RuntimeWarning):
    """GPUDirect Storage proper is not in use: cuFile's compat mode, or the aio road."""


class BufferedIOWarning(RuntimeWarning):
    """I/O goes through the page cache: the filesystem refused O_DIRECT, or what is
    asked for (DCP's stream extensions) needs the buffered road."""


class EngineFallbackWarning(RuntimeWarning):
    """``engine="auto"`` found io_uring refused here and uses kernel AIO (Note [engines])."""


class MemoryLockWarning(RuntimeWarning):
    """Page-locking was refused (RLIMIT_MEMLOCK); memory is shared but not locked."""


def warn_once(key, message, category):
    """Warn the first time ``key`` comes up in this process: a refusal that repeats on every
    call (O_DIRECT, page-locking, cuFile) is worth one warning, not thousands. The warning
    points at the caller's line that called into nvmeswap.
    """
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=caller_stacklevel())


def caller_stacklevel():
    """The ``stacklevel`` (for a ``warnings.warn`` made by our caller) of the first frame
    outside this package: the user's code."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def os_error(err, filename, detail=""):
    """``OSError(err, ...)``: Python picks the subclass (FileNotFoundError, ...) from err."""
    message = os.strerror(err)
    if detail:
        message = f"{message} ({detail})"
    return OSError(err, message, filename)


def aio_contexts_exhausted(err, detail=""):
    """io_setup's refusal: the system's kernel AIO contexts are all in use (fs.aio-max-nr)."""
    return os_error(err, "/proc/sys/fs/aio-max-nr",
                    f"io_setup failed{detail}: too many kernel AIO contexts are in use; raise "
                    "the limit with `sysctl -w fs.aio-max-nr=1048576` or close handles")


def uring_setup_refused(err, detail=""):
    """io_uring_setup's refusal, where the probe had let io_uring through."""
    return os_error(err, None, f"io_uring_setup failed{detail}: io_uring is refused here "
                               "(kernel.io_uring_disabled, a seccomp profile) or out of locked "
                               "memory (`ulimit -l`); use engine='aio' or 'auto'")


def short_file_error(filename, message):
    error = ShortFileError(f"{filename}: {message}")
    error.filename = filename
    return error


def error_code(error):
    """The response code for an exception raised in a worker."""
    if isinstance(error, CuFileError):
        return CUFILE_ERROR + error.code
    if isinstance(error, CudaError):
        return CUDA_ERROR + error.code
    if isinstance(error, OSError) and error.errno:
        return error.errno
    return errno.EIO


def error_from_code(code, filename, detail):
    """The exception for a response's error code, naming ``filename``."""
    if code >= CUDA_ERROR:
        from ._cuda import error_name

        error = CudaError(code - CUDA_ERROR, f"{filename}: CUDA IPC for the {detail}",
                          error_name(code - CUDA_ERROR))
    elif code >= CUFILE_ERROR:
        error = CuFileError(code - CUFILE_ERROR, f"{filename}: cuFile {detail}")
    else:
        return os_error(code, filename, detail)
    error.filename = filename
    return error
