"""Transfers in the calling thread, and the record of a transfer's outcome (pyx/_transfers.pyx).

Results cross the Cython edge one way, here and in nvmeswap._queues and nvmeswap._memory:

- a failure of the call itself raises ``OSError`` with its errno, naming the system call
  (pyx/_check.pxd); no function returns an errno;
- a transfer's outcome is a :class:`Completion`, failed (an errno) or short (fewer bytes
  got than requested) included;
- ``None`` means "not taken here": the caller runs the operation the ordinary way.
"""
from typing import Any, Literal

class Completion:
    """The outcome of one transfer: chunk ``chunk`` of operation ``op_id``, whichever road
    it took. On success ``err`` is 0 and ``at_offset``, ``requested`` and ``got`` are the
    whole transfer's offset and bytes; on failure, the first failure's errno (0 for a read
    that met the end of the file), where it happened, the bytes requested there and how
    many of them came back."""

    def __init__(self, op_id: int, chunk: int, err: int, at_offset: int, requested: int,
                 got: int) -> None: ...
    @property
    def op_id(self) -> int: ...
    @property
    def chunk(self) -> int: ...
    @property
    def err(self) -> int: ...
    @property
    def at_offset(self) -> int: ...
    @property
    def requested(self) -> int: ...
    @property
    def got(self) -> int: ...
    @property
    def failed(self) -> bool:
        """``err`` is set, or ``got != requested``."""

def transfer_in_caller(op_id: int, chunk: int, is_read: bool, direct_fd: int,
                       buffered_fd: int, address: int, nbytes: int, offset: int,
                       alignment: int) -> Completion:
    """Move the bytes with pread/pwrite in the calling thread, GIL released."""

def quick_transfer(is_read: bool, path: bytes, address: int, nbytes: int, offset: int,
                   device: int = 0, inode: int = 0) -> Literal[True] | None:
    """Open ``path`` with O_DIRECT, move the bytes, close: True, or None if not taken."""

def open_for_direct_read(path: bytes, end: int) -> tuple[int, int, int, int] | None:
    """``(fd, size, device, inode)`` of ``path`` opened with O_DIRECT if it is a regular
    file of at least ``end`` bytes; else None."""

def still_names(path: bytes, device: int, inode: int, end: int) -> bool:
    """Whether ``path`` names the regular file ``device``/``inode`` now, at least ``end``
    bytes long."""
def post_to_run(queue: Any, run: Any, buffer: Any, offset: int) -> bool:
    """Post one more read of a quick read run to the caller queue and count it in the
    same call; False if the queue took none."""

def preallocate(fd: int, offset: int, length: int) -> None:
    """fallocate(2) without glibc's fallback of writing zeros; OSError if refused."""

def direct_split(offset: int, nbytes: int, alignment: int) -> tuple[int, int]:
    """``(middle_start, middle_end)``: the part of the range O_DIRECT can move."""
