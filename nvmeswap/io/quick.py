"""Small synchronous operations settled in one call, without the scheduler's books.

Note [quick synchronous operations]
A synchronous read or write of one small aligned request spends most of its time outside
the device: with the file opened, the operation booked, placed, checked for order and
completed in Python, a 4 KiB read took ~60 us beyond its ~100 us on the device. When
nothing of the handle is in flight there is nothing to order it after, and an aligned
buffer needs no staging: one call into ``_engine.quick_transfer`` opens the file with
O_DIRECT, moves the bytes straight between the buffer (a CPU tensor, an array) and the
file without the GIL, and closes it. Whatever that call cannot settle (a file to create, grow or refuse, a short
read, a failed transfer) runs the ordinary way, which says why; both directions are safe
to repeat, a failed write included, as it never grows the file. What the books did still
holds: ``close()`` waits for a quick operation as for any inline one, and a quick write
is one of the process's writes in flight (Note [shared growth]), so that a failed write
of the same file on another handle does not cut it away.
"""
import os

from .._engine import quick_transfer
from .buffers import io_buffer
from .files import ALIGNMENT
from .operation import MAX_FILE_END, WRITES


def quick(buffer, target, file_offset, *, is_read, limit):
    """Move the bytes of a small synchronous operation in one call; False if it did not."""
    if (not isinstance(target, (str, bytes, os.PathLike)) or type(file_offset) is not int
            or file_offset < 0 or file_offset % ALIGNMENT):
        return False
    buf = io_buffer(buffer, writable=is_read)   # what it refuses, the ordinary road refuses
    address, nbytes = buf.address, buf.nbytes
    if (buf.device is not None or not 0 < nbytes <= limit or nbytes % ALIGNMENT
            or address % ALIGNMENT or file_offset > MAX_FILE_END - nbytes):
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
    with WRITES.in_place((info.st_dev, info.st_ino)):
        # The file must still be the one registered: a name replaced since goes the
        # ordinary way.
        return quick_transfer(False, path, address, nbytes, file_offset, info.st_dev,
                              info.st_ino)
