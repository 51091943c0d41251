"""The quick roads (Note [roads]): small aligned operations that skip most of the books.

Note [quick synchronous operations]
A synchronous read or write of one small aligned request spends most of its time outside
the device: with the file opened, the operation booked, placed, checked for order and
completed in Python, a 4 KiB read took ~60 us beyond its ~100 us on the device. When
nothing of the handle is in flight there is nothing to order it after, and an aligned
buffer needs no staging: one call into ``_transfers.quick_transfer`` opens the file with
O_DIRECT, moves the bytes straight between the buffer (a CPU tensor, an array) and the
file without the GIL, and closes it. Whatever that call cannot settle (a file to create,
grow or refuse, a short read, a failed transfer) runs the ordinary way, which says why;
both directions are safe to repeat, a failed write included, as it never grows the
file. What the books did still holds: ``close()`` waits for a quick operation as for
any inline one, and a quick write is one of the process's writes in flight (Note [shared
growth]), so that a failed write of the same file on another handle does not cut it away.

Note [quick asynchronous reads]
Many small async reads into locked buffers (an offloading loop over small tensors) go
to the caller queue (Note [caller queue] in io/workforce.py) one request each. Taken the
ordinary way - opened, placed, checked for order, handed through the workforce - each
cost the caller several times what the kernel needs to start it, more than DeepSpeed's
threads spend per read. One that the caller queue takes as it is (an aligned read of a
regular file long enough for it, into a locked region, up to the inline limit) takes its
file's descriptor (Note [shared read descriptors]) and is booked as the ordinary road would
have booked it (with the thread's other reads of that file: Note [quick read runs]), so
that everything after its submission (completion, ordering of later operations, failures,
``close()``) is the same. Anything else runs the ordinary way.

Note [quick read runs]
Even taken as it is, each read was an operation of its own in the books: made, booked,
checked for order, completed and collected one by one, ~11 us of the caller's time for
a 4 KiB read that the caller queue starts in ~3. So a thread's quick reads of one file
join one growing operation, its run, while the thread has not waited: a read that can
join (its file still the run's, checked with one stat(2); no write of that file in
flight, so there is nothing to follow; room in the queue) is posted and counted by the
run in one call (``_transfers.post_to_run``: no signal handler can come between). The
run is booked once, by its first read, as that read alone would have been; it spans its
reads' bytes, so a later write of the file follows all of them (Note [ordering]), and
``wait()`` counts each read as one operation and raises the first failure, naming its
file and offset, as for a batch (Note [batches]). A run takes no more reads once its
thread's ``wait()`` has taken it or all of its reads have ended; the next read starts a
new run.

Note [shared read descriptors]
Opening a file for one 4 KiB read (open, fstat, fcntl, and close at its end) cost a
quarter of the read's time on the calling thread. Quick reads of one path in flight at
once share one O_DIRECT descriptor: a read of a path that has one open takes it after a
single stat(2) shows that the path still names that file (the same device and inode,
long enough for the read), and the last read to end closes it. A name replaced or
renamed away between two reads is opened afresh, as a read started after that expects;
only a permission taken away meanwhile is not seen (the descriptor was opened before),
as it would not be by a read already in flight.
"""
import os
import threading

from .. import _transfers
from ..units import ALIGNMENT
from .buffers import IoBuffer, io_buffer
from .files import TargetFile
from .operation import MAX_FILE_END, Operation, writes
from .regions import beyond_file_size_limit


def candidate(buffer, target, file_offset, *, writable):
    """``(buffer, encoded path)`` if the operation could take a quick road: a file named
    by path, host memory, address, offset and length on O_DIRECT blocks; else None."""
    if not (isinstance(target, (str, bytes, os.PathLike)) and type(file_offset) is int
            and file_offset >= 0 and file_offset % ALIGNMENT == 0):
        return None
    buf = io_buffer(buffer, writable=writable)  # what it refuses, the ordinary road refuses
    nbytes = buf.nbytes
    if (buf.device is not None or nbytes == 0 or nbytes % ALIGNMENT
            or buf.address % ALIGNMENT or file_offset > MAX_FILE_END - nbytes):
        return None
    # bytes(): a bytes subclass (numpy's bytes_) names the same file.
    path = bytes(os.fsencode(target))
    if b"\0" in path:
        return None     # C would read a shorter name: the ordinary road refuses it
    return buf, path


