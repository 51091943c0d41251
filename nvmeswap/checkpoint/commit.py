"""Checkpoint files appear whole or not at all: written under a temporary name, made
durable, then renamed over the old one.

Note [crash-consistent checkpoints]: a checkpoint is written to
``<name>.nvmeswap-tmp-<tag>-<pid>-<n>`` in the same folder, every byte of it written and
``fsync``-ed, then renamed over ``<name>`` (``os.replace``, atomic within a filesystem)
and the folder ``fsync``-ed so the rename itself survives a power cut. A save killed at
any instant leaves either the old file or the new one under the name, never a mixture,
and a file under the name is never shorter than what was to be written, nor left with
a range never written (below). The
temporary file of a killed save is left behind; the next save of the same name removes
those whose process is gone.

Note [never written]: a checkpoint's file is made at its full size with its blocks
allocated (``create``), so its size cannot tell a write that stopped short. The
filesystem can: a block allocated but never written is an "unwritten" extent (that is
how fallocate leaves it; reads of it give zeros), which the FIEMAP ioctl reports. Once
a file is made durable, a range of it still unwritten fails the save, naming the file
and the range. A filesystem without FIEMAP (tmpfs) or without fallocate (its gaps are
holes, which may also be zeros it chose not to store) cannot tell, and is not asked.

Note [files named by their process]: a temporary file (and a stripe, Note [striped
checkpoints]) carries the process that writes it, so that a later save can tell one
left by a killed save from one being written: ``<tag>-<pid>``. A pid means something
only in its own pid namespace of its own boot of a machine, and a checkpoint folder may
be shared by several machines (NFS, Lustre) or containers: a save on another node could
take a live writer's file for a dead one's (its pid unknown here) and delete it, or take
it for its own (the same pid). The tag, eight hex digits of a hash of the kernel's boot
id and the pid namespace, names where the pid is meaningful; a save removes only files
of its own tag whose process is gone. Those of other tags are left to saves there.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import itertools
import os
import re
import socket
import struct
from collections.abc import Callable, Iterator

from ..errors import os_error
from ..io.files import NO_ROOM
from ..io.regions import beyond_file_size_limit

TEMPORARY = ".nvmeswap-tmp-"
_saves = itertools.count()


#: The longest name of a checkpoint whose temporary files are named after it: what is
#: left of a file name's 255 bytes once the suffix (up to some 40 bytes) is added.
LONGEST_NAME = 200


def named_after(name: str) -> str:
    """What the files made for the checkpoint ``name`` (temporary files, stripes) start
    with: ``name``, or where it is longer than LONGEST_NAME a hash of it (a suffix would
    make a file name too long for the filesystem)."""
    if len(os.fsencode(name)) > LONGEST_NAME:
        return hashlib.blake2b(os.fsencode(name), digest_size=16).hexdigest()
    return name


def _temporary_prefix(path: str) -> tuple[str, str]:
    """``(folder, prefix)`` of the temporary files of saves of ``path``."""
    folder, name = os.path.split(os.path.abspath(path))
    return folder, named_after(name) + TEMPORARY


@functools.cache
def _namespace_tag() -> str:
    """Eight hex digits naming this boot of this machine and this process's pid
    namespace (Note [files named by their process])."""
    where = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            where.append(boot.read().strip())
        where.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:         # no /proc: the host's name is the best left
        where = [socket.gethostname()]
    return hashlib.blake2b(" ".join(where).encode(), digest_size=4).hexdigest()


def writer_name() -> str:
    """``<tag>-<pid>``: this process, as the names of the files it writes carry it."""
    return f"{_namespace_tag()}-{os.getpid()}"


#: A writer's name inside a file name (Note [files named by their process]).
WRITER = r"([0-9a-f]{8})-([0-9]+)"


def writer_gone(tag: str, pid: str) -> bool:
    """Whether the writer ``<tag>-<pid>`` of a file is a process of this namespace that is
    gone (not this one): only then may its file be taken for a killed save's."""
    if tag != _namespace_tag() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):     # not a pid of this system: not a writer
        return False
    return False


