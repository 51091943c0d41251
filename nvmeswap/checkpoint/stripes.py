"""Striping: one logical file spread over several folders (one per device), so that one
read or write keeps every device busy at once.

Note [stripes]: a logical file at ``folders[0]/rel`` is stored as one file per folder, at
``folders[k]/rel``. Its bytes are cut into stripes of ``stripe_bytes`` (a multiple of
4096); stripe ``i`` goes to folder ``i % N`` at offset ``(i // N) * stripe_bytes``, so
each device's file is dense and each device holds about 1/N of every large transfer.
``StripeSet`` is that geometry. In a ``StripedHandle`` each folder has its own
``aio_handle`` (its own workers and kernel queue): a transfer starts every stripe on the
handle of its device and completes when all have, so the devices work in parallel and
the figure is their sum, less what the CPU copying costs. Locked memory belongs to the
process, so a locked buffer is zero-copy on every one. The process's own queue (Note
[saves without a handle]) reaches every device at once as well: one queue, requests to
every stripe file in flight together.

``StripedHandle`` speaks the part of ``aio_handle``'s API that checkpoints and
``TensorSwapper`` use (``sync_``/``async_``/``submit_`` ``pread``/``pwrite``, ``wait``,
locked tensors). A striped checkpoint (Note [striped checkpoints], in
striped_checkpoints.py) records its layout beside the data, so that ``nvmeswap.load``
finds it from the one path.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from ..aio import aio_handle
from ..units import ALIGNMENT

STRIPE_BYTES = 4 << 20


def _byte_view(buffer):
    """A flat uint8 view of a contiguous CPU tensor or a buffer-protocol object."""
    try:
        import torch
    except ImportError:         # pragma: no cover - numpy / bytearray users
        torch = None
    if torch is not None and isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError("a StripedHandle moves CPU buffers only, not "
                             f"{buffer.device.type} tensors")
        if not buffer.is_contiguous():
            raise ValueError("a StripedHandle needs a contiguous tensor")
        return buffer.reshape(-1).view(torch.uint8) if buffer.numel() else \
            torch.empty(0, dtype=torch.uint8)
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("a StripedHandle needs a C-contiguous buffer")
    return view.cast("B")


class StripedFuture:
    """One striped transfer: done when every stripe is; ``result()`` gives the bytes
    moved or raises the first stripe's error once all have ended."""

    def __init__(self, parts: list, nbytes: int) -> None:
        self._parts = parts
        self._nbytes = nbytes

    def done(self) -> bool:
        return all(part.done() for part in self._parts)

    def result(self) -> int:
        first = None
        for part in self._parts:
            try:
                part.result()
            except BaseException as error:
                first = first or error
        if first is not None:
            raise first
        return self._nbytes


def folder_named_twice(folders: list[str]) -> tuple[str, str] | None:
    """Two names in ``folders`` of one folder (the same path, a link to it, a bind mount
    of it), or None: striping over it twice would put two devices' bytes in one file."""
    seen: dict[tuple[int, int], str] = {}
    for folder in folders:
        found = os.stat(folder)
        identity = (found.st_dev, found.st_ino)
        if identity in seen:
            return seen[identity], folder
        seen[identity] = folder
    return None