def quick_transfer(buf, path, file_offset, is_read):
    """Move the bytes in one call (Note [quick synchronous operations]); False if that
    did not settle it."""
    if is_read:
        return _transfers.quick_transfer(True, path, buf.address, buf.nbytes,
                                         file_offset) is not None
    if beyond_file_size_limit(file_offset + buf.nbytes) is not None:
        return False    # the kernel would send SIGXFSZ, in the file or not: the ordinary
        # road refuses it first
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return False
    with writes().in_place((info.st_dev, info.st_ino), file_offset + buf.nbytes, path):
        # The file must still be the one registered: a name replaced since goes the
        # ordinary way.
        return _transfers.quick_transfer(False, path, buf.address, buf.nbytes, file_offset,
                                         info.st_dev, info.st_ino) is not None


class QuickReadRun(Operation):
    """The reads of one thread and one file that the caller queue takes as they are
    (Note [quick asynchronous reads], Note [quick read runs]), as one operation. Its first
    read made it: ``buf`` inside the locked ``region``, its file the one ``shared``
    holds open. Chunk ``k`` is read ``k``: its start is its buffer's address less the
    first's (``region_offset_of`` then finds it in any region), ``file_offset`` and
    ``buffer`` span the file bytes of them all (what ordering needs), and the span's
    owner holds their buffers until the run ends. ``key``: (thread, path), where the
    books keep it while it may take more reads."""

    __slots__ = ("key",)

    def __init__(self, op_id, buf, region, target, file_offset, shared, key):
        name = target if type(target) is str else os.fsdecode(target)
        span = IoBuffer([buf], 0, buf.nbytes)
        super().__init__(op_id, True, span, SharedReadFile(name, shared), file_offset, False)
        self.region, self.region_offset = region, buf.address - region.address
        self.chunks = [(0, buf.nbytes)]
        self.key = key

    def memory_spans(self):
        first = self.region.address + self.region_offset
        return [(first + start, nbytes) for start, nbytes in self.chunks]

    def describe(self):
        if self.count == 1:
            return super().describe()
        return (f"{self.count} reads ({sum(n for _, n in self.chunks)} bytes) between "
                f"offsets {self.file_offset} and {self.file_offset + self.buffer.nbytes} of "
                f"{self.file.name}")


def names_the_runs_file(run, path, end):
    """Whether ``path`` still names the file ``run`` reads, at least ``end`` bytes long:
    one stat(2) (Note [quick read runs])."""
    device, inode = run.file.identity
    return _transfers.still_names(path, device, inode, end)


class ReadDescriptors:
    """The O_DIRECT descriptors that quick reads in flight share, by path (Note [shared
    read descriptors]). Its own lock guards the table; no system call runs under it."""

    def __init__(self):
        self._by_path = {}
        self._lock = threading.Lock()

    def take(self, path, end):
        """A ``SharedDescriptor`` of ``path`` for one more read ending at ``end``; None if
        the path is not a regular file that long, or O_DIRECT is refused."""
        with self._lock:
            shared = self._by_path.get(path)
            if shared is not None:
                shared.users += 1       # held while it is checked
        if shared is not None:
            if _transfers.still_names(path, shared.identity[0], shared.identity[1], end):
                return shared
            self.release(shared)
        opened = _transfers.open_for_direct_read(path, end)
        if opened is None:
            return None
        fd, size, device, inode = opened
        shared = SharedDescriptor(self, path, fd, size, (device, inode))
        with self._lock:
            # A descriptor this one replaces closes with its last read.
            self._by_path[path] = shared
        return shared

    def release(self, shared):
        with self._lock:
            shared.users -= 1
            if shared.users:
                return
            if self._by_path.get(shared.path) is shared:
                del self._by_path[shared.path]
        os.close(shared.fd)


class SharedDescriptor:
    """One O_DIRECT read descriptor of a file, and how many reads in flight use it."""

    __slots__ = ("fd", "identity", "owner", "path", "size", "users")

    def __init__(self, owner, path, fd, size, identity):
        self.owner, self.path, self.fd, self.size, self.identity = owner, path, fd, size, identity
        self.users = 1


class SharedReadFile(TargetFile):
    """A quick read's file: its descriptor is shared, given back (not closed) at the end."""

    __slots__ = ("_shared",)

    def __init__(self, name, shared):
        super().__init__(name, name, shared.fd, -1, ALIGNMENT, shared.size, shared.identity)
        self._shared = shared

    def close(self, keep_for_undo=False):
        shared, self._shared = self._shared, None
        self.direct_fd = -1
        if shared is not None:
            shared.owner.release(shared)
