"""``TensorSwapper``: swap tensors out to files and back, each key's state kept true.

The layer ZeRO-Infinity style offload needs. ``TensorSwapper`` keeps, per key, where a
tensor is (in memory, being written, on disk, being read, or failed) and moves it with two
handles, one for reads and one for writes, so that a prefetch never waits behind a
write-back. Where the bytes go on disk is ``swap_files``'s; ``SwapBufferPool`` (locked
buffers allocated once) is ``swap_pool``'s, imported here for its callers.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import os
import shutil
import tempfile
from collections.abc import Hashable
from typing import Any

from ..aio import aio_handle
from ..checkpoint.commit import names_by_writer, writer_gone, writer_name
from ..io import process_state
from ..io.interrupts import deferred_interrupts
from ..io.operation import checked_bool
from .swap_files import PackFile, as_bytes, file_name
from .swap_pool import SwapBufferPool

__all__ = ["SwapBufferPool", "SwapError", "SwapState", "TensorSwapper"]


class SwapState(enum.Enum):
    IN_MEMORY = "in memory"
    WRITING = "being written"
    ON_DISK = "on disk"
    READING = "being read"
    FAILED = "failed"       # its last write failed or may not have landed whole


class SwapError(RuntimeError):
    """A swap finished with other counts or sizes than were started."""


class _Entry:
    __slots__ = ("dtype", "error", "nbytes", "offset", "path", "shape", "state", "tensor")

    def __init__(self, path, offset, shape, dtype, nbytes):
        self.path = path
        self.offset = offset
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.state = SwapState.IN_MEMORY
        self.tensor = None      # held while an operation on it is in flight
        self.error = None       # why the state is FAILED


class TensorSwapper:
    """Swap tensors of any size and dtype to files, one file per key.

    Parameters
    ----------
    folder : str or os.PathLike, or a list of them
        Where the swap files go; created if missing. The swapper makes a sub-folder of
        its own there (``directory``), so several swappers (or optimizers, or ranks) may
        share one folder; one left by a killed process is removed by the next swapper
        made there. ``close()`` deletes that sub-folder and everything in it. If a
        clean-up job removes them, the next write makes them again (what was removed is
        gone: reading it raises ``FileNotFoundError`` naming the file). A list of folders
        (one per device) stripes every swap file over all of them, with ``stripe_bytes`` a
        stripe (Note [stripes] in checkpoint/stripes.py); the default handles are then
        ``StripedHandle``s.
    read_handle, write_handle : aio_handle, optional
        The handles to use, two different ones; by default two of its own
        (``**handle_args``) that share their locked memory, so reads are never queued
        behind writes and tensors from ``new_locked_tensor`` are zero-copy both ways.
        Over a list of folders, ``StripedHandle``s over those folders with the same
        ``stripe_bytes``.
    pack_below : int
        Tensors smaller than this many bytes share one pack file, each in an aligned
        slot that it keeps when swapped out again; their writes wait until
        ``synchronize_writes()`` and go out as one write per run of adjacent slots
        (write-behind batching). 0 (default): one file per tensor.
    stripe_bytes : int, optional
        Bytes per stripe over a list of folders, a multiple of 4096 (default 4 MiB).

    Notes
    -----
    Keys are any hashable values, usually strings of any length and characters: file
    names are a cleaned, shortened prefix of the key and a hash of all of it.

    A key's ``state`` is always true. A swap-out that fails to start, or whose write
    fails or comes up short, leaves the key ``FAILED`` (``swap_in`` refuses it with a
    ``SwapError``; ``swap_out`` again or ``release`` it). A swap-in that fails leaves
    the key as it was before, readable again.
    """

    def __init__(self, folder: str | os.PathLike[str], read_handle: aio_handle | None = None,
                 write_handle: aio_handle | None = None, *, pack_below: int = 0,
                 stripe_bytes: int | None = None, **handle_args: Any) -> None:
        if read_handle is not None and read_handle is write_handle:
            # Each side's wait() counts its own operations: one handle would count both.
            raise ValueError("TensorSwapper needs two handles, one for reads and one for "
                             "writes; pass two, or neither (it makes its own)")
        # Absolute: the files must stay where they are if the process changes folder.
        folders = [os.path.abspath(os.fspath(f)) for f in folder] \
            if isinstance(folder, (list, tuple)) else [os.path.abspath(os.fspath(folder))]
        for each in folders:
            os.makedirs(each, exist_ok=True)
        stripes = _stripe_set(folders, stripe_bytes, read_handle, write_handle)
        self.folder = folders[0]
        _remove_stale(folders)
        self.directory = tempfile.mkdtemp(prefix=f"swap-{writer_name()}-", dir=self.folder)
        self._closed = False
        self._creator = process_state.pid       # a forked child's copy deletes nothing
        self._own = [h is None for h in (read_handle, write_handle)]
        self.read_handle = read_handle
        self.write_handle = write_handle
        self._stripes = stripes
        try:
            if stripes is not None:
                from ..checkpoint.stripes import StripedHandle
                self.read_handle = read_handle or StripedHandle(
                    folders, stripe_bytes=stripes.stripe_bytes, **handle_args)
                self.write_handle = write_handle or StripedHandle(
                    folders, stripe_bytes=stripes.stripe_bytes, **handle_args)
                stripes.makedirs(self.directory)
            self.read_handle = self.read_handle or aio_handle(**handle_args)
            self.write_handle = self.write_handle or aio_handle(
                **handle_args,
                share_locked_memory_with=self.read_handle if self._own[0] else None)
        except BaseException:
            self._close_handles()
            self._rmdir()
            raise
        self._entries = {}
        self._serials = itertools.count()   # of the swap files' names
        self._reading = []
        self._writing = []
        self._writes_started = 0    # writes started since the last synchronize_writes
        self._uncertain_reads = 0   # submissions that raised: wait() may or may not count them
        self._uncertain_writes = 0
        self._locked = []           # tensors made by new_locked_tensor, freed at close
        self.pack_below = pack_below
        self._pack = PackFile(os.path.join(self.directory, "pack.swp"))

    def new_locked_tensor(self, nbytes: int) -> Any:
        """A locked uint8 tensor that both of the swapper's handles move without a copy.

        ``close()`` frees any that ``free_locked_tensor`` has not.
        """
        import torch
        self._check_open()
        tensor = self.read_handle.new_cpu_locked_tensor(nbytes,
                                                        torch.empty(0, dtype=torch.uint8))
        self._locked.append(tensor)
        return tensor

    def free_locked_tensor(self, tensor: Any) -> None:
        """Stop sharing ``tensor`` (from ``new_locked_tensor``) with the workers."""
        self._check_open()
        self.read_handle.free_cpu_locked_tensor(tensor)     # refused while I/O uses it
        self._locked = [t for t in self._locked if t is not tensor]

    def state(self, key: Hashable) -> SwapState:
        return self._entries[key].state

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def swap_out(self, key: Hashable, tensor: Any, async_op: bool = True) -> None:
        """Write ``tensor`` under ``key``. The tensor must not change until
        ``synchronize_writes()`` (async) or this call (sync) returns.

        Raises ``RuntimeError`` if the key is being written or read. If the write cannot
        be started, the key is left ``FAILED`` and the error raised.
        """
        self._check_open()
        async_op = checked_bool("async_op", async_op)
        entry = self._entries.get(key)
        if entry is not None and entry.state in (SwapState.WRITING, SwapState.READING):
            raise RuntimeError(f"swap key {key!r} is {entry.state.value}; synchronize first")
        # A conjugate or negative view goes out as the values it shows, as a handle writes it.
        flat = as_bytes(tensor.resolve_conj().resolve_neg())
        packed = 0 < flat.numel() < self.pack_below
        if entry is not None:
            self._leave_place(key, entry, packed)
        if packed:
            path, offset = self._pack.path, self._pack.slot(key, flat.numel())
        elif entry is not None and entry.path != self._pack.path:
            path, offset = entry.path, 0    # its own file, named once: equal keys (1, True,
            # 1.0) have one entry, whatever each one's name would be
        else:
            path = os.path.join(self.directory, file_name(key, next(self._serials)))
            offset = 0
        entry = _Entry(path, offset, tuple(tensor.shape), tensor.dtype, flat.numel())
        self._entries[key] = entry
        if entry.nbytes == 0:
            entry.state = SwapState.ON_DISK         # nothing to write
            return
        if packed:
            with deferred_interrupts():     # in both books or in neither
                entry.state, entry.tensor = SwapState.WRITING, flat
                self._writing.append(key)
                self._pack.batched.append(key)
            if not async_op:
                self.synchronize_writes()
            return
        try:
            if async_op:
                # In the books first: a Ctrl-C once the write started must find it there.
                entry.state, entry.tensor = SwapState.WRITING, flat
                self._writing.append(key)
                self._in_directory(self.write_handle.async_pwrite, flat, entry.path)
                self._writes_started += 1
            else:
                self._in_directory(self.write_handle.sync_pwrite, flat, entry.path)
                entry.state = SwapState.ON_DISK
        except BaseException as error:
            with deferred_interrupts():
                if async_op:
                    if key in self._writing:
                        self._writing.remove(key)
                    self._uncertain_writes += 1
                _fail(entry, f"writing {entry.path} failed: {error}")
            raise

    def _leave_place(self, key, entry, packed):
        """Give up the place ``key`` had (its file, or its slot of the pack file) when its
        next bytes go to the other kind: else the file would outlive ``release``."""
        if entry.path == self._pack.path:
            if not packed:
                self._pack.release(key)
        elif packed:
            self._remove(entry.path)

    def _in_directory(self, write, *args):
        """Start ``write(*args)``; if the swapper's folder is gone (a clean-up job removed
        it), make it again and start it once more: a refused open started nothing."""
        try:
            return write(*args)
        except FileNotFoundError:
            folders = self._stripes.paths(self.directory) if self._stripes is not None \
                else [self.directory]
            if all(os.path.isdir(folder) for folder in folders):
                raise
        if self._stripes is not None:
            self._stripes.makedirs(self.directory)
        else:
            os.makedirs(self.directory, exist_ok=True)
        return write(*args)

    def swap_in(self, key: Hashable, out: Any = None, async_op: bool = True) -> Any:
        """Read ``key`` into ``out`` (or a new tensor of its shape and dtype) and return it;
        with ``async_op`` the data is there after ``synchronize_reads()`` (a prefetch).

        ``out`` must have the dtype (else ``TypeError``) and shape (else ``ValueError``)
        the key was swapped out with. A key read before may be read again: its file is
        unchanged until the next ``swap_out``.
        """
        import torch
        self._check_open()
        async_op = checked_bool("async_op", async_op)
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"nothing swapped out under {key!r}")
        if entry.state is SwapState.FAILED:
            raise SwapError(f"swap key {key!r} cannot be read: {entry.error}")
        if entry.state not in (SwapState.ON_DISK, SwapState.IN_MEMORY):
            raise RuntimeError(f"swap key {key!r} is {entry.state.value}, not on disk")
        if out is None:
            out = torch.empty(entry.shape, dtype=entry.dtype)
        elif not isinstance(out, torch.Tensor):
            raise TypeError(f"swap_in needs a torch tensor as out, got {type(out).__name__}")
        elif out.dtype != entry.dtype:
            raise TypeError(f"swap key {key!r} holds {entry.dtype}; the output tensor is "
                            f"{out.dtype}")
        elif tuple(out.shape) != entry.shape:
            raise ValueError(f"swap key {key!r} holds {entry.nbytes} bytes of shape "
                             f"{entry.shape}; the output tensor has shape {tuple(out.shape)}")
        if out.is_conj() or out.is_neg():
            raise ValueError(f"swap_in of {key!r}: out is a conjugate or negative view; "
                             "read into a plain tensor")
        flat = as_bytes(out)
        before = entry.state
        if entry.nbytes == 0:
            entry.state = SwapState.IN_MEMORY
            return out
        try:
            if async_op:
                entry.state, entry.tensor = SwapState.READING, flat
                self._reading.append(key)
                self.read_handle.async_pread(flat, entry.path, entry.offset)
            else:
                self.read_handle.sync_pread(flat, entry.path, entry.offset)
                entry.state = SwapState.IN_MEMORY
        except BaseException:
            with deferred_interrupts():
                if async_op:
                    if key in self._reading:
                        self._reading.remove(key)
                    self._uncertain_reads += 1
                entry.state, entry.tensor = before, None     # the file is as it was
            raise
        return out

    def synchronize_writes(self) -> int:
        """Wait for every swap_out; check that all of them, and all their bytes, landed.

        Returns the number of writes completed. If the handle reports a failure or other
        counts than were started, every key written since the last synchronize is left
        ``FAILED`` (which of them landed is not known); a key whose file came up short is
        left ``FAILED`` and named; so are the keys of a pack file write that could not be
        started. Either way a ``SwapError`` (or the handle's error, or the one that kept
        the pack file's write from starting) is raised once no write is in flight; the
        caller still holds the tensors and can swap them out again. A Ctrl-C while it
        waits leaves the writes in flight, for the next call to wait for.
        """
        self._check_open()
        start_error = None

        def started():
            self._writes_started += 1

        try:
            self._in_directory(self._pack.write_batches, self.write_handle, self._entries,
                               started)
        except KeyboardInterrupt:
            raise       # the runs not started stay batched, for the next call
        except BaseException as error:
            start_error = error
            self._fail_batched(error)
        try:
            done = self.write_handle.wait()
        except KeyboardInterrupt:
            raise       # nothing counted: the writes stay in flight for the next call
        except BaseException as error:
            with deferred_interrupts():
                keys = self._take_writes()[0]
                for key in keys:
                    _fail(self._entries[key], f"a write failed: {error}")
            raise
        with deferred_interrupts():
            keys, started, uncertain = self._take_writes()
            problems = self._check_writes(keys, started, done, uncertain)
        if start_error is not None:
            raise start_error
        if problems:
            raise SwapError("; ".join(problems))
        return done

    def _fail_batched(self, error):
        """The pack file's batched keys failed: ``error`` kept its writes from starting
        (some runs may have started: wait() counts those)."""
        with deferred_interrupts():
            batched, self._pack.batched = set(self._pack.batched), []
            self._uncertain_writes += len(batched)
            self._writing = [key for key in self._writing if key not in batched]
            for key in batched:
                _fail(self._entries[key], f"writing {self._pack.path} failed: "
                                          f"{error or type(error).__name__}")

    def _take_writes(self):
        """The keys written since the last synchronize, and how many writes surely and
        maybe started; the books and the pack file's staging emptied."""
        taken = self._writing, self._writes_started, self._uncertain_writes
        self._writing, self._writes_started, self._uncertain_writes = [], 0, 0
        self._pack.buffers = []
        return taken

    def _check_writes(self, keys, started, done, uncertain):
        """Each key on disk, or failed and named in the problems returned."""
        problems = [] if started <= done <= started + uncertain else \
            [f"{done} writes completed, {started} were started"]
        for index, key in enumerate(keys):
            entry = self._entries[key]
            entry.tensor = None
            if problems:
                _fail(entry, problems[0])
                continue
            try:
                message = self._short_file(entry)
            except OSError as error:
                message = f"swap file {entry.path} cannot be checked: {error}"
            except BaseException as error:
                for rest in keys[index:]:
                    _fail(self._entries[rest], f"its check was cut short: {error!r}")
                raise
            if message is None:
                entry.state = SwapState.ON_DISK
            else:
                problems.append(message)
                _fail(entry, message)
        return problems

    def _short_file(self, entry):
        """What is missing from ``entry``'s swap file (or its part on one of the striped
        devices), or None."""
        if self._stripes is not None:
            short = self._stripes.short_part(entry.path, entry.nbytes, entry.offset)
            return None if short is None else \
                f"swap file part {short[0]} has {short[1]} bytes, expected {short[2]}"
        size = os.stat(entry.path).st_size - entry.offset
        return None if size >= entry.nbytes else \
            f"swap file {entry.path} has {size} bytes, expected {entry.nbytes}"

    def synchronize_reads(self) -> int:
        """Wait for every swap_in; check the count and that every byte arrived.

        If a read failed, every key read since the last synchronize is left as it was
        before (on disk, readable again) and the error raised. A Ctrl-C while it waits
        leaves the reads in flight, for the next call to wait for.
        """
        self._check_open()
        try:
            done = self.read_handle.wait()
        except KeyboardInterrupt:
            raise
        except BaseException:
            with deferred_interrupts():
                keys, self._reading, self._uncertain_reads = self._reading, [], 0
                for key in keys:
                    entry = self._entries[key]
                    entry.state, entry.tensor = SwapState.ON_DISK, None
            raise
        with deferred_interrupts():
            keys, self._reading = self._reading, []
            uncertain, self._uncertain_reads = self._uncertain_reads, 0
            problems = [] if len(keys) <= done <= len(keys) + uncertain else \
                [f"{done} reads completed, {len(keys)} were started"]
            for key in keys:
                entry = self._entries[key]
                if entry.tensor.numel() != entry.nbytes:
                    problems.append(f"swap key {key!r} read {entry.tensor.numel()} bytes, "
                                    f"expected {entry.nbytes}")
                entry.tensor = None
            # Any problem: none of them is known to be read; all readable again.
            for key in keys:
                self._entries[key].state = SwapState.ON_DISK if problems else \
                    SwapState.IN_MEMORY
        if problems:
            raise SwapError("; ".join(problems))
        return done

    def release(self, key: Hashable) -> None:
        """Forget ``key`` and delete its file."""
        self._check_open()
        entry = self._entries[key]
        if entry.state in (SwapState.WRITING, SwapState.READING):
            raise RuntimeError(f"swap key {key!r} is {entry.state.value}; synchronize first")
        del self._entries[key]
        if not self._pack.release(key):
            self._remove(entry.path)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for what is in flight, delete every file and the swapper's sub-folder,
        free the locked tensors it made and close the handles it made. Idempotent. In a
        forked child it only closes the child's copy: all of it is the parent's."""
        if self._closed:
            return
        if process_state.pid != self._creator:
            # A forked child's copy: the files, folder and handles are the parent's.
            self._closed = True
            return
        errors, emptied = [], False
        try:
            # Started, or maybe started (a start that raised): waited for before anything
            # they use goes.
            in_flight = ((self._writing or self._writes_started or self._uncertain_writes,
                          self.synchronize_writes),
                         (self._reading or self._uncertain_reads, self.synchronize_reads))
            for pending, synchronize in in_flight:
                if pending:
                    try:
                        synchronize()
                    except Exception as error:
                        errors.append(error)
            for key in list(self._entries):
                self.release(key)
            self._remove(self._pack.path)
            for tensor in self._locked:
                self.read_handle.free_cpu_locked_tensor(tensor)
            self._locked = []
            self._rmdir()
            emptied = True
        finally:
            self._closed = True
            self._close_handles()
            if not emptied:     # interrupted: what is in flight has ended with the handles
                self._discard_files()
        if errors:
            raise errors[0]

    def _discard_files(self):
        """Every file and the sub-folder, as far as they go (after an interrupted close)."""
        for path in {entry.path for entry in self._entries.values()} | {self._pack.path}:
            with contextlib.suppress(OSError):
                self._remove(path)
        self._entries = {}
        with contextlib.suppress(OSError):
            self._rmdir()

    def _remove(self, path):
        if self._stripes is not None:
            self._stripes.remove(path)
        elif os.path.exists(path):
            os.unlink(path)

    def _rmdir(self):
        """The sub-folder and whatever is left in it (it is the swapper's alone), in every
        folder it stripes over."""
        folders = self._stripes.paths(self.directory) if self._stripes is not None \
            else [self.directory]
        for folder in folders:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(folder)

    def _close_handles(self):
        """Close the handles it owns, each one even if closing the other raised (a Ctrl-C
        in one leaves that one closed, and the other must be too); then raise that."""
        first = None
        for own, handle in zip(self._own, (self.read_handle, self.write_handle)):
            if own and handle is not None:
                try:
                    handle.close()
                except BaseException as error:
                    first = first or error
        if first is not None:
            raise first

    def _check_open(self):
        if self._closed:
            raise ValueError(f"this TensorSwapper ({self.directory}) is closed")

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<TensorSwapper {'closed' if self._closed else 'open'} {self.directory} "
                f"keys={len(self._entries)}>")


def _stripe_set(folders, stripe_bytes, read_handle, write_handle):
    """The stripes over ``folders`` (None for one folder), every given handle checked to
    stripe as they do: a handle of other folders or stripes would read other bytes."""
    if len(folders) == 1:
        if stripe_bytes is not None:
            raise ValueError("stripe_bytes goes with a list of folders to stripe over")
        return None
    from ..checkpoint.stripes import STRIPE_BYTES, StripedHandle, StripeSet
    stripes = StripeSet(folders, stripe_bytes=STRIPE_BYTES if stripe_bytes is None
                        else stripe_bytes)
    for side, handle in (("read_handle", read_handle), ("write_handle", write_handle)):
        if handle is not None and not (isinstance(handle, StripedHandle)
                                       and handle.folders == stripes.folders
                                       and handle.stripe_bytes == stripes.stripe_bytes):
            raise ValueError(f"{side} must be a StripedHandle over {stripes.folders} with "
                             f"stripe_bytes={stripes.stripe_bytes}, as the swapper stripes; "
                             f"got {_striping(handle)}")
    return stripes


def _striping(handle):
    folders = getattr(handle, "folders", None)
    if folders is None:
        return f"an unstriped {type(handle).__name__}"
    return f"one over {folders} with stripe_bytes={handle.stripe_bytes}"


def _remove_stale(folders):
    """The sub-folders that swappers of killed processes left in ``folders``, removed: a
    sub-folder is named by its process (Note [files named by their process] in
    checkpoint/commit.py), and only those of processes surely gone go."""
    for name, *writer in names_by_writer(folders[0], "swap-", "-[^/]+"):
        if writer_gone(*writer):
            for folder in folders:
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _fail(entry, why):
    entry.state, entry.tensor, entry.error = SwapState.FAILED, None, why

