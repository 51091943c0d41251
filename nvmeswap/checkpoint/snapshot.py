"""The snapshot of an asynchronous save: the one buffer a ``Checkpointer`` copies a
state's tensors into before the state may change, and what decides how it is taken.

Note [async checkpoint snapshot]: the caller's thread does only what must happen before
the state may change again: lay the archive out (the pickle, small) and copy each
tensor's bytes into one locked buffer at its place in the file, with torch's copy (which
releases the GIL and uses every core). The CRCs, the headers and the write run on a
thread of their own, whose work releases the GIL too (the CRC, nvmeswap's wait). The
buffer is the size of one checkpoint, kept for the next save; so that it stays one, a
save waits for the one before it. A one-off save's buffer is never used again: plain
memory. Locking fresh memory would keep the caller longer than a whole synchronous save
(0.7 s a GiB with 4 KiB pages, against 0.4-0.7 s for nvmeswap.save of it, measured
2026-11-26). Where saves go through the process's own queue (no handle given) every
snapshot is private memory, page-aligned, which the queue writes straight from; a given
handle stages a plain snapshot on the writing thread. Even unlocked, fresh memory costs
its page faults: the one-off copy of 1 GiB keeps the caller 0.50 to 0.60 s here, longer
than a synchronous save (0.46 s with ISA-L's CRC). Advised for huge pages it took 0.19
to 0.92 s (2026-11-27): fast only where free 2 MiB blocks were at hand, else the kernel
compacts memory for them first (this VM's balloon hands free memory back to its host),
so the snapshot keeps 4 KiB pages; ``background_snapshot`` is the form that returns at
once.

Note [packed snapshot]: for a state of many small tensors the layout is most of what
the caller waits for (0.05 to 0.1 s of a model's 758 tensors; their copy 0.03 s). Such a
state (its storages under PACKED_BELOW_MEAN_BYTES on average, and no CUDA tensors in a
one-off save, which are cloned instead) is copied as ``state_copy(aliases=True)``: new
containers holding, for each tensor, an alias over the same storage with the shape,
strides and offset it has at the call, which pickles to the same bytes; and each
storage's bytes are copied whole into the snapshot, one after another (memcpy). The
saving thread lays the aliases out, points each storage's run at its bytes in the
snapshot, and writes the image through the ring, a second copy of the state that costs
less than the layout did the caller. A storage resized in between fails the save.

Note [snapshot in the background]: with ``background_snapshot`` the copy moves to the
saving thread as well, as DCP's asynchronous staging does, and so does the layout: the
pickle of a state of many small tensors is most of a save's time (0.05-0.1 s of
0.15-0.2 s for a model's 758, 2026-11-27). The caller only copies the state's dicts,
lists and tuples (``state_copy``: 3 ms for those 758; a state holding other objects is
laid out in the caller, as before), so that what it changes in them from then on is not
saved, and returns; the tensors' copy overlaps its next forward and backward pass, and
it waits for ``snapshot_taken`` before the optimizer changes the tensors. Not waiting
would mix two states in one file, so every tensor reachable through ``obj``'s dicts,
lists and tuples is watched through torch's version counter (which every in-place op
bumps as it ends, optimizers' included; writes through ``.data``, numpy or another
process do not, and inference tensors have none), checked once the copy is made: a
save that sees one change fails instead of writing. An op still running then is not
seen (torch bumps the version as an op ends, and a change after ``snapshot_taken`` is
the caller's right: a later check could not tell the two apart). The copy still costs its CPU
time, and the layout holds the GIL: whatever runs beside them is slowed by about that
much (bench/checkpoint.py reports both; docs/checkpoints.md compares the layout's two
places).

Note [one-off snapshot of CUDA state]: a one-off save's snapshot is plain memory, and a
copy from the GPU into fresh pageable memory is slow (0.78 s for 1 GiB on an H100,
longer than the synchronous save, measured 2026-11-26). So where each GPU has room for
twice the state's tensors on it, the state is cloned where it lies instead (on the GPU a
device-to-device copy, a millisecond a GiB; host tensors on the host), and the saving
thread writes the clones as a synchronous save does, through the ring, then drops them.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from .._memory import copy_memory
from ..units import ALIGNMENT, round_up
from .crc import crc32
from .image import FileImage, TensorRun, uint8_view
from .own_queue import Registration, private_tensor
from .state import state_copy

#: Note [packed snapshot]: a layout takes about 60 us a tensor here (torch's pickler and
#: the record of its writer, 2026-11-27), a second copy of the snapshot through the ring
#: about 0.1 s a GiB; a state whose tensors' storages average fewer bytes than this is
#: laid out on the saving thread.
PACKED_BELOW_MEAN_BYTES = 640 << 10


class SaveFuture(Future):
    """An asynchronous save: ``result()`` is None once the checkpoint is durable under
    its name (or raises the failure); ``snapshot_taken``, a ``Future`` of its own, is
    done once the state's tensors are copied (or fails as the save does, if the copy
    does)."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshot_taken: Future = Future()
        self.snapshot_taken.set_running_or_notify_cancel()


def check_unchanged(watched: list[tuple[str, Any, int]], path: str) -> None:
    """Refuse a save whose tensors changed in place before their snapshot was complete:
    its checkpoint would mix two states (Note [snapshot in the background]). ``watched``
    holds ``(name, tensor, its version at the call)``."""
    changed = [name for name, tensor, version in watched if tensor._version != version]
    if changed:
        raise RuntimeError(
            f"{path}: not saved: {', '.join(sorted(changed)[:5])}"
            f"{' and others' if len(changed) > 5 else ''} changed before the snapshot was "
            "taken; wait for future.snapshot_taken before changing the state")


