"""Swapping tensors out to files and back: the layer ZeRO-Infinity style offload needs.

``TensorSwapper`` keeps, per key, where a tensor is (in memory, being written, on disk,
being read) and moves it with two handles, one for reads and one for writes, so that a
prefetch never waits behind a write-back. ``SwapBufferPool`` is a set of locked buffers
allocated once, for callers that swap the same sizes over and over.
"""
import enum
import os
import re

from ..aio import aio_handle
from ..io.files import ALIGNMENT
from ..io.regions import round_up


class SwapState(enum.Enum):
    IN_MEMORY = "in memory"
    WRITING = "being written"
    ON_DISK = "on disk"
    READING = "being read"


class SwapError(RuntimeError):
    """A swap finished with other counts or sizes than were started."""


class SwapBufferPool:
    """``count`` locked, page-aligned buffers of ``nbytes`` each, allocated once.

    ``get()`` checks one out (zeroed if ``zero``), ``put()`` returns it; ``close()``
    frees them all. I/O on them is zero-copy for the handle that made them.
    """

    def __init__(self, handle, count, nbytes, *, zero=False):
        import torch
        self._handle = handle
        self._zero = zero
        self._all = [handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
                     for _ in range(count)]
        self._free = list(self._all)
        self.nbytes = nbytes

    def get(self):
        if not self._free:
            raise RuntimeError(f"all {len(self._all)} swap buffers are in use")
        buffer = self._free.pop()
        if self._zero:
            buffer.zero_()
        return buffer

    def put(self, buffer):
        if not any(buffer is mine for mine in self._all):
            raise ValueError("this buffer does not belong to the pool")
        if any(buffer is free for free in self._free):
            raise ValueError("this buffer was returned already")
        self._free.append(buffer)

    @property
    def available(self):
        return len(self._free)

    def close(self):
        for buffer in self._all:
            self._handle.free_cpu_locked_tensor(buffer)
        self._all, self._free = [], []


class _Entry:
    __slots__ = ("path", "offset", "shape", "dtype", "nbytes", "state", "tensor")

    def __init__(self, path, offset, shape, dtype, nbytes):
        self.path = path
        self.offset = offset
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.state = SwapState.IN_MEMORY
        self.tensor = None      # held while an operation on it is in flight


