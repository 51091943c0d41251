"""The exceptions and warnings nvmeswap raises, and the one place errno becomes an exception."""
import os


class WorkerDied(RuntimeError):
    """A worker process died; every operation outstanding at that moment failed with it."""


class ValidationError(Exception):
    """``validate=True`` found bytes in the file that differ from the buffer."""

    def __init__(self, message, filename, offset):
        super().__init__(message)
        self.filename = filename
        self.offset = offset


class ShortFileError(OSError):
    """A read asked for bytes beyond the end of the file."""

    def __str__(self):
        return self.args[0]


class BufferedIOWarning(RuntimeWarning):
    """The filesystem refused O_DIRECT, so I/O goes through the page cache."""


class MemoryLockWarning(RuntimeWarning):
    """Page-locking was refused (RLIMIT_MEMLOCK); memory is shared but not locked."""


def os_error(err, filename, detail=""):
    """``OSError(err, ...)``: Python picks the subclass (FileNotFoundError, ...) from err."""
    message = os.strerror(err)
    if detail:
        message = f"{message} ({detail})"
    return OSError(err, message, filename)


def short_file_error(filename, message):
    error = ShortFileError(f"{filename}: {message}")
    error.filename = filename
    return error