def names_by_writer(folder: str, before: str, after: str) -> Iterator[tuple[str, str, str]]:
    """``(name, tag, pid)`` for each name in ``folder`` made of the patterns ``before``, a
    writer's name (WRITER) and ``after``; none where the folder cannot be listed."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    named = re.compile(before + WRITER + after)
    for name in names:
        found = named.fullmatch(name)
        if found is not None:
            yield name, *found.groups()


def temporary_name(path: str) -> str:
    """Where a save of ``path`` writes before the rename:
    ``<path>.nvmeswap-tmp-<tag>-<pid>-<n>``, a name of its own (two threads saving one
    path at once must not share one: each would rename the other's half-written file)."""
    folder, prefix = _temporary_prefix(path)
    return os.path.join(folder, f"{prefix}{writer_name()}-{next(_saves)}")


def stale_temporaries(path: str) -> list[tuple[str, str]]:
    """``(file, writer)`` of each temporary file of an earlier save of ``path`` whose
    process is gone; ``writer`` is its ``<tag>-<pid>``."""
    folder, prefix = _temporary_prefix(path)
    return [(os.path.join(folder, other), "-".join(writer))
            for other, *writer in names_by_writer(folder, re.escape(prefix), "-[0-9]+")
            if writer_gone(*writer)]


def remove_stale(path: str) -> None:
    """Remove the temporary files of earlier saves of ``path`` whose process is gone."""
    for temporary, _ in stale_temporaries(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def start(path: str, size: int = 0) -> str:
    """Make a fresh temporary file for ``path`` with ``size`` bytes allocated and return
    its name; errors name the folder or file."""
    remove_stale(path)
    temporary = temporary_name(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    create(temporary, size)
    return temporary


def create(path: str, size: int) -> None:
    """Make the file ``path``, refusing one that exists, with ``size`` bytes allocated:
    the direct writes then land in blocks the file already has, and a full disk or a
    file-size limit is reported before any write. (A filesystem without fallocate
    writes as it would have.) On a failure nothing is left."""
    limit = beyond_file_size_limit(size)
    if limit is not None:       # refused before SIGXFSZ could come
        raise os_error(errno.EFBIG, path, f"cannot allocate {size} bytes"
                                          f"{NO_ROOM[errno.EFBIG]}, {limit} bytes")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        os.unlink(path)
        raise os_error(error.errno, path, f"cannot allocate {size} bytes"
                                          f"{NO_ROOM.get(error.errno, '')}") from None
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def write_whole(path: str, size: int, write: Callable[[str], None]) -> None:
    """Write ``path`` whole or not at all: ``write(temporary)`` fills a fresh temporary
    file with ``size`` bytes allocated, then made durable and renamed over ``path``."""
    temporary = start(path, size)
    try:
        write(temporary)
        finish(temporary, path, size)
    except BaseException:
        abandon(temporary)
        raise


def make_durable(path: str, size: int) -> None:
    """``fsync`` ``path``, then check that it holds exactly ``size`` bytes, every one
    written (Note [never written])."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.fsync(fd)
        written = os.fstat(fd).st_size
        if written != size:
            raise os_error(errno.EIO, path, f"{written} bytes were written, {size} "
                                            "expected; the checkpoint is not complete")
        gap = never_written(fd, size)
        if gap is not None:
            raise os_error(errno.EIO, path, f"bytes {gap[0]} to {gap[1]} were never "
                                            "written; the checkpoint is not complete")
    finally:
        os.close(fd)


_FIEMAP = 0xC020660B                                # _IOWR('f', 11, struct fiemap)
_FIEMAP_HEADER = struct.Struct("=QQIIII")           # start, length, flags, mapped, count
_FIEMAP_EXTENT = struct.Struct("=QQQ16xI12x")       # logical, physical, length, flags
_EXTENTS_ASKED = 64
_EXTENT_LAST, _EXTENT_UNWRITTEN = 0x1, 0x800


def never_written(fd: int, size: int) -> tuple[int, int] | None:
    """``(start, end)`` of the first range of the file's first ``size`` bytes that is
    allocated but was never written, or None (also where the filesystem cannot tell:
    Note [never written])."""
    start = 0
    while start < size:
        asked = bytearray(_FIEMAP_HEADER.pack(start, size - start, 0, 0, _EXTENTS_ASKED, 0)
                          + bytes(_EXTENTS_ASKED * _FIEMAP_EXTENT.size))
        try:
            fcntl.ioctl(fd, _FIEMAP, asked)
        except OSError:
            return None
        mapped = _FIEMAP_HEADER.unpack_from(asked)[3]
        if not mapped:
            return None
        for index in range(mapped):
            logical, _, length, flags = _FIEMAP_EXTENT.unpack_from(
                asked, _FIEMAP_HEADER.size + index * _FIEMAP_EXTENT.size)
            if flags & _EXTENT_UNWRITTEN and logical < size:
                return max(logical, start), min(logical + length, size)
            if flags & _EXTENT_LAST:
                return None
        start = logical + length
    return None


def finish(temporary: str, path: str, size: int) -> None:
    """Make ``temporary`` durable at exactly ``size`` bytes, rename it to ``path`` and make
    the rename durable (Note [crash-consistent checkpoints])."""
    make_durable(temporary, size)
    os.replace(temporary, path)
    sync_folder(os.path.dirname(os.path.abspath(path)))


def sync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def abandon(temporary: str) -> None:
    """Remove the temporary file of a save that failed."""
    with contextlib.suppress(OSError):
        os.unlink(temporary)
