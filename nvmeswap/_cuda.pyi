"""The CUDA driver's IPC calls through a dlopen'ed function table (pyx/_cuda.pyx).

A failed driver call raises ``nvmeswap.CudaError`` with the driver's code and name; a call
before ``load`` raises ``RuntimeError``. ``load`` answers ``(False, why)`` where the driver
is absent: that is an answer, not an error.
"""
from _typeshed import ReadableBuffer

IPC_HANDLE_SIZE: int

def load(path: str | bytes) -> tuple[bool, str]:
    """Load the driver from ``path``: ``(True, "")`` or ``(False, why)``."""

def loaded() -> bool: ...
def initialize() -> None: ...
def use_device(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context current in this thread."""
def export(address: int, ordinal: int) -> tuple[bytes, int, int]:
    """``(IPC handle, base address, size)`` of the allocation holding ``address``."""
def open_handle(handle_bytes: bytes) -> int:
    """Map another process's exported allocation; its base address here."""
def close_handle(base: int) -> None: ...
def copy_to_host(address: int, nbytes: int) -> bytes: ...
def copy_to_device(address: int, data: ReadableBuffer) -> None: ...
def error_name(code: int) -> str:
    """The driver's name for ``code`` (CUDA_ERROR_...)."""
