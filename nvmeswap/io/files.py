"""Opening the file of one operation: O_DIRECT where the filesystem allows it.

Note [O_DIRECT tail]
O_DIRECT needs the file offset, the length and the memory address aligned to the
device's logical block. Operations of any size at any offset are split: the aligned
middle goes through O_DIRECT, the unaligned head and tail (less than one block each)
through a second, buffered descriptor of the same file. Linux keeps the two coherent
(direct I/O writes back and invalidates the cached range), no block is ever read,
patched and rewritten, and the file ends exactly at ``offset + nbytes``.
"""
import contextlib
import errno
import fcntl
import os
import stat

from .._transfers import preallocate
from ..errors import BufferedIOWarning, os_error, short_file_error, warn_once
from ..units import ALIGNMENT
from .regions import beyond_file_size_limit


class TargetFile:
    """The descriptors of one operation's file and what was true of it when opened."""

    __slots__ = (
        "alignment",
        "buffered_fd",
        "direct_fd",
        "identity",
        "name",
        "path",
        "size_before",
    )

    def __init__(self, name, path, direct_fd, buffered_fd, alignment, size_before, identity):
        self.name = name
        self.path = path
        self.direct_fd = direct_fd
        self.buffered_fd = buffered_fd
        self.alignment = alignment
        self.size_before = size_before
        self.identity = identity    # (device, inode): the same file under any name or fd

    def duplicate(self):
        """The same file with descriptors of its own (closed with the copy), and its size
        now as ``size_before``."""
        size = os.fstat(self.direct_fd).st_size
        direct_fd = os.dup(self.direct_fd)
        try:
            buffered_fd = os.dup(self.buffered_fd) if self.buffered_fd >= 0 else -1
        except BaseException:
            os.close(direct_fd)
            raise
        return TargetFile(self.name, self.path, direct_fd, buffered_fd, self.alignment, size,
                          self.identity)

    def descriptors(self):
        if self.buffered_fd < 0:
            return [self.direct_fd]
        return [self.direct_fd, self.buffered_fd]

    def preallocate(self, end):
        """Note [preallocation]: give a write past the end of the file its blocks up front.

        On ext4 and XFS a direct write that extends a file allocates blocks and moves the
        file size request by request; allocating the whole extension first makes a write
        into a fresh file nearly as fast as an overwrite (bench/studies/preallocation.py). A full
        disk (or a quota, or the file-size limit) is then found before any byte is
        written: raised here, it becomes the write's error, reported where an I/O error
        would be (``wait()`` for an asynchronous write), and the write's end cuts the file
        back to its size, which gives its blocks back. A filesystem without fallocate(2)
        just writes as it would have.

        A failed write's growth is undone through the descriptor the write holds, never
        by path: a file renamed over or recreated meanwhile is someone else's.
        """
        if end <= self.size_before or not stat.S_ISREG(os.fstat(self.direct_fd).st_mode):
            return
        length = end - self.size_before
        try:
            preallocate(self.direct_fd, self.size_before, length)
        except OSError as error:    # any other errno: it writes as it would have
            if error.errno in NO_ROOM:
                raise os_error(error.errno, self.name, f"cannot allocate {length} bytes at "
                                                       f"offset {self.size_before}"
                                                       f"{NO_ROOM[error.errno]}") from None

    def past_size_limit(self, offset, nbytes):
        """The error of a write of ``nbytes`` at ``offset`` that would pass the file-size
        limit (`ulimit -f`), or None. Known before any I/O, and raised then: the kernel
        would cut an O_DIRECT request at the limit (to an unaligned length: EINVAL) and
        send SIGXFSZ, fatal to a program that restored that signal's default action."""
        limit = beyond_file_size_limit(offset + nbytes)
        if limit is None or not stat.S_ISREG(os.fstat(self.direct_fd).st_mode):
            return None
        return os_error(errno.EFBIG, self.name, f"write of {nbytes} bytes at offset {offset}; "
                                                f"beyond the file-size limit (`ulimit -f`, "
                                                f"RLIMIT_FSIZE) of {limit} bytes")

    def cut_back(self, floor, ceiling):
        """Undo a failed write's growth (Note [shared growth]): cut the file to ``floor``
        if it is longer, and no longer than ``ceiling`` (beyond, something else grew it)."""
        if self.direct_fd >= 0:
            _cut_back(self.direct_fd, floor, ceiling)

    def close(self, keep_for_undo=False):
        """Close our descriptors (idempotent); the workers hold their own copies. With
        ``keep_for_undo``, a write keeps one until it ends, for ``cut_back``."""
        if self.buffered_fd >= 0:
            os.close(self.buffered_fd)
            self.buffered_fd = -1
        if self.direct_fd >= 0 and not keep_for_undo:
            os.close(self.direct_fd)
            self.direct_fd = -1


