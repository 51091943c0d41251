"""Checkpoint files appear whole or not at all: written under a temporary name, made
durable, then renamed over the old one.

Note [crash-consistent checkpoints]: a checkpoint is written to
``<name>.nvmeswap-tmp-<pid>-<n>`` in the same folder, every byte of it written and
``fsync``-ed, then renamed over ``<name>`` (``os.replace``, atomic within a filesystem)
and the folder ``fsync``-ed so the rename itself survives a power cut. A save killed at
any instant leaves either the old file or the new one under the name, never a mixture,
and a file under the name is never shorter or other than what was written. The
temporary file of a killed save is left behind; the next save of the same name removes
those whose process is gone.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
from collections.abc import Callable

from ..errors import os_error
from ..io.files import NO_ROOM

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


def temporary_name(path: str) -> str:
    """Where a save of ``path`` writes before the rename: ``<path>.nvmeswap-tmp-<pid>-<n>``,
    a name of its own (two threads saving one path at once must not share one: each
    would rename the other's half-written file)."""
    folder, prefix = _temporary_prefix(path)
    return os.path.join(folder, f"{prefix}{os.getpid()}-{next(_saves)}")


def remove_stale(path: str) -> None:
    """Remove the temporary files of earlier saves of ``path`` whose process is gone."""
    folder, prefix = _temporary_prefix(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for other in names:
        if not other.startswith(prefix):
            continue
        pid = other[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, other))


def _alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    """Check that ``path`` holds exactly ``size`` bytes and ``fsync`` it."""
    fd = os.open(path, os.O_WRONLY)
    try:
        written = os.fstat(fd).st_size
        if written != size:
            raise OSError(f"{path}: {written} bytes were written, {size} expected; "
                          "the checkpoint is not complete")
        os.fsync(fd)
    finally:
        os.close(fd)


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
