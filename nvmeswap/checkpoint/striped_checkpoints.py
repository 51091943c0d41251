"""Striped checkpoints on disk: the layout file that names the stripes, written as the
commit of a striped save and read back by the loads (Note [striped checkpoints]); the
stripes themselves move through a StripedHandle or the process's own queue."""
from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import short_file_error
from ..io import process_state
from ..io.interrupts import deferred_interrupts
from . import commit
from .stripes import StripedHandle, StripeSet, stripe_file_sizes, unlink_quietly

# Note [striped checkpoints]: a striped checkpoint at ``path`` (in the first stripe folder)
# is a small JSON file there, the layout: the folders, the stripe size, the logical size
# and the name of the striped data, ``<name>.<tag>-<pid>-<random>.stripe`` in every
# folder (Note [files named by their process] in commit.py). A
# save writes fresh stripe files under a new name, fsyncs each and each folder, then
# replaces the layout file as any checkpoint is replaced (Note [crash-consistent
# checkpoints]): that rename is the one commit point, so a save killed at any instant
# leaves the old layout naming the old stripes, which are deleted only after the commit.
# Stripes no layout names, left by killed saves, go at the next save of the same name.
# ``nvmeswap.load`` knows the layout file by its first bytes and reads the data from it.
# Two threads saving one path at once: the loser's stripes, which no layout names once
# the other commits, are this process's orphans and go at the next save too; what a
# save of this process is writing is never one (``_Commits.writing``), and reading the
# layout to keep and committing one are one step each (under ``_Commits.lock``): a save
# never takes the stripes of a layout committed meanwhile for orphans.
LAYOUT_KEY = "nvmeswap_stripes"


class _Commits:
    """The striped saves of this process in progress (a forked child starts with none,
    and a fresh lock: Note [process state])."""

    def __init__(self) -> None:
        self.writing: set[str] = set()      # the names of the stripes being written
        self.lock = threading.Lock()


def read_layout(path: str, fd: int | None = None) -> dict | None:
    """The layout at ``path`` (read from ``fd`` if given, a descriptor open on it), or
    None if ``path`` is not a striped checkpoint."""
    import json

    if fd is None:
        with open(path, "rb") as file:
            head = file.read(64 << 10)
    else:
        head = os.pread(fd, 64 << 10, 0)
    if not head.startswith(b'{"' + LAYOUT_KEY.encode()):
        return None
    try:
        layout = json.loads(head)
    except ValueError as error:
        raise ValueError(f"{path}: a damaged stripe layout ({error})") from None
    return layout


def write_committed(stripes: StripeSet | None, size: int, path: str, write: Any) -> None:
    """Make the checkpoint ``path`` whole or not at all from ``write(name)``, which fills
    the file ``name`` with its ``size`` bytes: striped over ``stripes`` if given (Note
    [striped checkpoints]), else one temporary file renamed over ``path`` (Note
    [crash-consistent checkpoints])."""
    if stripes is None:
        commit.write_whole(path, size, write)
    else:
        write_striped(stripes, size, path, write)


def check_striped_path(stripes: StripeSet, path: str) -> None:
    """ValueError unless ``path`` is in the first folder of ``stripes``, where a striped
    checkpoint's layout lives."""
    if os.path.dirname(os.path.abspath(path)) != stripes.folders[0]:
        raise ValueError(f"{path}: a striped checkpoint lives in the first stripe folder, "
                         f"{stripes.folders[0]}")


def write_striped(stripes: StripeSet, size: int, path: str, write: Any) -> None:
    """Make the checkpoint ``path`` striped over the folders of ``stripes`` (a StripeSet
    or StripedHandle): ``write(name)`` writes its ``size`` bytes to the logical file
    ``name``, whose stripe files are made with their space allocated."""
    import secrets

    check_striped_path(stripes, path)
    folder, base = os.path.split(os.path.abspath(path))
    base = commit.named_after(base)
    name = f"{base}.{commit.writer_name()}-{secrets.token_hex(4)}.stripe"
    commits = process_state.shared(_Commits)
    with commits.lock:
        commits.writing.add(name)
        try:
            old = read_layout(path) if os.path.isfile(path) else None
            _remove_orphans(stripes, base, old, commits.writing)
        except BaseException:
            commits.writing.discard(name)
            raise
    try:
        _write_and_commit(stripes, size, path, write, os.path.join(folder, name), commits)
    finally:
        with commits.lock:
            commits.writing.discard(name)
    if old is not None and old.get("name") != name:
        _remove_stripes(old)


