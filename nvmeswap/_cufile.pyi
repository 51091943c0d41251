"""cuFile through a dlopen'ed function table (pyx/_cufile.pyx); importing needs no CUDA.

A failed cuFile call raises ``nvmeswap.CuFileError`` (an ``OSError``) with cuFile's code; a
system error raises ``OSError`` with its errno (pyx/_check.pxd). A call before ``load``
raises ``RuntimeError``. ``load`` answers ``(False, why)`` where the library is absent:
that is an answer, not an error.
"""

def load(path: str | bytes) -> tuple[bool, str]:
    """Load cuFile from ``path``: ``(True, "")`` or ``(False, why)``."""

def loaded() -> bool: ...
def driver_open() -> None: ...
def driver_close() -> None: ...
def handle_register(fd: int) -> int:
    """Register an open descriptor; the cuFile handle as an int."""
def handle_deregister(handle: int) -> None: ...
def buf_register(address: int, nbytes: int, flags: int = 0) -> None: ...
def buf_deregister(address: int) -> None: ...
def read(handle: int, base: int, nbytes: int, file_offset: int, base_offset: int) -> int:
    """cuFileRead without the GIL; the bytes read (0 at end of file)."""
def write(handle: int, base: int, nbytes: int, file_offset: int, base_offset: int) -> int:
    """cuFileWrite without the GIL; the bytes written."""
