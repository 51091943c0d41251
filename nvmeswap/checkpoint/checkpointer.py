"""``Checkpointer``: one handle, one ring of locked buffers and one snapshot buffer, reused
by every save and load made through it; the module functions make a short-lived one.
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future
from typing import Any

from ..aio import aio_handle
from ..gpu.copies import mark_queued_work
from ..io import process_state
from ..io.interrupts import deferred_interrupts
from ..units import ALIGNMENT, round_up
from . import loading
from . import safetensors as safetensors_format
from .image import FileImage, StreamWriter
from .queue_reader import reader_of
from .queue_writer import QueueWriter
from .snapshot import (
    SaveFuture,
    Snapshot,
    check_unchanged,
    clone_runs,
    packable,
    room_on_device,
)
from .state import paused_gc, state_copy, state_tensors
from .striped_checkpoints import check_striped_path, write_committed
from .stripes import STRIPE_BYTES, StripedHandle, StripeSet
from .torch_zip import layout, refuse_skip_data

#: The ring a synchronous save copies through (Note [streamed checkpoint writes]).
CHUNK_BYTES = 16 << 20
ONE_CALL_CHUNK_BYTES = 2 << 20     # a ring's chunks where none are asked for (ring_shape)
CHUNKS = 4
#: The handle a checkpointer given none makes when its ``handle`` is asked for.
HANDLE_ARGS = {"intra_op_parallelism": 2}


def checked_path(path: Any, *, writing: bool) -> str:
    """``path`` as a str (to write: absolute, as the working folder is at the call, and
    the file a symbolic link names); before any I/O, the error that the I/O would meet
    (naming the file or folder) for a missing file to read or a missing folder to write
    into."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint path must be a str or os.PathLike, got "
                        f"{type(path).__name__}")
    path = os.fspath(path)
    if not path:
        raise FileNotFoundError(2, "No such file or directory", path)
    if writing:
        if path.endswith((os.sep, os.altsep or os.sep)):
            raise NotADirectoryError(20, "A checkpoint is a file: its path cannot end in "
                                         f"{os.sep}", path)
        if os.path.islink(path):
            # As torch.save, whose open() follows the link: the file it names is replaced
            # (renamed over in its own folder), the link kept.
            path = os.path.realpath(path)
        # Absolute now: an async save writes after its call, wherever the process has
        # gone since.
        path = os.path.abspath(path)
        folder = os.path.dirname(path)
        if not os.path.isdir(folder):
            raise FileNotFoundError(2, "No such folder to write the checkpoint into", folder)
        if os.path.isdir(path):
            raise IsADirectoryError(21, "Is a directory", path)
    else:
        os.stat(path)                   # FileNotFoundError / PermissionError naming it
        if os.path.isdir(path):
            raise IsADirectoryError(21, "Is a directory", path)
    return path