class TensorSwapper:
    """Swap tensors of any size and dtype to files in ``folder``, one file per key.

    Parameters
    ----------
    folder : str
        Where the swap files go; created if missing. Files are removed by ``release``
        and ``close``.
    read_handle, write_handle : aio_handle, optional
        The handles to use; by default two of its own (``**handle_args``) that share
        their locked memory, so reads are never queued behind writes and tensors from
        ``new_locked_tensor`` are zero-copy both ways.
    pack_below : int
        Tensors smaller than this many bytes share one pack file, each in an aligned
        slot that it keeps when swapped out again; their writes wait until
        ``synchronize_writes()`` and go out as one write per run of adjacent slots
        (write-behind batching). 0 (default): one file per tensor.
    """

    def __init__(self, folder, read_handle=None, write_handle=None, *, pack_below=0,
                 **handle_args):
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self._own = [h is None for h in (read_handle, write_handle)]
        self.read_handle = read_handle or aio_handle(**handle_args)
        self.write_handle = write_handle or aio_handle(
            **handle_args, share_locked_memory_with=self.read_handle if self._own[0] else None)
        self._entries = {}
        self._reading = []
        self._writing = []
        self.pack_below = pack_below
        self._pack_path = os.path.join(folder, "pack.swp")
        self._pack_end = 0
        self._slots = {}            # packed key -> (offset, capacity) in the pack file
        self._batched = []          # packed keys written at the next synchronize_writes
        self._batch_buffers = []    # staging of the batched writes in flight

    def new_locked_tensor(self, nbytes):
        """A locked uint8 tensor that both of the swapper's handles move without a copy."""
        import torch
        return self.read_handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))

    def free_locked_tensor(self, tensor):
        self.read_handle.free_cpu_locked_tensor(tensor)

    def state(self, key):
        return self._entries[key].state

    def swap_out(self, key, tensor, async_op=True):
        """Write ``tensor`` under ``key``. The tensor must not change until
        ``synchronize_writes()`` (async) or this call (sync) returns."""
        entry = self._entries.get(key)
        if entry is not None and entry.state in (SwapState.WRITING, SwapState.READING):
            raise RuntimeError(f"swap key {key!r} is {entry.state.value}; synchronize first")
        flat = _as_bytes(tensor)
        packed = 0 < flat.numel() < self.pack_below
        path, offset = (self._pack_path, self._slot(key, flat.numel())) if packed else \
            (self._path_of(key), 0)
        entry = _Entry(path, offset, tuple(tensor.shape), tensor.dtype, flat.numel())
        self._entries[key] = entry
        if entry.nbytes == 0:
            entry.state = SwapState.ON_DISK         # nothing to write
        elif packed:
            entry.state, entry.tensor = SwapState.WRITING, flat
            self._writing.append(key)
            self._batched.append(key)
            if not async_op:
                self.synchronize_writes()
        elif async_op:
            entry.state, entry.tensor = SwapState.WRITING, flat
            self._writing.append(key)
            self.write_handle.async_pwrite(flat, entry.path)
        else:
            self.write_handle.sync_pwrite(flat, entry.path)
            entry.state = SwapState.ON_DISK

    def swap_in(self, key, out=None, async_op=True):
        """Read ``key`` into ``out`` (or a new tensor of its shape and dtype) and return it;
        with ``async_op`` the data is there after ``synchronize_reads()`` (a prefetch)."""
        import torch
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"nothing swapped out under {key!r}")
        if entry.state is not SwapState.ON_DISK:
            raise RuntimeError(f"swap key {key!r} is {entry.state.value}, not on disk")
        if out is None:
            out = torch.empty(entry.shape, dtype=entry.dtype)
        flat = _as_bytes(out)
        if flat.numel() != entry.nbytes:
            raise ValueError(f"swap key {key!r} holds {entry.nbytes} bytes; the output "
                             f"tensor has {flat.numel()}")
        if entry.nbytes == 0:
            entry.state = SwapState.IN_MEMORY
        elif async_op:
            entry.state, entry.tensor = SwapState.READING, flat
            self._reading.append(key)
            self.read_handle.async_pread(flat, entry.path, entry.offset)
        else:
            self.read_handle.sync_pread(flat, entry.path, entry.offset)
            entry.state = SwapState.IN_MEMORY
        return out

    def synchronize_writes(self):
        """Wait for every swap_out; check that all of them, and all their bytes, landed.

        A key whose file came up short is forgotten (its file deleted) and named in the
        SwapError; the caller still holds the tensor and can swap it out again.
        """
        keys, self._writing = self._writing, []
        started = len(keys) - len(self._batched) + self._write_batches()
        done = self.write_handle.wait()
        self._batch_buffers = []
        problems = [] if done == started else [f"{done} writes completed, {started} were "
                                               "started"]
        for key in keys:
            entry = self._entries[key]
            entry.tensor = None
            size = os.stat(entry.path).st_size - entry.offset if entry.nbytes else 0
            entry.state = SwapState.ON_DISK
            if size < entry.nbytes:
                problems.append(f"swap file {entry.path} has {size} bytes, expected "
                                f"{entry.nbytes}")
                self.release(key)
        if problems:
            raise SwapError("; ".join(problems))
        return done

    def synchronize_reads(self):
        """Wait for every swap_in; check the count and that every byte arrived."""
        keys, self._reading = self._reading, []
        done = self.read_handle.wait()
        problems = [] if done == len(keys) else [f"{done} reads completed, {len(keys)} were "
                                                 "started"]
        for key in keys:
            entry = self._entries[key]
            if entry.tensor.numel() != entry.nbytes:
                problems.append(f"swap key {key!r} read {entry.tensor.numel()} bytes, "
                                f"expected {entry.nbytes}")
            entry.tensor = None
            entry.state = SwapState.IN_MEMORY
        if problems:
            raise SwapError("; ".join(problems))
        return done

    def release(self, key):
        """Forget ``key`` and delete its file."""
        entry = self._entries[key]
        if entry.state in (SwapState.WRITING, SwapState.READING):
            raise RuntimeError(f"swap key {key!r} is {entry.state.value}; synchronize first")
        del self._entries[key]
        if self._slots.pop(key, None) is None and os.path.exists(entry.path):
            os.unlink(entry.path)

    def _slot(self, key, nbytes):
        """The key's place in the pack file: the one it had if it still fits."""
        offset, capacity = self._slots.get(key, (0, 0))
        if capacity < nbytes:
            capacity = round_up(nbytes, ALIGNMENT)
            offset, self._pack_end = self._pack_end, self._pack_end + capacity
            self._slots[key] = (offset, capacity)
        return offset

    def _write_batches(self):
        """Write the batched tensors, one write per run of adjacent slots; return how many."""
        import torch
        keys = sorted(self._batched, key=lambda k: self._slots[k][0])
        self._batched = []
        runs = []
        for key in keys:
            offset, capacity = self._slots[key]
            if runs and runs[-1][-1][0] + runs[-1][-1][1] == offset:
                runs[-1].append((offset, capacity, key))
            else:
                runs.append([(offset, capacity, key)])
        for run in runs:
            start = run[0][0]
            staging = torch.zeros(run[-1][0] + run[-1][1] - start, dtype=torch.uint8)
            for offset, _, key in run:
                flat = self._entries[key].tensor
                staging[offset - start:offset - start + flat.numel()] = flat
            self._batch_buffers.append(staging)
            self.write_handle.async_pwrite(staging, self._pack_path, start)
        return len(runs)

    def close(self):
        if self._writing:
            self.synchronize_writes()
        if self._reading:
            self.synchronize_reads()
        for key in list(self._entries):
            self.release(key)
        if os.path.exists(self._pack_path):
            os.unlink(self._pack_path)
        for own, handle in zip(self._own, (self.read_handle, self.write_handle)):
            if own:
                handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _path_of(self, key):
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(key))
        return os.path.join(self.folder, f"{safe}.{abs(hash(key)) & 0xFFFFFF:06x}.swp")


def _as_bytes(tensor):
    """The tensor's bytes as a flat uint8 view (the swap files hold raw bytes)."""
    import torch
    if not tensor.is_contiguous():
        raise ValueError("swap needs a contiguous tensor")
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else \
        torch.empty(0, dtype=torch.uint8)