def packable(obj: Any, one_off: bool) -> tuple[Any, dict[int, Any]] | None:
    """Where an asynchronous save of ``obj`` should pack its snapshot (Note [packed
    snapshot]): the state of ``state_copy(obj, aliases=True)`` and its tensors'
    distinct storages; else None."""
    copied = state_copy(obj, aliases=True)
    if copied is None or not copied[1]:
        return None
    if one_off and any(tensor.is_cuda for _, tensor in copied[1]):
        return None         # cloned on the device instead (Note [one-off snapshot of CUDA state])
    storages = {}
    for _, tensor in copied[1]:
        storage = tensor.untyped_storage()
        storages.setdefault(storage._cdata, storage)
    if (sum(storage.nbytes() for storage in storages.values())
            >= len(storages) * PACKED_BELOW_MEAN_BYTES):
        return None
    return copied[0], storages


def room_on_device(image: FileImage) -> bool:
    """Whether ``image`` has CUDA runs and each of their devices has free memory for twice
    their bytes (Note [one-off snapshot of CUDA state])."""
    import torch

    wanted = image.cuda_bytes()
    return bool(wanted) and all(torch.cuda.mem_get_info(device)[0] >= 2 * nbytes
                                for device, nbytes in wanted.items())


def clone_runs(image: FileImage) -> None:
    """Every run of ``image`` cloned where it is (Note [one-off snapshot of CUDA state];
    the host ones too: the file holds the state as it was at the call), the copies on a
    GPU finished before the caller's later work, on any stream."""
    import torch

    for run in image.tensor_runs():
        run.source = run.source.clone()
    for device in image.cuda_bytes():
        torch.cuda.current_stream(device).synchronize()


class Snapshot:
    """The buffer a checkpointer's asynchronous saves copy their state into, kept and
    reused, grown when a later checkpoint is larger (Note [async checkpoint snapshot]).

    ``handle`` is the handle whose locked set a locked buffer is made in; where it is
    None the buffer is private memory, page-aligned, which the process's own queue
    writes straight from (registered with CUDA where locked and CUDA is in use: copies
    from a GPU into it are then DMA). Not thread-safe: the checkpointer's saves take
    turns.
    """

    def __init__(self, handle: Any = None) -> None:
        self._handle = handle
        self.tensor: Any = None                 # uint8, the whole buffer
        self._in_handle = False                 # in the handle's locked set: freed through it
        self._registration: Registration | None = None     # with CUDA

    def buffer(self, nbytes: int, locked: bool) -> Any:
        """The buffer, of at least ``nbytes`` (made or grown now if smaller)."""
        import torch

        if self.tensor is None or self.tensor.numel() < nbytes:
            self.free()
            size = round_up(max(nbytes, 1), ALIGNMENT)
            if self._handle is None:
                self.tensor = private_tensor(size, locked=locked)
                if locked:
                    self._registration = Registration(self.tensor)
            elif locked:
                self.tensor = self._handle.new_cpu_locked_tensor(
                    size, torch.empty(0, dtype=torch.uint8))
                self._in_handle = True
            else:
                self.tensor = torch.empty(size, dtype=torch.uint8)
        elif self._registration is not None:
            self._registration.ensure()     # CUDA may have come into use since
        return self.tensor

    def copy_image(self, image: FileImage, locked: bool) -> None:
        """Each tensor run of ``image`` copied to its place in the file, in the buffer,
        which is its source from then on."""
        snapshot = self.buffer(image.size, locked)
        for offset, run in image.runs:
            if isinstance(run, TensorRun):
                snapshot[offset:offset + run.nbytes].copy_(run.source)
                run.source = None

    def pack(self, storages: dict[int, Any], locked: bool) -> dict[int, tuple[int, int]]:
        """Each of ``storages`` (by ``_cdata``) copied whole into the buffer, one after
        the other (Note [packed snapshot]); ``(offset, nbytes)`` of each, by storage."""
        places, size = {}, 0
        for key, storage in storages.items():
            places[key] = (size, storage.nbytes())
            size += round_up(storage.nbytes(), 64)
        snapshot = self.buffer(size, locked)
        address = snapshot.data_ptr()
        for key, storage in storages.items():
            start, nbytes = places[key]
            if not nbytes:
                continue
            if storage.device.type == "cpu":
                # memcpy: torch's copy wakes its threads for each small storage, and
                # waits for them where the cores are busy (0.08 against 1 s for 758).
                copy_memory(address + start, storage.data_ptr(), nbytes)
            else:
                snapshot[start:start + nbytes].copy_(uint8_view(storage))
        return places

    def seal(self, image: FileImage) -> None:
        """Complete the file ``copy_image`` put ``image``'s tensors of in the buffer: each
        run's CRC, then the header runs at their places."""
        view = memoryview(self.tensor.numpy())
        try:
            for offset, run in image.runs:
                if isinstance(run, TensorRun):
                    run.set_crc(crc32(view[offset:offset + run.nbytes]))
            for offset, run in image.runs:
                if not isinstance(run, TensorRun):
                    view[offset:offset + len(run)] = run
        finally:
            view.release()

    def free(self) -> None:
        """Let the buffer go (out of the handle's locked set, and CUDA's registration)."""
        registration, self._registration = self._registration, None
        if registration is not None:
            registration.release()
        tensor, self.tensor = self.tensor, None
        in_handle, self._in_handle = self._in_handle, False
        if tensor is not None and in_handle:
            self._handle.free_cpu_locked_tensor(tensor)

    def forget_parent(self) -> None:
        """In a forked child: the buffer is the parent's (registered with CUDA there,
        perhaps not mapped here as it was); the child makes its own at its first use."""
        self.tensor = self._registration = None
        self._in_handle = False
