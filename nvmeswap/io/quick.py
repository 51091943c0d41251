"""Small synchronous operations settled in one call, without the scheduler's books.

Note [quick synchronous operations]
A synchronous read or write of one small aligned request spends most of its time outside
the device: with the file opened, the operation booked, placed, checked for order and
completed in Python, a 4 KiB read took ~60 us beyond its ~100 us on the device. When
nothing of the handle is in flight there is nothing to order it after, and an aligned
buffer needs no staging: one call into ``_engine.quick_transfer`` opens the file with
O_DIRECT, moves the bytes straight between the tensor and the file without the GIL, and
closes it. Whatever that call cannot settle (a file to create, grow or refuse, a short
read, a failed transfer) runs the ordinary way, which says why; both directions are safe
to repeat, a failed write included, as it never grows the file. What the books did still
holds: ``close()`` waits for a quick operation as for any inline one, and a quick write
is one of the process's writes in flight (Note [shared growth]), so that a failed write
of the same file on another handle does not cut it away.
"""
import os
import sys

from .._engine import quick_transfer
from .files import ALIGNMENT
from .operation import MAX_FILE_END, WRITES


class QuickWrite:
    """A quick write while it runs, as Note [shared growth] sees writes in flight: a
    failed write of the same file on another handle must not cut back what it wrote."""

    __slots__ = ("file", "shares_file")
    is_read = False

    def __init__(self, identity):
        self.file = FileIdentity(identity)
        self.shares_file = False


class FileIdentity:
    __slots__ = ("identity",)

    def __init__(self, identity):
        self.identity = identity


def quick(buffer, target, file_offset, *, is_read, limit):
    """Move the bytes of a small synchronous operation in one call; False if it did not."""
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(buffer, torch.Tensor)
            or not isinstance(target, (str, bytes, os.PathLike))
            or type(file_offset) is not int or file_offset < 0 or file_offset % ALIGNMENT
            or buffer.layout is not torch.strided or not buffer.is_cpu or buffer.is_nested
            or buffer.is_quantized or buffer.is_conj() or buffer.is_neg()
            or not buffer.is_contiguous()):
        return False
    address, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if (not 0 < nbytes <= limit or nbytes % ALIGNMENT or address % ALIGNMENT
            or file_offset > MAX_FILE_END - nbytes):
        return False
    path = os.fsencode(target)
    if type(path) is not bytes or b"\0" in path:
        return False    # C would read a shorter name: the ordinary road refuses it
    if is_read:
        return quick_transfer(True, path, address, nbytes, file_offset)
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return False
    write = QuickWrite((info.st_dev, info.st_ino))
    try:
        WRITES.start(write)
        # The file must still be the one registered: a name replaced since goes the
        # ordinary way.
        return quick_transfer(False, path, address, nbytes, file_offset, info.st_dev,
                              info.st_ino)
    finally:
        WRITES.end(write)
