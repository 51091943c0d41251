"""One operation: its arguments checked and its file opened, its chunks, and its outcome."""
import errno
import operator
import os
import resource
import threading

from ..errors import error_from_code, os_error, short_file_error
from .buffers import IoBuffer, io_buffer
from .files import NO_ROOM, cut_back_path, open_target
from .process_state import shared
from .regions import beyond_file_size_limit

MAX_FILE_END = (1 << 63) - 1


class Operation:
    """One call in flight: where its bytes go, its chunks still out, and its first error."""

    __slots__ = (
        "buffer",
        "chunks",
        "copier",
        "count",
        "done",
        "error",
        "failures",
        "file",
        "file_offset",
        "is_async",
        "is_read",
        "kept_end",
        "op_id",
        "owns_region",
        "region",
        "region_offset",
        "remaining",
        "road",
        "staged",
        "started",
        "starter",
        "validate",
        "waits_for",
    )

    def __init__(self, op_id, is_read, buffer, file, file_offset, validate):
        self.op_id = op_id
        self.is_read = is_read
        self.buffer = buffer
        self.file = file
        self.file_offset = file_offset
        self.validate = validate
        self.region = None
        self.region_offset = 0
        self.staged = None      # its StagedPieces when it goes through staging memory
        self.owns_region = False    # the region was made for this operation alone
        self.copier = None      # moves bytes between the buffer and a staging region
        self.chunks = []        # (start, length) in the buffer, set by the placement
        self.remaining = 0
        self.error = None
        self.done = False
        self.started = False    # the scheduler's books hold it: it completes from there
        self.kept_end = 0       # a failed batch: where its requests that succeeded end
        self.road = None            # Note [roads]: set when it is routed
        self.is_async = False
        self.starter = None         # the thread whose wait() counts it, if any
        self.waits_for = None       # earlier operations it must follow (Note [ordering])
        self.count = 1              # the operations wait() counts it as (Note [batches])
        self.failures = 0           # its requests that failed

    def is_done(self):
        return self.done

    def region_offset_of(self, index):
        """Where chunk ``index`` sits in the region the workers use."""
        if self.staged is not None:
            return self.staged.region_offset(index)
        return self.region_offset + self.chunks[index][0]

    def memory_spans(self):
        """``(address, nbytes)`` of the caller's host memory the operation moves."""
        return [(self.buffer.address, self.buffer.nbytes)] if self.buffer.device is None \
            else []

    def describe(self):
        verb = "read of" if self.is_read else "write of"
        return f"{verb} {self.buffer.nbytes} bytes at offset {self.file_offset} of {self.file.name}"

    def transfer_error(self, err, at_offset, requested, got):
        """The exception for a chunk that failed (``err``) or came back short."""
        return transfer_error(self.file.name, self.is_read, err, at_offset, requested, got)

    def copy_error(self, error):
        """A failed copy between the buffer and staging memory, as an error of the operation.

        (A new exception: the caught one's traceback holds frames that hold the operation.)
        """
        return RuntimeError(f"copying the {self.describe()} through host memory failed: "
                            f"{type(error).__name__}: {error}")


def transfer_error(name, is_read, err, at_offset, requested, got):
    """The exception for a transfer of ``name`` that failed (``err``) or came back short
    (``got`` of the ``requested`` bytes at ``at_offset``), with what to change where the
    cause is a limit: descriptors, the disk's room, the file-size limit."""
    where = f"{requested} bytes at offset {at_offset}"
    if err in (errno.EMFILE, errno.ETOOMANYREFS):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        where += (f"; descriptors in flight to the workers ran out under RLIMIT_NOFILE "
                  f"{soft}: raise it with `ulimit -n`")
    if err in (0, errno.EINVAL) and not is_read \
            and beyond_file_size_limit(at_offset + requested) is not None:
        err = errno.EFBIG   # the kernel writes up to the limit, then refuses (or cuts an
        # O_DIRECT request to an unaligned length: EINVAL); the limit was lowered since
    if err in NO_ROOM:
        where += NO_ROOM[err]
    if err:
        return error_from_code(err, name, f"{'read' if is_read else 'write'} of {where}")
    if is_read:
        return short_file_error(name, f"short read: got {got} of {where}; "
                                      "was the file truncated while it was read?")
    return os_error(errno.ENOSPC, name, f"short write: wrote {got} of {where}")