def _write_and_commit(stripes, size, path, write, logical, commits):
    """Write the stripe files of ``logical`` (in ``path``'s folder), make them durable,
    then commit the layout at ``path`` naming them."""
    import json

    name = os.path.basename(logical)
    parts = stripes.paths(logical)
    expected = stripe_file_sizes(len(parts), stripes.stripe_bytes, size)
    renamed = False     # from the rename on, the layout at ``path`` names these stripes
    try:
        for part, part_size in zip(parts, expected):
            commit.create(part, part_size)
        write(logical)
        for part, part_size in zip(parts, expected):
            commit.make_durable(part, part_size)
        for other in stripes.folders[1:]:
            commit.sync_folder(other)
        text = json.dumps({LAYOUT_KEY: 1, "name": name, "size": size,
                           "stripe_bytes": stripes.stripe_bytes,
                           "folders": stripes.folders}).encode()
        temporary = commit.start(path)
        try:
            with open(temporary, "wb") as file:
                file.write(text)
            with commits.lock:
                commit.make_durable(temporary, len(text))
                with deferred_interrupts():
                    os.replace(temporary, path)
                    renamed = True
                commits.writing.discard(name)
        except BaseException:
            if not renamed:
                commit.abandon(temporary)
            raise
        commit.sync_folder(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        # A failure once the layout is renamed (its folder's fsync, a Ctrl-C) leaves the
        # stripes it names: the checkpoint at ``path`` is the new one.
        if not renamed:
            unlink_quietly(parts)
        raise


def _remove_stripes(layout):
    unlink_quietly(os.path.join(folder, layout["name"]) for folder in layout.get("folders", []))


def _remove_orphans(stripes, base, current, writing):
    """Delete stripe files of ``base`` that no layout names, left by saves whose process
    is gone, or by this process's saves that are not ``writing`` them now."""
    keep = current.get("name") if current else None
    # Exactly the names write_striped gives: "ckpt.2024-06-01.<tag>-<pid>-<hex>.stripe" is
    # another checkpoint's stripe, not one of "ckpt"'s.
    ours = commit.writer_name()
    for folder in stripes.folders:
        for other, *writer in commit.names_by_writer(folder, re.escape(base) + r"\.",
                                                     r"-[0-9a-f]{8}\.stripe"):
            if other != keep and (("-".join(writer) == ours and other not in writing) or
                                  commit.writer_gone(*writer)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, other))


@contextlib.contextmanager
def opened(path: str) -> Iterator[tuple[dict | None, Any, int | str]]:
    """``(layout, file, source)``: the checkpoint at ``path`` as it is now, for one load.
    ``layout`` is its stripe layout or None; ``file`` a binary file of its (logical) bytes,
    for its headers; ``source`` what its bytes are read from by offset: a descriptor of
    the file itself, or the logical file of its stripes.

    Note [one file per load]: a load opens the path once. A save renames its new file
    over the path when done (Note [crash-consistent checkpoints]); a load that opened
    the path again for its tensors' bytes could read them from that new file at the
    offsets of the old one's headers: another checkpoint's bytes, or its headers, in
    the tensors. Every read of a load goes through the one descriptor (a striped
    checkpoint's stripe files are never renamed over: each save writes new ones)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        layout = read_layout(path, fd)
        if layout is None:
            with os.fdopen(fd, "rb", closefd=False) as file:
                yield None, file, fd
        else:
            with StripedFile(layout) as file:
                yield layout, file, layout_file(layout)
    finally:
        os.close(fd)


def unstriped(handle: Any) -> Any:
    """The handle to read a file that is not striped with: a StripedHandle's first own."""
    return handle.handles[0] if isinstance(handle, StripedHandle) else handle


def stripe_paths(layout: dict) -> list[str]:
    """The stripe file in each folder of the layout, in device order."""
    return [os.path.join(folder, layout["name"]) for folder in layout["folders"]]


def layout_file(layout: dict) -> str:
    """The logical file of a striped checkpoint, as a StripedHandle names it."""
    return os.path.join(layout["folders"][0], layout["name"])


@contextlib.contextmanager
def striped_reader(layout: dict, handle: Any) -> Iterator[StripedHandle]:
    """A StripedHandle over the layout's folders and stripe size: ``handle`` if it is
    one, else one made for the read (closed after; what it locked stays valid)."""
    folders, stripe_bytes = layout["folders"], layout["stripe_bytes"]
    if isinstance(handle, StripedHandle) and handle.folders == folders \
            and handle.stripe_bytes == stripe_bytes:
        yield handle
        return
    with StripedHandle(folders, stripe_bytes=stripe_bytes, intra_op_parallelism=2) as reader:
        yield reader


class StripedFile(io.RawIOBase):
    """The logical bytes of a striped checkpoint as a read-only file, through ordinary
    reads of its stripe files: for the small reads of its headers. (Its tensors' bytes
    go through a StripedHandle, every device at once.)"""

    def __init__(self, layout: dict) -> None:
        super().__init__()
        self.size, self.stripe_bytes = layout["size"], layout["stripe_bytes"]
        self.position = 0
        self._fds: list[int] = []
        try:
            sizes = stripe_file_sizes(len(layout["folders"]), self.stripe_bytes, self.size)
            for part, needed in zip(stripe_paths(layout), sizes):
                self._fds.append(os.open(part, os.O_RDONLY | os.O_CLOEXEC))
                held = os.fstat(self._fds[-1]).st_size
                if held < needed:       # the stripe's own name: not the checkpoint's
                    raise short_file_error(part, f"short read: a stripe of {held} bytes "
                                           f"where its checkpoint's layout needs {needed}")
        except BaseException:
            self.close()
            raise
        self._name = layout_file(layout)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        origin = {0: 0, 1: self.position, 2: self.size}[whence]
        self.position = max(0, origin + offset)
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self.position < self.size:
            stripe, within = divmod(self.position, self.stripe_bytes)
            device = stripe % len(self._fds)
            count = min(len(view) - done, self.stripe_bytes - within, self.size - self.position)
            data = os.pread(self._fds[device], count,
                            stripe // len(self._fds) * self.stripe_bytes + within)
            if not data:
                raise ValueError(f"{self._name}: the stripe in folder {device} is shorter "
                                 "than its layout says")
            view[done:done + len(data)] = data
            done += len(data)
            self.position += len(data)
        return done

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        super().close()