def ring_shape(chunk_bytes: int | None, chunks: int, image: FileImage,
               striped: bool) -> tuple[int, int]:
    """``(chunk_bytes, chunks)`` of a ring; where ``chunk_bytes`` is None, no larger than
    ``image`` needs (no more chunks than it fills) and small: a ring is locked, page by
    page, for a one-call save too. Chunks of ONE_CALL_CHUNK_BYTES made one-call saves
    faster than CHUNK_BYTES (2026-11-27, one process alternating: 1 GiB 0.417 -> 0.371
    s, a model's 758 tensors 0.231 -> 0.174 s on the memory-backed device; 256 MiB 0.98
    -> 0.81 s on the virtio disk); a striped ring keeps chunks that span its devices."""
    if chunk_bytes is not None:
        return chunk_bytes, chunks
    largest = CHUNK_BYTES if striped else ONE_CALL_CHUNK_BYTES
    chunk_bytes = min(largest, max(1 << 20, round_up(-(-image.size // chunks), ALIGNMENT)))
    return chunk_bytes, max(1, min(chunks, -(-image.size // chunk_bytes)))


class QueueCheckpointer:
    """The saves of a ``Checkpointer`` given no handle, through the process's own queue:
    ``write_image`` (Note [saves without a handle] in queue_writer.py) and ``write_buffer``,
    striped over ``stripes`` (a StripeSet) if given. Its ring is ``chunks`` buffers of
    ``chunk_bytes``, by default no larger than the first image needs. A context
    manager; ``close()`` waits for what is in flight. A forked child that goes on using
    one (a kept Checkpointer's) gets a queue and a ring of its own."""

    def __init__(self, chunk_bytes: int | None = None, chunks: int = CHUNKS,
                 stripes: StripeSet | None = None) -> None:
        self._chunk_bytes, self._chunks = chunk_bytes, chunks
        self._stripes = stripes
        self._queue: QueueWriter | None = None
        self._writer: StreamWriter | None = None
        process_state.forget_in_child(self)

    def forget_parent(self):
        """In a forked child, leave the parent's queue and ring to it (closing only the
        child's copies of its files' descriptors; the rest goes with their objects): the
        child's are made at its first use."""
        if self._queue is not None:
            self._queue.close_files()
        self._queue = self._writer = None

    def write_image(self, image: FileImage, path: str) -> None:
        """Write ``image`` to ``path`` through a private ring, crash-consistently."""
        if self._writer is None:
            # A ring no larger than the first image needs: it is locked, page by page.
            self._writer = StreamWriter(self._queue_writer(path), *ring_shape(
                self._chunk_bytes, self._chunks, image, self._stripes is not None))
        else:   # a kept ring: CUDA may have come into use since it was made
            self._queue_writer(path).ensure_registered()
        writer = self._writer
        write_committed(self._stripes, image.size, path, lambda name: writer.write(image, name))

    def write_buffer(self, buffer: Any, size: int, path: str) -> None:
        """Write the first ``size`` bytes of ``buffer`` (page-aligned: a snapshot) to
        ``path`` straight from it, crash-consistently."""
        queue = self._queue_writer(path)

        def write(name):
            if size:
                queue.submit_pwrite(buffer[:size], name, 0).result()
        write_committed(self._stripes, size, path, write)

    def _queue_writer(self, path):
        if self._queue is None:
            self._queue = QueueWriter(f"writing {path}", self._stripes)
        return self._queue

    def close(self) -> None:
        try:
            if self._queue is not None:
                self._queue.close()     # waits for the requests in flight, before their ring
        finally:
            if self._writer is not None:
                self._writer.close()

    def __enter__(self) -> QueueCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Checkpointer:
    """Saves and loads checkpoints, keeping what moves their bytes (a handle, or the
    process's own queue) and its buffers from one checkpoint to the next.

    Parameters
    ----------
    handle : aio_handle, optional
        The handle to move the bytes with; by default none (the process's own queue,
        below), and one of its own (``intra_op_parallelism=2``, closed by ``close()``)
        only if ``handle`` is asked for. A given handle is left open.
    chunk_bytes, chunks : int
        The ring of locked buffers a synchronous save copies through (default 4 x 16 MiB);
        the only memory a synchronous save locks. ``chunk_bytes=None``: chunks no larger
        than the first checkpoint needs, at most 2 MiB unless striped (as the one-call
        ``nvmeswap.save`` makes).
    stripe_folders : sequence of folders, optional
        Stripe every checkpoint over these folders, one per device (Note [stripes]), with
        ``stripe_bytes`` a stripe (default 4 MiB): saves go to a path in the first folder,
        which then holds the layout (Note [striped checkpoints]). ``load`` reads striped
        checkpoints whatever the checkpointer.

    Without a handle nothing starts one: the ring and the snapshots are private memory
    written by the process's own queue, to every stripe folder at once (Note [saves
    without a handle]), and loads read with it too, into fresh private memory (Note
    [fresh private reads]) or, for ``load_into``, through a ring of the call's own; where
    CUDA is in use, what copies to or from a GPU go through is registered with it (Note
    [own queue and CUDA]). ``handle`` makes one when asked for. ``async_save`` snapshots
    into one locked buffer of the checkpoint's size, kept and reused by later saves
    (grown if a later checkpoint is larger).
    ``close()`` waits for a save in flight, then frees the buffers. A context manager.
    """

    def __init__(self, handle: aio_handle | StripedHandle | None = None, *,
                 chunk_bytes: int | None = CHUNK_BYTES, chunks: int = CHUNKS,
                 stripe_folders: Any = None, stripe_bytes: int = STRIPE_BYTES) -> None:
        if handle is not None and not isinstance(handle, (aio_handle, StripedHandle)):
            raise TypeError(f"handle must be an nvmeswap aio_handle or StripedHandle, got "
                            f"{type(handle).__name__}")
        if handle is not None and stripe_folders is not None:
            raise ValueError("give a handle or stripe_folders, not both")
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int)
                                        or chunk_bytes < ALIGNMENT):
            raise ValueError(f"chunk_bytes must be None or an int of at least {ALIGNMENT}, got "
                             f"{chunk_bytes!r}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        self._stripes = StripeSet(stripe_folders, stripe_bytes=stripe_bytes) \
            if stripe_folders is not None else \
            handle if isinstance(handle, StripedHandle) else None
        # Given none, a handle of its own is made only if ``handle`` is asked for.
        self._given = self._handle = handle
        self._handle_lock = threading.Lock()
        self._chunk_bytes, self._chunks = chunk_bytes, chunks
        self._writer: StreamWriter | None = None
        self._saver: QueueCheckpointer | None = None     # the saves by the own queue
        self._snapshot = Snapshot(handle)
        self._in_flight: Future | None = None
        self._freed = False
        self._lock = threading.Lock()           # one write at a time
        self._snapshot_lock = threading.Lock()  # one snapshot started at a time
        self.closed = False
        process_state.forget_in_child(self)

    def _save_path(self, path: Any) -> str:
        """``checked_path(path, writing=True)``, in the first stripe folder where striped."""
        path = checked_path(path, writing=True)
        if self._stripes is not None:
            check_striped_path(self._stripes, path)
        return path

    @property
    def handle(self) -> aio_handle | StripedHandle:
        """The handle given, or one of its own (made now if not yet)."""
        with self._handle_lock:
            if self._handle is None:
                self._check_open()
                self._handle = aio_handle(**HANDLE_ARGS) if self._stripes is None else \
                    StripedHandle(self._stripes.folders, stripe_bytes=self._stripes.stripe_bytes,
                                  **HANDLE_ARGS)
            return self._handle

    # -- torch.save format -------------------------------------------------------------
    def save(self, obj: Any, path: str | os.PathLike) -> None:
        """Write ``obj`` as ``torch.save`` would (with 4096-aligned storages), whole or not
        at all (Note [crash-consistent checkpoints])."""
        self._check_open()
        path = self._save_path(path)
        self.wait_in_flight()   # in program order: an older async save never renames last
        with paused_gc():   # Note [laying out many tensors]: the write makes as many
            self.write_image(layout(obj), path)

    def write_image(self, image: FileImage, path: str) -> None:
        """Write ``image`` to ``path`` through the ring, crash-consistently."""
        with self._lock:
            # Not once close() has freed the buffers: a ring made now would be kept. (A
            # save in flight is written before they are freed: close() waits for it.)
            if self._freed:
                raise ValueError("this Checkpointer is closed")
            saver = self._own_queue_saver()
            if saver is not None:
                saver.write_image(image, path)
                return
            if self._writer is None:
                self._writer = StreamWriter(self.handle, *ring_shape(
                    self._chunk_bytes, self._chunks, image, self._stripes is not None))
            writer = self._writer
            write_committed(self._stripes, image.size, path,
                            lambda name: writer.write(image, name))

    def _load_handle(self) -> aio_handle | StripedHandle | None:
        """The handle that loads read with (into its locked set), or None where no
        handle was given: the process's own queue reads, into
        fresh private memory or through a ring of the call's own (as ``nvmeswap.load``
        and ``load_into`` without a handle)."""
        return None if self._given is None else self.handle

    def reader(self) -> contextlib.AbstractContextManager[Any]:
        """What reads into given tensors (``async_pread``, ``sync_pread``, ``wait``) for
        the time of the block: the handle, or where none was given a ``QueueReader`` of
        the process's own queue, closed after it (``reader_of``)."""
        self._check_open()
        return reader_of(self._load_handle())

    def _own_queue_saver(self) -> QueueCheckpointer | None:
        """What saves through the process's own queue (made at its first use), where
        they go that way: no handle was given."""
        if self._given is not None:
            return None
        if self._saver is None:
            self._saver = QueueCheckpointer(self._chunk_bytes, self._chunks, self._stripes)
        return self._saver

    def load(self, path: str | os.PathLike, map_location: Any = None, *,
             weights_only: bool = True) -> Any:
        """Read a torch.save archive (ours or torch's); CPU storages land in locked
        buffers (Note [checkpoint reads]): in the handle's locked set, which
        ``free(result)`` takes them out of, or without a handle in
        fresh private memory, as ``nvmeswap.load``'s."""
        self._check_open()
        path = checked_path(path, writing=False)
        return loading.load_locked(path, self._load_handle(), map_location, weights_only)

    def load_into(self, path: str | os.PathLike, into: Any, *, strict: bool = True) -> Any:
        """Read each tensor of a torch.save archive straight into the matching tensor of
        ``into`` (a state dict, nested dicts/lists allowed); returns ``into``."""
        self._check_open()
        path = checked_path(path, writing=False)
        return loading.load_into(path, into, self._load_handle(), strict)

    def free(self, obj: Any) -> int:
        """Take the locked buffers holding the tensors of ``obj`` (as ``load`` returns it:
        nested dicts, lists, tuples) out of the process's locked set; how many there
        were. The tensors stay valid; their memory goes with the last of them. Loads made
        without a handle are in no set: none."""
        self._check_open()
        handle = self._load_handle()
        if handle is None:
            return 0
        return sum(handle.free_cpu_locked_tensor(tensor) for _, tensor in
                   state_tensors(obj) if tensor.device.type == "cpu" and tensor.numel())

    # -- safetensors ---------------------------------------------------------------------
    def save_safetensors(self, tensors: dict, path: str | os.PathLike,
                         metadata: dict | None = None) -> None:
        """Write a flat dict of tensors as a safetensors file (Note [aligned
        safetensors]), crash-consistently; the ``safetensors`` package reads it, unless
        this checkpointer stripes (Note [striped checkpoints]: ``path`` then holds the
        layout, which nvmeswap's loads follow)."""
        self._check_open()
        path = self._save_path(path)
        self.wait_in_flight()
        with paused_gc():   # Note [laying out many tensors]
            self.write_image(safetensors_format.layout(tensors, metadata), path)

    def load_safetensors(self, path: str | os.PathLike) -> dict:
        """Read a safetensors file (ours or the package's) into locked CPU tensors."""
        self._check_open()
        path = checked_path(path, writing=False)
        return safetensors_format.load_locked(path, self._load_handle())

    def load_safetensors_into(self, path: str | os.PathLike, into: dict, *,
                              strict: bool = True) -> dict:
        """Read each tensor of a safetensors file straight into the tensor of the same
        name in ``into``; returns ``into``."""
        self._check_open()
        path = checked_path(path, writing=False)
        return safetensors_format.load_into(path, into, self._load_handle(), strict)

    # -- asynchronous --------------------------------------------------------------------
    @paused_gc()    # for the caller's part only (Note [laying out many tensors])
    def async_save(self, obj: Any, path: str | os.PathLike, *, one_off: bool = False,
                   background_snapshot: bool = False) -> SaveFuture:
        """Snapshot ``obj``'s tensors into locked memory, then write in the background.

        Returns a ``SaveFuture`` (a ``concurrent.futures.Future``): ``result()`` gives
        None when the checkpoint is durable under its name, or raises the failure; its
        ``snapshot_taken`` future is done once every tensor's bytes are copied, and from
        then on ``obj`` may change. By default the copy is made before this call returns.
        ``background_snapshot``: the copy too is made on the saving thread, so the call
        returns at once and the caller waits, if at all, at
        ``future.snapshot_taken.result()``, which must come before ``obj``'s tensors change
        (before the optimizer's step, say: Note [snapshot in the background]). One save is
        in flight at a time: a save starts once the one before is written (Note [async
        checkpoint snapshot]). ``one_off``: close this checkpointer once the save is done,
        before the future is; the snapshot is then plain memory, not locked.
        """
        self._check_open()
        path = self._save_path(path)
        # Notes [async checkpoint snapshot], [packed snapshot], [snapshot in the
        # background] and [one-off snapshot of CUDA state] in snapshot.py.
        refuse_skip_data()      # this thread's setting: the saving thread would not see it
        image, named, storages = None, [], None
        if background_snapshot and (copied := state_copy(obj)) is not None:
            obj, named = copied             # what the saving thread lays out
        elif not background_snapshot and (packed := packable(obj, one_off)) is not None:
            obj, storages = packed          # what the saving thread lays out, and packs
        else:
            image = layout(obj)
            if background_snapshot:
                named = list(state_tensors(obj))
        write = self._write_from_snapshot
        future = SaveFuture()
        future.set_running_or_notify_cancel()
        # Saves from several threads take turns: each is snapshotted after the save
        # before it is written (or, with background_snapshot, chained after it), never
        # two copies into the one buffer at once; close() takes the lock too.
        with self._snapshot_lock:
            self._check_open()
            if background_snapshot:
                watched = [(name, tensor, tensor._version) for name, tensor in named
                           if not tensor.is_inference()]
                # CUDA tensors: the copy must see the work queued for them so far, whatever
                # stream the saving thread copies on (Note [stream order]).
                queued = [mark_queued_work(device)
                          for device in {tensor.device for _, tensor in named if tensor.is_cuda}]
                previous, self._in_flight = self._in_flight, future

                def take():
                    if previous is not None:
                        previous.exception()        # its error stays with its own future
                    for event in queued:
                        event.synchronize()
                    if self._freed:     # by a one-off save before it
                        raise ValueError("this Checkpointer is closed")
                    taken = image if image is not None else layout(obj)
                    self._snapshot.copy_image(taken, locked=not one_off)
                    check_unchanged(watched, path)
                    return taken
            else:
                self.wait_in_flight()
                self._check_open()      # a one-off save before it closes this checkpointer
                if storages is not None:
                    places = self._snapshot.pack(storages, locked=not one_off)
                    snapshot = self._snapshot.tensor

                    def write(_, path):
                        self._write_packed(obj, snapshot, places, path)
                elif one_off and room_on_device(image):
                    clone_runs(image)
                    write = self.write_image        # from the clones, through the ring
                else:
                    self._snapshot.copy_image(image, locked=not one_off)
                future.snapshot_taken.set_result(None)
                self._in_flight = future
                take = None
            thread = threading.Thread(target=self._save_in_background,
                                      args=(image, path, future, one_off, take, write),
                                      name="nvmeswap-async-save")
            # Not a daemon: a save still in flight when the program ends is finished (the
            # interpreter waits for it) rather than lost, or cut off in torch's code.
            try:
                with deferred_interrupts():     # a Ctrl-C in start() leaves it started
                    thread.start()
            except BaseException as failure:
                if thread.ident is None:        # no thread (RuntimeError): no save in flight
                    for pending in (future.snapshot_taken, future):
                        if not pending.done():
                            pending.set_exception(failure)
                raise
        return future

    def _write_packed(self, state, snapshot, places, path):
        """``state`` (the call's aliases of the tensors) laid out, each storage's bytes
        taken from its place in ``snapshot``, written through the ring (Note [packed
        snapshot])."""
        image = layout(state)
        laid_out = set()
        for run in image.tensor_runs():
            key = run.source.untyped_storage()._cdata
            start, nbytes = places[key]
            if nbytes != run.nbytes:
                raise _resized(path)
            run.source = snapshot[start:start + nbytes]
            laid_out.add(key)
        if any(nbytes and key not in laid_out for key, (_, nbytes) in places.items()):
            raise _resized(path)    # to nothing (freed, as FSDP frees): no run, no bytes
        self.write_image(image, path)

    def _save_in_background(self, image, path, future, one_off, take, write):
        """The saving thread: the snapshot first if ``take`` makes it here (and the
        image, if not given: Note [snapshot in the background]), then ``write(image,
        path)``."""
        error = None
        try:
            if take is not None:
                try:
                    image = take()
                except BaseException as failure:
                    future.snapshot_taken.set_exception(failure)
                    raise
                future.snapshot_taken.set_result(None)
            write(image, path)
        except BaseException as failure:
            error = failure
        if one_off or self.closed:
            # Closed meanwhile: a close() interrupted while it waited left the freeing here.
            if one_off:
                self._in_flight = None
            try:
                self._close_after_one_off()
            except BaseException as failure:
                error = error or failure
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)

    def _write_from_snapshot(self, image, path):
        """The CRCs and headers into the snapshot, then the snapshot to ``path``."""
        self._snapshot.seal(image)
        snapshot = self._snapshot.tensor
        with self._lock:
            saver = self._own_queue_saver()
            if saver is not None:
                saver.write_buffer(snapshot, image.size, path)
                return

            def write(name):
                if image.size:
                    self.handle.sync_pwrite(snapshot[:image.size], name)
            write_committed(self._stripes, image.size, path, write)

    def wait_in_flight(self) -> None:
        """Wait for the asynchronous save in flight, if any (its error stays with its
        future). It stays the save in flight: the next one waits for it too."""
        future = self._in_flight
        if future is not None:
            future.exception()

    # -- lifetime ------------------------------------------------------------------------
    def forget_parent(self):
        """In a forked child: the parent's saving thread is not here, and the locks it or
        another thread held at the fork would stay held for ever."""
        self._lock = threading.Lock()
        self._handle_lock = threading.Lock()
        self._snapshot_lock = threading.Lock()
        self._in_flight = None
        self._snapshot.forget_parent()

    def _check_open(self):
        if self.closed:
            raise ValueError("this Checkpointer is closed")

    def close(self) -> None:
        """Wait for a save in flight, free the buffers, close the handle if it is ours."""
        with self._snapshot_lock:       # no asynchronous save starts from now on
            if self.closed:
                return
            self.closed = True
        # Not under the lock: a one-off save's thread closes it too (and an async_save
        # of another thread may hold the lock, waiting for the save in flight).
        future = self._in_flight
        try:
            self.wait_in_flight()
        except BaseException:
            # Interrupted (Ctrl-C) with the save still writing from the buffers: its thread
            # frees them once it ends, having seen this checkpointer closed.
            if future is None or future.done():
                with self._lock:
                    self._free_buffers()
            raise
        with self._lock:        # nor does a synchronous save write meanwhile
            self._free_buffers()

    def _close_after_one_off(self):
        """The one-off save's thread, its save written: closed, the buffers freed."""
        self.closed = True
        with self._lock:
            self._free_buffers()

    def _free_buffers(self):
        """Free the ring, the own queue's saver, the snapshot and the handle if it is
        ours; idempotent."""
        self._freed = True
        try:
            if self._saver is not None:
                self._saver.close()
            if self._writer is not None:
                self._writer.close()
        finally:
            self._writer = self._saver = None
            try:
                self._snapshot.free()
            finally:
                if self._given is None and self._handle is not None:
                    handle, self._handle = self._handle, None
                    handle.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _resized(path):
    return RuntimeError(f"{path}: not saved: a tensor's storage was resized (or freed) "
                        "before the save was written; resize storages after result()")