class ConcurrentWrites:
    """The writes in flight in this process, by file, whichever handle runs them.

    Note [shared growth]: a failed write cuts its file back to the size it had before,
    so that it cannot look complete and its blocks go back to the filesystem; but never
    below what another write put there. So the writes of one file that overlap in time
    (from their opening, before the file was grown, to their end), through any handle,
    one after another, are one group: its ``base`` is the file's size when the first
    began (which holds every write that ended before), ``kept_end`` the end of the
    furthest bytes its writes that succeeded put there (for a batch, its requests that
    succeeded: each is an operation to ``wait()``). A failed write's growth can only be
    undone once its group has ended: until then, another write of the group may still
    put bytes beyond it (a write that also fails puts none that count). The last write of
    the group to end then cuts the file back to ``max(base, kept_end)``, if it is no
    longer than the group's writes could have made it (else something else grew it
    since). A preallocation that failed half way moves the file's size too: it is a
    failed write's growth like any other.
    """

    def __init__(self):
        self._by_file = {}      # file identity -> _Group of the writes in flight
        self._lock = threading.Lock()

    def start(self, op):
        if not op.is_read:
            self._join(op.file.identity, op, op.file_offset + op.buffer.nbytes,
                       op.file.direct_fd)
            # Measured again once registered: a write of this file that ended between
            # our opening and now has grown it (where preallocation starts).
            op.file.size_before = os.fstat(op.file.direct_fd).st_size

    def end(self, op, failed, kept_end):
        """Forget the write ``op``, which ``failed`` or not, and whose bytes up to
        ``kept_end`` are to stay; ``(floor, ceiling)`` if it was the last of its group to
        end and the file is to be cut back (``TargetFile.cut_back``), else None."""
        if op.is_read:
            return None
        return self._leave(op.file.identity, op, failed, kept_end)

    def in_place(self, identity, end, path):
        """A write inside the file ``identity`` names (``path``), ending at ``end``, while
        the ``with`` block runs: it never grows the file, but a failed write of a group it
        joins must not cut it away (Note [quick synchronous operations] in io/quick.py)."""
        return _InPlaceWrite(self, identity, end, path)

    def _join(self, identity, write, end, fd):
        with self._lock:
            group = self._by_file.get(identity)
            if group is None:
                group = self._by_file[identity] = _Group(os.fstat(fd).st_size)
            group.members.add(write)
            group.ceiling = max(group.ceiling, end)

    def _leave(self, identity, write, failed, kept_end):
        with self._lock:
            group = self._by_file.get(identity)
            if group is None or write not in group.members:
                return None
            group.members.discard(write)
            group.failed = group.failed or failed
            group.kept_end = max(group.kept_end, kept_end)
            if group.members:
                return None
            del self._by_file[identity]
            return (max(group.base, group.kept_end), group.ceiling) if group.failed else None


class _Group:
    """Writes of one file that overlap in time, one after another (Note [shared growth])."""

    __slots__ = ("base", "ceiling", "failed", "kept_end", "members")

    def __init__(self, base):
        self.base = base
        self.ceiling = base     # the furthest its writes could have grown the file
        self.kept_end = 0
        self.failed = False
        self.members = set()


class _InPlaceWrite:
    """``ConcurrentWrites.in_place``: a class, not a generator: it runs on every quick write."""

    __slots__ = ("_end", "_identity", "_path", "_writes")

    def __init__(self, writes, identity, end, path):
        self._writes = writes
        self._identity = identity
        self._end = end
        self._path = path

    def __enter__(self):
        # Alone, it needs no group: a write that starts later measures a base that holds
        # it (it never grows the file). In one, it keeps its bytes from the cut.
        with self._writes._lock:
            group = self._writes._by_file.get(self._identity)
            if group is not None:
                group.members.add(self)
        return self

    def __exit__(self, *exc_info):
        cut = self._writes._leave(self._identity, self, False, self._end)
        if cut is not None:     # the last of a group with a failed write
            cut_back_path(self._path, self._identity, *cut)
        return False


def writes():
    """The process's writes in flight (Note [process state]): DeepSpeed's swappers read
    and write the same files with two handles."""
    return shared(ConcurrentWrites)


def open_operation(op_id, buffer, target, file_offset, *, is_read, validate, o_direct,
                   preallocate_min, written_end=None):
    """Check the arguments and open the file: everything that can fail before any I/O.
    A write that grows the file by ``preallocate_min`` or more preallocates
    (Note [preallocation])."""
    buf = buffer if type(buffer) is IoBuffer else io_buffer(buffer, writable=is_read)
    file_offset = checked_int("file_offset", file_offset, 0, MAX_FILE_END - buf.nbytes)
    if buf.nbytes == 0:
        raise ValueError(f"nothing to transfer: the buffer for {target!r} is empty")
    file = open_target(target, for_write=not is_read, offset=file_offset, nbytes=buf.nbytes,
                       o_direct=o_direct, written_end=written_end)
    op = Operation(op_id, is_read, buf, file, file_offset, validate)
    writes().start(op)    # before the file grows (Note [shared growth])
    past_limit = None if is_read else file.past_size_limit(file_offset, buf.nbytes)
    if past_limit is not None:      # reported where its I/O's error would be, none done
        op.error = past_limit
    elif not is_read and buf.nbytes >= preallocate_min:
        try:
            file.preallocate(file_offset + buf.nbytes)
        except OSError as error:
            if error.errno not in NO_ROOM:
                _end_failed_write(op)
                raise
            # The write's failure, reported where its I/O would be; without the traceback,
            # whose frames hold the operation (Note [no reference cycle]).
            error.__context__ = None
            op.error = error.with_traceback(None)
        except BaseException:
            _end_failed_write(op)
            raise
    return op


def _end_failed_write(op):
    """A write that failed before any I/O: its preallocation may have grown the file."""
    cut = writes().end(op, True, 0)
    if cut is not None:
        op.file.cut_back(*cut)
    op.file.close()


def checked_int(name, value, low, high):
    """``value`` as an int in ``[low, high]`` (no upper bound if ``high`` is None)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def checked_bool(name, value):
    """``value`` as a bool: True, False, 1, 0 or a numpy bool (what pybind11 takes)."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)
