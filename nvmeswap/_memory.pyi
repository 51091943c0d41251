"""Shared mappings that the parent and its workers both see, and raw copies (pyx/_memory.pyx).

A failure of a call raises ``OSError`` with its errno, naming the system call
(pyx/_check.pxd), as in nvmeswap._queues and nvmeswap._transfers; no function returns an
errno.
"""
import sys

from _typeshed import ReadableBuffer

class Mapping:
    """A read-write MAP_SHARED mapping of ``size`` bytes at ``offset`` of a descriptor;
    a buffer, alive while anything made from it is. With ``private_after_fork``, a
    forked child's copy is copy-on-write (Note [locked memory across fork])."""

    def __init__(self, fd: int, size: int, offset: int = 0,
                 private_after_fork: bool = False) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def locked(self) -> bool: ...
    def lock(self, on_fault: bool = False) -> None:
        """Page-lock the mapping (``on_fault``: each page as it is first touched)."""
    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...

def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give back the memory of a range of a memfd, keeping its size."""

def buffer_address(obj: ReadableBuffer, writable: bool) -> tuple[int, int]:
    """``(address, nbytes)`` of a C-contiguous buffer; valid while ``obj`` lives."""

def lock_range(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` (mlock(2)); the lock goes with the mapping."""

def copy_memory(destination: int, source: int, nbytes: int) -> None:
    """memcpy without the GIL."""

def first_difference(a: int, b: int, nbytes: int) -> int:
    """Index of the first byte where the ranges differ, or -1."""