def cut_back_path(path, identity, floor, ceiling):
    """``TargetFile.cut_back`` for the file at ``path``, if it is still ``identity``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) == identity:
            _cut_back(fd, floor, ceiling)
    finally:
        os.close(fd)


def _cut_back(fd, floor, ceiling):
    try:
        if floor < os.fstat(fd).st_size <= ceiling:
            os.ftruncate(fd, floor)
    except OSError:
        pass    # the growth stays: the failure reported is the write's own


#: The errnos that say a write cannot have its space, and what to change.
NO_ROOM = {
    errno.ENOSPC: "",
    errno.EDQUOT: "; the disk quota is used up",
    errno.EFBIG: "; beyond the file-size limit (`ulimit -f`, RLIMIT_FSIZE) or the "
                 "filesystem's largest file",
}


def open_target(target, *, for_write, offset, nbytes, o_direct, written_end=None):
    """Open ``target`` (a path or an int fd) for one operation.

    ``o_direct``: True requires O_DIRECT, False never uses it, None tries it and falls
    back to buffered I/O with one warning per filesystem. A read that would run past
    the end of the file is refused here, before anything is submitted; past the end the
    file will have once the writes in flight have landed, if ``written_end(identity)``
    says where that is (a read started after them follows them, Note [ordering]).
    """
    if isinstance(target, bool) or not isinstance(target, (int, str, bytes, os.PathLike)):
        raise TypeError("expected a file name or an int file descriptor, "
                        f"got {type(target).__name__}")
    if isinstance(target, int):
        name, path = _reopen_path(target, for_write)
    else:
        name = path = os.fsdecode(target)
    # O_NONBLOCK: opening a FIFO must not wait for a peer; _checked_size refuses it.
    flags = (os.O_WRONLY | os.O_CREAT if for_write else os.O_RDONLY) | os.O_CLOEXEC \
        | os.O_NONBLOCK
    if isinstance(target, int):
        flags &= ~os.O_CREAT
    direct_fd, alignment = _open_direct(path, name, flags, o_direct)
    buffered_fd = -1
    try:
        size, identity = _checked_size(direct_fd, name)
        if for_write and offset + nbytes > size and stat.S_ISBLK(os.fstat(direct_fd).st_mode):
            raise os_error(errno.ENOSPC, name, f"write of {nbytes} bytes at offset {offset} "
                                               f"past the device's end ({size} bytes)")
        if not for_write and offset + nbytes > size and (
                written_end is None or offset + nbytes > written_end(identity)):
            raise short_file_error(
                name, f"cannot read {nbytes} bytes at offset {offset}: "
                      f"the file is {size} bytes long")
        if alignment > 1 and (offset % alignment or (offset + nbytes) % alignment):
            try:
                buffered_fd = os.open(path, flags & ~os.O_CREAT & ~os.O_NONBLOCK)
            except OSError as error:     # named as the caller named it, not by /proc
                raise os_error(error.errno, name) from None
        os.set_blocking(direct_fd, True)    # a regular file or block device from here on
    except BaseException:
        os.close(direct_fd)
        raise
    return TargetFile(name, path, direct_fd, buffered_fd, alignment, size, identity)


def _reopen_path(fd, for_write):
    """A caller's fd is reopened through /proc so that it keeps its flags and stays open."""
    if fd < 0:
        raise os_error(errno.EBADF, f"<fd {fd}>", "not an open file descriptor")
    try:
        access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as error:
        raise os_error(error.errno, f"<fd {fd}>", "not an open file descriptor") from None
    if for_write and access == os.O_RDONLY:
        raise os_error(errno.EBADF, name, f"file descriptor {fd} is open read-only")
    if not for_write and access == os.O_WRONLY:
        raise os_error(errno.EBADF, name, f"file descriptor {fd} is open write-only")
    return name, f"/proc/self/fd/{fd}"


def _open_direct(path, name, flags, o_direct):
    if o_direct is False:
        return _open(path, name, flags), 1
    if o_direct:
        return _open_required_direct(path, name, flags), ALIGNMENT
    try:
        return _open(path, name, flags | os.O_DIRECT), ALIGNMENT
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
    fd = _open(path, name, flags)
    info = os.fstat(fd)
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISBLK(info.st_mode)):
        return fd, 1    # not a filesystem's refusal: _checked_size says what is wrong
    warn_once(("buffered", info.st_dev), f"{name}: the filesystem refuses O_DIRECT; using "
              "buffered I/O (pass o_direct=True to make this an error)", BufferedIOWarning)
    return fd, 1


def _open_required_direct(path, name, flags):
    """``o_direct=True``: the file opened with O_DIRECT, or an error saying the filesystem
    refuses it; a file this call made for it is not left behind (Linux makes the file
    before the filesystem refuses O_DIRECT)."""
    try:
        return _open(path, name, (flags & ~os.O_CREAT) | os.O_DIRECT)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    except OSError as error:
        raise _refused_direct(error, name) from None
    try:
        return _open(path, name, flags | os.O_EXCL | os.O_DIRECT)
    except FileExistsError:         # made meanwhile by someone else: theirs to keep
        return _open(path, name, (flags & ~os.O_CREAT) | os.O_DIRECT)
    except OSError as error:
        if error.errno == errno.EINVAL:
            with contextlib.suppress(OSError):
                os.unlink(path)     # ours: O_EXCL made it
        raise _refused_direct(error, name) from None


def _refused_direct(error, name):
    if error.errno != errno.EINVAL:
        return error
    return os_error(errno.EINVAL, name, "the filesystem refuses O_DIRECT (o_direct=True; "
                                        "o_direct=None falls back to buffered I/O)")


def _open(path, name, flags):
    try:
        return os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno == errno.ENXIO:      # a FIFO without a reader, a socket
            try:
                mode = os.stat(path).st_mode
            except OSError:
                mode = 0
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                raise _not_a_file(mode, name) from None
        raise os_error(error.errno, name) from None


def _checked_size(fd, name):
    """The file's size and identity; anything but a regular file or block device is refused."""
    info = os.fstat(fd)
    identity = (info.st_dev, info.st_ino)
    if stat.S_ISREG(info.st_mode):
        return info.st_size, identity
    if stat.S_ISBLK(info.st_mode):
        return os.lseek(fd, 0, os.SEEK_END), identity
    if stat.S_ISDIR(info.st_mode):
        raise os_error(errno.EISDIR, name)
    raise _not_a_file(info.st_mode, name)


def _not_a_file(mode, name):
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) \
        else "a character device" if stat.S_ISCHR(mode) else "not a regular file"
    return os_error(errno.EINVAL, name, f"{kind}; nvmeswap reads and writes regular files "
                                        "and block devices")
