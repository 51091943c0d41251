"""Striped checkpoints on disk: the layout file that names the stripes, written as the
commit of a striped save and read back by the loads (Note [striped checkpoints]); the
stripes themselves move through a StripedHandle or the process's own queue."""
from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import short_file_error
from ..io import process_state
from ..io.interrupts import deferred_interrupts
from ..units import ALIGNMENT
from . import commit
from .stripes import StripedHandle, StripeSet, stripe_file_sizes, unlink_quietly

# Note [striped checkpoints]: a striped checkpoint at ``path`` (in the first stripe folder)
# is a small JSON file there, the layout: the folders, the stripe size, the logical size
# and the name of the striped data, ``<name>.<tag>-<pid>-<random>.stripe`` in every
# folder (Note [files named by their process] in commit.py). A save first writes the
# layout it will commit to its temporary file beside ``path`` and makes it durable, then
# writes fresh stripe files under the new name, fsyncs each and each folder, then renames
# the layout over ``path`` as any checkpoint is replaced (Note [crash-consistent
# checkpoints]): that rename is the one commit point, so a save killed at any instant
# leaves the old layout naming the old stripes. The layout replaced, read at the rename,
# has its stripes deleted after it; the new layout records it (``replaces``), so that
# stripes a kill kept from being deleted go with the next save. A killed save leaves its
# temporary layout, naming its stripes: the next save of ``path`` removes both, where the
# writer is gone. A stripe is never taken for an orphan by its name: another layout may
# name it (one renamed, to keep an older checkpoint; one of the same name in another
# folder whose stripes share a folder). ``nvmeswap.load`` knows the layout file by its
# first bytes and reads the data from it. Reading the layout a save replaces and
# renaming over it are one step for this process's saves (``_Commits.lock``): two
# threads saving one path each delete what they replace, and nothing is left.
LAYOUT_KEY = "nvmeswap_stripes"


class _Commits:
    """The lock of this process's striped commits (a forked child starts with a fresh
    one: Note [process state])."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


def read_layout(path: str, fd: int | None = None) -> dict | None:
    """The layout at ``path`` (read from ``fd`` if given, a descriptor open on it), or
    None if ``path`` is not a striped checkpoint; ValueError naming ``path`` for one that
    is damaged."""
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
    problem = _layout_problem(layout)
    if problem is not None:
        raise ValueError(f"{path}: a damaged stripe layout ({problem})")
    return layout


def _layout_problem(layout: Any) -> str | None:
    """What is wrong with a parsed layout, or None."""
    if not isinstance(layout, dict):
        return "not a JSON object"
    size, stripe_bytes = layout.get("size"), layout.get("stripe_bytes")
    if type(size) is not int or size < 0:
        return f"size {size!r}"
    if type(stripe_bytes) is not int or stripe_bytes <= 0 or stripe_bytes % ALIGNMENT:
        return f"stripe_bytes {stripe_bytes!r}"
    replaced = layout.get("replaces")
    if replaced is not None and not isinstance(replaced, dict):
        return f"replaces {replaced!r}"
    return _stripes_problem(layout) or (replaced and _stripes_problem(replaced))


def _stripes_problem(named: dict) -> str | None:
    name, folders = named.get("name"), named.get("folders")
    if not isinstance(name, str) or name in ("", os.curdir, os.pardir) or os.sep in name:
        return f"name {name!r}"
    if not isinstance(folders, list) or not folders or \
            not all(isinstance(folder, str) and os.path.isabs(folder) for folder in folders):
        return f"folders {folders!r}"
    return None


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
    old = read_layout(path) if os.path.isfile(path) else None   # a damaged one refused
    _remove_killed_saves(path, base)
    name = f"{base}.{commit.writer_name()}-{secrets.token_hex(4)}.stripe"
    layout = {LAYOUT_KEY: 1, "name": name, "size": size, "stripe_bytes": stripes.stripe_bytes,
              "folders": stripes.folders, **_replacing(old)}
    parts = stripes.paths(os.path.join(folder, name))
    temporary = commit.start(path)
    renamed = False     # from the rename on, the layout at ``path`` names these stripes
    try:
        _write_layout(temporary, layout)
        commit.sync_folder(folder)      # the killed save's layout is found: its stripes too
        _write_stripes(stripes, size, parts, write)
        with process_state.shared(_Commits).lock:
            replaced = _layout_at(path)
            if _replacing(replaced) != _replacing(old):     # another thread's save came
                layout = {**{k: v for k, v in layout.items() if k != "replaces"},
                          **_replacing(replaced)}
                _rewrite_layout(path, temporary, layout)
            with deferred_interrupts():
                os.replace(temporary, path)
                renamed = True
    except BaseException:
        if not renamed:
            unlink_quietly(parts)
            commit.abandon(temporary)
        raise
    # A failure from here on (the folder's fsync, a Ctrl-C) leaves the new checkpoint.
    commit.sync_folder(folder)
    if replaced is not None:
        _remove_stripes(replaced)
        _remove_stripes(replaced.get("replaces"))


def _replacing(layout: dict | None) -> dict:
    """The ``replaces`` entry of a layout that replaces ``layout``."""
    if layout is None:
        return {}
    return {"replaces": {"name": layout["name"], "folders": layout["folders"]}}


def _layout_at(path: str) -> dict | None:
    """The layout at ``path`` now, or None: no file, not striped, or damaged (then its
    stripes cannot be known, and what replaces it deletes none)."""
    try:
        return read_layout(path)
    except (OSError, ValueError):
        return None


def _write_layout(path: str, layout: dict) -> None:
    import json

    text = json.dumps(layout).encode()
    with open(path, "wb") as file:
        file.write(text)
    commit.make_durable(path, len(text))


def _rewrite_layout(path: str, temporary: str, layout: dict) -> None:
    """Replace the temporary layout of a save of ``path`` whole, through another
    temporary file of ``path``: a kill leaves one or both, each naming this save's
    stripes."""
    other = commit.temporary_name(path)
    try:
        _write_layout(other, layout)
        os.replace(other, temporary)
    except BaseException:
        commit.abandon(other)
        raise


def _remove_killed_saves(path: str, base: str) -> None:
    """What saves of ``path`` killed before their commit left: each its temporary
    layout, which names its own stripes (Note [striped checkpoints])."""
    for temporary, writer in commit.stale_temporaries(path):
        with contextlib.suppress(OSError, ValueError):
            layout = read_layout(temporary)
            if layout is not None and layout["name"].startswith(f"{base}.{writer}-"):
                _remove_stripes(layout)
        commit.abandon(temporary)


def _write_stripes(stripes, size, parts, write):
    """Write the stripe files ``parts`` of ``size`` logical bytes and make them durable."""
    expected = stripe_file_sizes(len(parts), stripes.stripe_bytes, size)
    for part, part_size in zip(parts, expected):
        commit.create(part, part_size)
    write(parts[0])
    for part, part_size in zip(parts, expected):
        commit.make_durable(part, part_size)
    for other in stripes.folders[1:]:
        commit.sync_folder(other)


def _remove_stripes(named: dict | None) -> None:
    if named is not None:
        unlink_quietly(os.path.join(folder, named["name"]) for folder in named["folders"])


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
