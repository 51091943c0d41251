# The one place where the Cython layer turns an errno into a Python exception.
from libc.string cimport strerror


cdef inline object errno_error(int err, str what=None):
    """``OSError(err, ...)``, so that Python picks the subclass (FileNotFoundError, ...)."""
    message = strerror(err).decode(errors="replace")
    return OSError(err, f"{what}: {message}" if what else message)
