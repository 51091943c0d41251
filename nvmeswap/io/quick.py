"""Small synchronous operations settled in one call, without the scheduler's books.

Note [quick synchronous operations]
A synchronous read or write of one small aligned request spends most of its time outside
the device: with the file opened, the operation booked, placed, checked for order and
completed in Python, a 4 KiB read took ~60 us beyond its ~100 us on the device. When
nothing of the handle is in flight there is nothing to order it after, and an aligned
buffer needs no staging: one call into ``_transfers.quick_transfer`` opens the file with
O_DIRECT, moves the bytes straight between the buffer (a CPU tensor, an array) and the
file without the GIL, and closes it. Whatever that call cannot settle (a file to create, grow or refuse, a short
read, a failed transfer) runs the ordinary way, which says why; both directions are safe
to repeat, a failed write included, as it never grows the file. What the books did still
holds: ``close()`` waits for a quick operation as for any inline one, and a quick write
is one of the process's writes in flight (Note [shared growth]), so that a failed write
of the same file on another handle does not cut it away.

Note [quick asynchronous reads]
Many small async reads into locked buffers (an offloading loop over small tensors) go
to the caller queue (Note [caller queue] in io/workforce.py) one request each. Taken the
ordinary way - opened, placed, checked for order, handed through the workforce - each
cost the caller several times what the kernel needs to start it, more than DeepSpeed's
threads spend per read. One that the caller queue takes as it is (an aligned read of a
regular file long enough for it, into a locked region, up to the inline limit) is opened
in one call into ``_transfers.open_for_direct_read`` and booked as the ordinary road would
have booked it, so that everything after its submission (completion, ordering of later
operations, failures, ``close()``) is the same. Anything else runs the ordinary way.
"""
import os

from .._transfers import open_for_direct_read, quick_transfer
from .buffers import io_buffer
from .files import ALIGNMENT, TargetFile
from .operation import MAX_FILE_END, WRITES, Operation


def quick_read(op_id, buffer, target, file_offset, placement):
    """Note [quick asynchronous reads]: the operation of a small read the caller queue can
    take as it is, opened and placed; None if it must go the ordinary way."""
    if not _aligned_name_and_offset(target, file_offset):
        return None
    buf = io_buffer(buffer, writable=True)  # what it refuses, the ordinary road refuses
    nbytes = buf.nbytes
    if (buf.device is not None or not 0 < nbytes <= placement.host_inline_limit
            or nbytes % ALIGNMENT or file_offset > MAX_FILE_END - nbytes):
        return None
    region = placement.locked.containing(buf.address, nbytes)
    path = _encoded(target)
    if region is None or buf.address % ALIGNMENT or b"\0" in path:
        return None
    opened = open_for_direct_read(path, file_offset + nbytes)
    if opened is None:
        return None
    fd, size, device, inode = opened
    name = target if type(target) is str else os.fsdecode(target)
    op = Operation(op_id, True, buf, TargetFile(name, name, fd, -1, ALIGNMENT, size,
                                                (device, inode)), file_offset, False)
    op.region, op.region_offset = region, buf.address - region.address
    op.chunks = [(0, nbytes)]
    op.by_caller = True
    return op


def quick(buffer, target, file_offset, *, is_read, limit):
    """Move the bytes of a small synchronous operation in one call; False if it did not."""
    if not _aligned_name_and_offset(target, file_offset):
        return False
    buf = io_buffer(buffer, writable=is_read)   # what it refuses, the ordinary road refuses
    address, nbytes = buf.address, buf.nbytes
    if (buf.device is not None or not 0 < nbytes <= limit or nbytes % ALIGNMENT
            or address % ALIGNMENT or file_offset > MAX_FILE_END - nbytes):
        return False
    path = _encoded(target)
    if b"\0" in path:
        return False    # C would read a shorter name: the ordinary road refuses it
    if is_read:
        return quick_transfer(True, path, address, nbytes, file_offset) is not None
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return False
    with WRITES.in_place((info.st_dev, info.st_ino)):
        # The file must still be the one registered: a name replaced since goes the
        # ordinary way.
        return quick_transfer(False, path, address, nbytes, file_offset, info.st_dev,
                              info.st_ino) is not None


def _aligned_name_and_offset(target, file_offset):
    return (isinstance(target, (str, bytes, os.PathLike)) and type(file_offset) is int
            and file_offset >= 0 and file_offset % ALIGNMENT == 0)


def _encoded(target):
    # bytes(): a bytes subclass (numpy's bytes_) names the same file.
    return bytes(os.fsencode(target))