class StripeSet:
    """Where the bytes of files striped over ``folders`` lie (Note [stripes]): each
    folder's file and each stripe piece of a range, for whatever moves them (a
    ``StripedHandle``, or the process's own queue: Note [saves without a handle]).

    Parameters
    ----------
    folders : sequence of str or os.PathLike
        Existing folders, one per device; file names given must lie in the first.
    stripe_bytes : int
        Bytes per stripe, a multiple of 4096 (default 4 MiB).
    """

    def __init__(self, folders: Any, *, stripe_bytes: int = STRIPE_BYTES) -> None:
        if isinstance(folders, (str, os.PathLike)) or not folders:
            raise TypeError("folders must be a non-empty sequence of folders")
        self.folders = [os.path.abspath(os.fspath(f)) for f in folders]
        for folder in self.folders:
            if not os.path.isdir(folder):
                raise FileNotFoundError(2, "No such stripe folder", folder)
        twice = folder_named_twice(self.folders)
        if twice is not None:
            raise ValueError(f"a folder is named twice in {self.folders}: {twice[0]} and "
                             f"{twice[1]} are one folder")
        if not isinstance(stripe_bytes, int) or stripe_bytes <= 0 or stripe_bytes % ALIGNMENT:
            raise ValueError(f"stripe_bytes must be a positive multiple of {ALIGNMENT}, "
                             f"got {stripe_bytes!r}")
        self.stripe_bytes = stripe_bytes

    # -- where the bytes go --------------------------------------------------------------
    def paths(self, filename: Any) -> list[str]:
        """The file of each folder that holds a part of ``filename``."""
        if isinstance(filename, int) or not isinstance(filename, (str, os.PathLike)):
            raise TypeError(f"a striped file needs a name, got {type(filename).__name__}")
        relative = os.path.relpath(os.path.abspath(os.fspath(filename)), self.folders[0])
        if relative == os.curdir or relative.split(os.sep)[0] == os.pardir:
            raise ValueError(f"{filename} is not inside {self.folders[0]}, the first stripe "
                             "folder")
        return [os.path.join(folder, relative) for folder in self.folders]

    def pieces(self, nbytes: int, offset: int) -> list[tuple[int, int, int, int]]:
        """``(device, device offset, buffer offset, length)`` of each stripe piece of the
        logical range ``[offset, offset + nbytes)``."""
        return stripe_pieces(len(self.folders), self.stripe_bytes, nbytes, offset)

    def size(self, filename: Any) -> int:
        """The logical size of ``filename``: the end of the last byte its parts hold."""
        count, stripe = len(self.folders), self.stripe_bytes
        end, missing = 0, []
        for device, path in enumerate(self.paths(filename)):
            try:
                held = os.stat(path).st_size
            except FileNotFoundError as error:
                # A part not made: its stripes were never written (a write at an offset
                # past them); the file is missing only if every part is.
                missing.append(error)
                held = 0
            if held:
                row, within = divmod(held - 1, stripe)
                end = max(end, (row * count + device) * stripe + within + 1)
        if len(missing) == count:
            raise missing[0]
        return end

    def short_part(self, filename: Any, nbytes: int, offset: int) -> tuple[str, int, int] | None:
        """The first part of ``filename`` that ends before the last byte of
        ``[offset, offset + nbytes)`` it holds, as ``(path, its size, the size needed)``;
        None if every part holds its share. (``size`` says where the last part ends: a
        part on another device may still be short.)"""
        paths, needed = self.paths(filename), {}
        for device, device_offset, _, length in self.pieces(nbytes, offset):
            needed[device] = max(needed.get(device, 0), device_offset + length)
        for device, end in sorted(needed.items()):
            held = os.stat(paths[device]).st_size
            if held < end:
                return paths[device], held, end
        return None

    def makedirs(self, folder: Any) -> None:
        """Make ``folder`` (inside the first folder) and its twin in every other one."""
        for path in self.paths(folder):
            os.makedirs(path, exist_ok=True)

    def remove(self, filename: Any) -> None:
        """Delete every part of ``filename``; parts already gone are fine."""
        for path in self.paths(filename):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class StripedHandle(StripeSet):
    """Transfers striped over ``folders`` (Note [stripes]), each folder's through an
    ``aio_handle`` of its own.

    Parameters
    ----------
    folders, stripe_bytes
        As ``StripeSet``'s.
    **handle_args
        ``aio_handle``'s arguments, for the handle of each folder.
    """

    def __init__(self, folders: Any, *, stripe_bytes: int = STRIPE_BYTES,
                 **handle_args: Any) -> None:
        self.closed = False
        self._pending: list[StripedFuture] = []
        self.handles: list[aio_handle] = []
        super().__init__(folders, stripe_bytes=stripe_bytes)
        try:
            for _ in self.folders:
                self.handles.append(aio_handle(**handle_args))
        except BaseException:
            self.close()
            raise

    # -- transfers -----------------------------------------------------------------------
    def _start(self, buffer, filename, file_offset, is_read):
        self._check_open()
        if not isinstance(file_offset, int) or isinstance(file_offset, bool):
            raise TypeError(f"file_offset must be an int, got {file_offset!r}")
        if file_offset < 0:
            raise ValueError(f"file_offset must be a non-negative int, got {file_offset!r}")
        paths = self.paths(filename)
        flat = _byte_view(buffer)
        nbytes = flat.numel() if hasattr(flat, "numel") else len(flat)
        parts = []
        try:
            for device, device_offset, at, length in self.pieces(nbytes, file_offset):
                handle = self.handles[device]
                piece = flat[at:at + length]
                submit = handle.submit_pread if is_read else handle.submit_pwrite
                parts.append(submit(piece, paths[device], device_offset))
            if not parts and not is_read:
                create_files(paths)     # a write of 0 bytes still makes the files
            elif not parts:
                self.size(filename)     # a read of 0 bytes still needs the file
        except BaseException:
            for part in parts:
                with contextlib.suppress(BaseException):
                    part.result()
            raise
        return StripedFuture(parts, nbytes)

    def submit_pwrite(self, buffer: Any, filename: Any, file_offset: int = 0) -> StripedFuture:
        return self._start(buffer, filename, file_offset, is_read=False)

    def submit_pread(self, buffer: Any, filename: Any, file_offset: int = 0) -> StripedFuture:
        return self._start(buffer, filename, file_offset, is_read=True)

    def async_pwrite(self, buffer: Any, filename: Any, file_offset: int = 0) -> int:
        self._pending.append(self._start(buffer, filename, file_offset, is_read=False))
        return 0

    def async_pread(self, buffer: Any, filename: Any, file_offset: int = 0) -> int:
        self._pending.append(self._start(buffer, filename, file_offset, is_read=True))
        return 0

    def sync_pwrite(self, buffer: Any, filename: Any, file_offset: int = 0) -> int:
        self._start(buffer, filename, file_offset, is_read=False).result()
        return 1

    def sync_pread(self, buffer: Any, filename: Any, file_offset: int = 0) -> int:
        self._start(buffer, filename, file_offset, is_read=True).result()
        return 1

    def wait(self) -> int:
        """Wait for every ``async_`` transfer; how many completed. The first failure is
        raised once all have ended. Interrupted (Ctrl-C), it counts none: the next call
        waits for them all again, as ``aio_handle.wait`` does."""
        pending, self._pending = self._pending, []
        first = None
        for future in pending:
            try:
                future.result()
            except KeyboardInterrupt:
                self._pending = pending + self._pending
                raise
            except BaseException as error:
                first = first or error
        if first is not None:
            raise first
        return len(pending)

    # -- locked memory (the process's, shared by every handle) ---------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any = None) -> Any:
        self._check_open()
        return self.handles[0].new_cpu_locked_tensor(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        self._check_open()
        return self.handles[0].free_cpu_locked_tensor(tensor)

    def is_pinned(self, buffer: Any) -> bool:
        return self.handles[0].is_pinned(buffer)

    # -- lifetime ------------------------------------------------------------------------
    def _check_open(self):
        if self.closed:
            raise ValueError("this StripedHandle is closed")

    def close(self) -> None:
        """Wait for what is in flight and close every folder's handle. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._pending:
            with contextlib.suppress(BaseException):
                self.wait()
        # Closing a handle waits for its workers to end, and kernel AIO's teardown takes
        # tens of milliseconds: the folders' handles end side by side (0.06-0.07 s for
        # four, against 0.17-0.19 s one after another, 2026-11-26).
        errors: list[BaseException] = []

        def close(handle):
            try:
                handle.close()
            except BaseException as error:
                errors.append(error)

        others = [threading.Thread(target=close, args=(handle,), name="nvmeswap-close")
                  for handle in self.handles[1:]]
        for thread in others:
            thread.start()
        try:
            if self.handles:
                close(self.handles[0])
        finally:
            for thread in others:
                thread.join()
        if errors:
            raise errors[0]

    def __enter__(self) -> StripedHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<nvmeswap StripedHandle {'closed' if self.closed else 'open'} over "
                f"{len(self.folders)} folders, {self.stripe_bytes} bytes a stripe>")


def stripe_pieces(devices: int, stripe_bytes: int, nbytes: int,
                  offset: int) -> list[tuple[int, int, int, int]]:
    """``(device, device offset, buffer offset, length)`` of each piece of the logical
    range ``[offset, offset + nbytes)`` striped over ``devices`` (Note [stripes])."""
    out = []
    position = offset
    while position < offset + nbytes:
        stripe, within = divmod(position, stripe_bytes)
        length = min(stripe_bytes - within, offset + nbytes - position)
        out.append((stripe % devices, (stripe // devices) * stripe_bytes + within,
                    position - offset, length))
        position += length
    return out


def stripe_file_sizes(devices: int, stripe_bytes: int, nbytes: int) -> list[int]:
    """The bytes each device's file holds of a logical file of ``nbytes`` striped over
    ``devices``: stripe ``k`` is on device ``k % devices`` (Note [stripes])."""
    whole, rest = divmod(nbytes, stripe_bytes)
    sizes = [whole // devices * stripe_bytes] * devices
    for device in range(whole % devices):
        sizes[device] += stripe_bytes
    sizes[whole % devices] += rest
    return sizes


def create_files(paths):
    """Make each of ``paths`` that does not exist, empty."""
    for path in paths:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def unlink_quietly(paths):
    """Remove what of ``paths`` can go: clean-up after a failure or of a replaced layout,
    where what cannot go stays, unreferenced."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
