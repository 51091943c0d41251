"""``nvmeswap.aio_handle``: DeepNVMe's aio_handle, the public face of the scheduler.

Every method checks its arguments and hands the call to ``io.scheduler.Scheduler``,
which runs it on a pool of worker processes (kernel AIO, without the GIL).
"""
from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Union

from .config import handle_arguments
from .errors import MemoryBudgetError
from .io.engines import checked_engine, resolve
from .io.futures import Future
from .io.limits import DEFAULT as DEFAULT_LIMITS
from .io.limits import Limits
from .io.operation import checked_bool, checked_int
from .io.placement import HostPlacement
from .io.reaper import reaper
from .io.regions import locked_memory
from .io.scheduler import Scheduler
from .locked_tensors import free_locked_tensor, is_locked, new_locked_tensor
from .units import ALIGNMENT, SECTOR, round_up
from .workers.protocol import EngineSettings

MAX_QUEUE_DEPTH = 1024
MAX_BLOCK_SIZE = 1 << 30
MIN_STAGING_BYTES = 1 << 20


def setting_bounds() -> dict[str, tuple[int, int | None]]:
    """The lowest and highest value (None: no bound) of each whole-number setting of a
    handle, for callers that check settings before they make one (the command line)."""
    return {"block_size": (1, MAX_BLOCK_SIZE), "queue_depth": (1, MAX_QUEUE_DEPTH),
            "intra_op_parallelism": (1, max(8, 4 * (os.cpu_count() or 1))),
            "staging_bytes": (MIN_STAGING_BYTES, None)}

Buffer = Any            # a torch tensor, a numpy array, or any buffer-protocol object
Target = Union[str, bytes, "os.PathLike[str]", int]     # a file name, or an open fd


class aio_handle:
    """Asynchronous file I/O through kernel AIO, fanned out to worker processes.

    Parameters
    ----------
    block_size : int
        Bytes per kernel I/O request. Any positive size is accepted, as by DeepNVMe; one
        that is not a multiple of 4096 is served by the next multiple (Note [block size]),
        while ``get_block_size()`` reports the size asked for.
    queue_depth : int
        Requests in flight per worker.
    single_submit : bool
        One ``io_submit`` call per request instead of one per batch.
    overlap_events : bool
        Refill the queue as each request completes instead of batch by batch.
    intra_op_parallelism : int
        Worker processes; each operation is cut into up to this many chunks.
    o_direct : bool or None
        None (default) uses O_DIRECT and falls back to buffered I/O with a warning on
        filesystems that refuse it; True makes that an error; False never uses O_DIRECT.
    staging_bytes : int, optional
        Size of the handle's staging space, the locked shared memory that buffers the
        workers cannot reach (plain tensors, arrays, CUDA tensors) pass through, piece by
        piece (Note [staging ring] in io/staging.py); default 64 MiB, at least 1 MiB.
    memory_budget : int, optional
        Bytes this handle may lock or map (its staging space and the locked tensors it
        makes); ``MemoryBudgetError`` before anything is allocated beyond it. Readable and
        settable as ``memory_budget``; ``memory_in_use`` says what is accounted.
    share_locked_memory_with : aio_handle, optional
        Kept for older callers: every handle of the process now shares one set of locked
        tensors (Note [process-wide locked memory] in io/regions.py), so this changes
        nothing but is still checked to be a handle.
    engine : {"aio", "uring", "auto"}, optional
        How requests reach the kernel, in the workers and the caller queue (Note [engines]
        in io/engines.py): "aio" (kernel AIO), "uring" (io_uring; ``OSError`` here where
        it is refused), "auto" (io_uring where it works, else kernel AIO with one
        ``EngineFallbackWarning``). Default: the environment variable ``NVMESWAP_ENGINE``,
        else "aio". ``get_engine()`` says which one runs.

    Notes
    -----
    Buffers that come from ``new_cpu_locked_tensor`` go to the workers without a copy;
    any other buffer is copied through the handle's staging space. Any
    size and any file offset is allowed (Note [O_DIRECT tail] in io/files.py). The
    blocking calls release the GIL; a handle may be used from several threads at once.
    """

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128,
                 single_submit: bool = False, overlap_events: bool = False,
                 intra_op_parallelism: int = 1, *, o_direct: bool | None = None,
                 staging_bytes: int | None = None, memory_budget: int | None = None,
                 share_locked_memory_with: aio_handle | None = None,
                 engine: str | None = None, _limits: Limits | None = None) -> None:
        bounds = setting_bounds()
        self._block_size = checked_int("block_size", block_size, *bounds["block_size"])
        # Note [block size]: O_DIRECT requests must cover whole 4 KiB sectors of memory and
        # file, so a smaller (or unaligned) block size asked for is served by the next
        # multiple of 4096. Requests only cut the transfer: the bytes moved are the same.
        engine_block = round_up(self._block_size, ALIGNMENT)
        self._queue_depth = checked_int("queue_depth", queue_depth, *bounds["queue_depth"])
        self._parallelism = checked_int("intra_op_parallelism", intra_op_parallelism,
                                        *bounds["intra_op_parallelism"])
        self._single_submit = checked_bool("single_submit", single_submit)
        self._overlap_events = checked_bool("overlap_events", overlap_events)
        if o_direct not in (None, True, False):
            raise TypeError(f"o_direct must be None, True or False, got {o_direct!r}")
        self._engine = checked_engine(engine)
        if _limits is not None and not isinstance(_limits, Limits):
            raise TypeError(f"_limits must be a Limits, got {type(_limits).__name__}")
        self._limits = limits = _limits or DEFAULT_LIMITS
        if staging_bytes is not None:
            limits = self._limits = limits.replace(staging_bytes=round_up(
                checked_int("staging_bytes", staging_bytes, *bounds["staging_bytes"]),
                ALIGNMENT))
        self._staging_bytes = limits.staging_bytes
        self._made = {}     # region id -> bytes of the locked tensors this handle made
        self._memory_budget = None
        self.memory_budget = memory_budget
        if share_locked_memory_with is not None \
                and not isinstance(share_locked_memory_with, aio_handle):
            raise TypeError("share_locked_memory_with must be an aio_handle, got "
                            f"{type(share_locked_memory_with).__name__}")
        self._engine = resolve(self._engine)     # the last check: it may probe io_uring
        locked = locked_memory().join()
        try:
            self._placement = self._make_placement(
                HostPlacement(self._parallelism, engine_block, limits, locked))
            engine = EngineSettings(engine_block, self._queue_depth, self._single_submit,
                                    self._overlap_events, self._engine)
            self._scheduler = Scheduler(self._placement, self._parallelism, engine, o_direct,
                                        limits)
        except BaseException:
            for region in locked.drain():   # a handle that never was leaves the set
                region.close()
            raise
        locked.attach(self._scheduler)
        # Dropped unclosed, it is released on the reaper's thread (Note [releasing
        # dropped handles]); close() releases it in place.
        self._finalizer = weakref.finalize(self, reaper().call, self._scheduler.release)

    def _make_placement(self, host: HostPlacement) -> HostPlacement:
        """The placement hook: where operations' bytes live (gds_handle puts cuFile first)."""
        return host

    @classmethod
    def from_config(cls, config: Mapping | str, **overrides: Any) -> aio_handle:
        """A handle from a DeepSpeed ``"aio"`` section or a tuner result (dict or JSON text)."""
        return cls(**{**handle_arguments(config), **overrides})

    # -- getters (DeepNVMe names) ------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._parallelism

    def get_engine(self) -> str:
        """The engine that moves this handle's requests: "aio" or "uring" (what "auto"
        chose, Note [engines] in io/engines.py)."""
        return self._engine

    def get_alignment(self) -> int:
        """DeepNVMe's alignment: 512 x ``intra_op_parallelism``, the multiple that DeepSpeed
        makes its I/O buffers of.

        Any size, offset and address works with nvmeswap; transfers whose memory address
        and file offset are both multiples of 4096 avoid a staging copy.
        """
        return SECTOR * self._parallelism

    # -- operations ------------------------------------------------------------------
    def sync_pread(self, buffer: Buffer, filename: Target, file_offset: int = 0) -> int:
        """Read ``buffer``'s size in bytes from ``filename`` at ``file_offset``; returns 1.

        Raises ``ShortFileError`` (naming the file and sizes) if the file ends sooner.
        """
        return self._run(buffer, filename, file_offset, is_read=True)

    def sync_pwrite(self, buffer: Buffer, filename: Target, file_offset: int = 0) -> int:
        """Write ``buffer`` to ``filename`` at ``file_offset`` (created if missing, never
        truncated); returns 1."""
        return self._run(buffer, filename, file_offset, is_read=False)

    def async_pread(self, buffer: Buffer, filename: Target, file_offset: int = 0) -> int:
        """Start a read; returns 0. The data is in ``buffer`` once ``wait()`` returns.

        ``buffer`` must stay alive and unchanged until then.
        """
        return self._submit(buffer, filename, file_offset, is_read=True)

    def async_pwrite(self, buffer: Buffer, filename: Target | None = None,
                     file_offset: int = 0, *, fd: int | None = None) -> int:
        """Start a write to a file name or an open int fd (used, never closed); returns 0.

        As in DeepNVMe, the fd may be given by keyword: ``async_pwrite(buffer=t, fd=fd,
        file_offset=0)``.
        """
        return self._submit(buffer, _target(filename, fd), file_offset, is_read=False)

    def submit_pread(self, buffer: Buffer, filename: Target, file_offset: int = 0) -> Future:
        """Start a read of its own; its ``Future`` says when it is done (``done()``, never
        blocking) and gives its result (``result()``: the bytes read, or its error).
        ``wait()`` does not count it; ``close()`` waits for it."""
        return self._submit_future(buffer, filename, file_offset, is_read=True)

    def submit_pwrite(self, buffer: Buffer, filename: Target, file_offset: int = 0) -> Future:
        """Start a write of its own, as ``submit_pread``."""
        return self._submit_future(buffer, filename, file_offset, is_read=False)

    def async_pread_many(self, buffers: Buffer | Sequence[Buffer], filename: Target,
                         offsets: Sequence[int], *,
                         lengths: Sequence[int] | None = None) -> int:
        """Start many reads of one file (Note [batches] in io/batch.py); returns 0.

        ``buffers``: a sequence of buffers, read ``offsets[k]`` into ``buffers[k]``; or
        one buffer cut by ``lengths`` (request ``k`` is the next ``lengths[k]`` bytes of
        it). Every argument is checked, and the file's length, before any I/O.
        ``wait()`` counts each request as one operation; a failed request's error names
        the file and its offset. Locked, 4096-aligned requests of up to 256 KiB go to
        the kernel in bulk; any others as if each were started on its own.
        """
        return self._submit_many(buffers, filename, offsets, lengths, is_read=True)

    def async_pwrite_many(self, buffers: Buffer | Sequence[Buffer], filename: Target,
                          offsets: Sequence[int], *,
                          lengths: Sequence[int] | None = None) -> int:
        """Start many writes to one file (created if missing, never truncated); returns 0.

        As ``async_pread_many``; the buffers must stay unchanged until ``wait()``.
        """
        return self._submit_many(buffers, filename, offsets, lengths, is_read=False)

    def pread(self, buffer: Buffer, filename: Target, validate: bool = False,
              async_op: bool = False, file_offset: int = 0, **kwargs: Any) -> int:
        """DeepNVMe's pread: 1 when done synchronously, 0 when started (``async_op``).

        DeepNVMe's keyword ``async`` is accepted too: ``pread(..., **{"async": True})``.
        ``validate`` re-reads the bytes just moved and raises ``ValidationError`` on a
        difference.
        """
        async_op = _async_keyword(async_op, kwargs)
        return self._call(buffer, filename, validate, async_op, file_offset, is_read=True)

    def pwrite(self, buffer: Buffer, filename: Target, validate: bool = False,
               async_op: bool = False, file_offset: int = 0, **kwargs: Any) -> int:
        """DeepNVMe's pwrite: 1 when done synchronously, 0 when started (``async_op``)."""
        async_op = _async_keyword(async_op, kwargs)
        return self._call(buffer, filename, validate, async_op, file_offset, is_read=False)

    def read(self, buffer: Buffer, filename: Target, validate: bool = False,
             file_offset: int = 0) -> int:
        """DeepNVMe's synchronous read; returns 0, as DeepNVMe's does (its ``pread`` 1)."""
        self._run(buffer, filename, file_offset, is_read=True, validate=validate)
        return 0

    def write(self, buffer: Buffer, filename: Target, validate: bool = False,
              file_offset: int = 0) -> int:
        """DeepNVMe's synchronous write; returns 0, as DeepNVMe's does."""
        self._run(buffer, filename, file_offset, is_read=False, validate=validate)
        return 0

    def wait(self) -> int:
        """Wait for the operations this thread started; return how many completed (0 if
        none).

        If any failed, the first failure is raised once all have completed; its
        ``failed_operations`` attribute (and, on Python 3.11+, its note) says how many.

        Threads: a handle may be used from several threads at once. A thread's
        ``wait()`` returns only once every asynchronous operation that thread started
        is complete, whatever other threads do, and counts them (and raises their
        failures); those of a thread that has ended are counted by the next ``wait()`` of
        any thread. A thread that started none takes everyone's: an operation handed to
        another thread is counted, and its failure raised, by that thread's ``wait()``
        (the starting thread's ``wait()`` still waits for it, and counts it no more).
        A ``wait()`` interrupted by Ctrl-C counts nothing; the next one counts what it
        had taken. A synchronous call interrupted by Ctrl-C leaves its operation running:
        the thread's next ``wait()`` waits for it too (without counting it), after which
        its buffer is the caller's again.
        """
        self._scheduler.check_usable()
        return self._scheduler.collect()

    # -- locked tensors -----------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tenosr: Any = None, *,
                              example_tensor: Any = None) -> Any:
        """A 1-D tensor of ``num_elem`` elements of the example tensor's dtype in locked,
        page-aligned memory shared with the workers: I/O on it (or on its slices) is
        zero-copy.

        The tensor belongs to the process-wide locked set: every handle (and DeepSpeed's
        pin-memory op, once switched, see ``nvmeswap.deepspeed``) sees it as pinned, and
        any of them may free it. The keyword is DeepNVMe's (misspelt) ``example_tenosr``;
        ``example_tensor`` is accepted too.
        """
        self._scheduler.check_usable()
        example = example_tenosr if example_tenosr is not None else example_tensor
        tensor, region = new_locked_tensor(self._placement.locked, num_elem, example,
                                           reserve=self._check_budget,
                                           arena_bytes=self._limits.arena_bytes)
        self._made[region.region_id] = region.size
        self._scheduler.register(region)
        return tensor

    # -- memory --------------------------------------------------------------------------
    @property
    def memory_budget(self) -> int | None:
        """Bytes this handle may lock or map: its staging space and the locked tensors it
        made (None: no limit). A request beyond it raises ``MemoryBudgetError`` before
        anything is allocated."""
        return self._memory_budget

    @memory_budget.setter
    def memory_budget(self, budget: int | None) -> None:
        if budget is not None:
            budget = checked_int("memory_budget", budget, 0, None)
            in_use = self.memory_in_use
            if in_use > budget:
                raise MemoryBudgetError(f"a memory budget of {budget} bytes is below what "
                                        f"this handle already uses ({in_use} bytes)")
        self._memory_budget = budget

    @property
    def memory_in_use(self) -> int:
        """Bytes accounted against the budget: the staging space (counted from the start,
        it has a fixed size) and the locked tensors this handle made and nobody freed."""
        locked = getattr(getattr(self, "_placement", None), "locked", None)
        if locked is not None:
            self._made = {rid: size for rid, size in self._made.items() if rid in locked}
        return self._staging_bytes + sum(self._made.values())

    def _check_budget(self, nbytes):
        """Raise if locking ``nbytes`` more would exceed the budget (before allocating)."""
        if self._memory_budget is not None and self.memory_in_use + nbytes > self._memory_budget:
            raise MemoryBudgetError(
                f"a locked tensor of {nbytes} bytes would exceed this handle's memory "
                f"budget: {self.memory_in_use} of "
                f"{self._memory_budget} bytes are in use (staging space "
                f"{self._staging_bytes} bytes); raise memory_budget or free locked tensors")

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Take a locked tensor (made by any handle) out of the process's locked set and
        unmap it from every handle's workers; False if it was not in the set. The memory
        itself goes with the last reference to the tensor."""
        self._scheduler.check_usable()
        return free_locked_tensor(self._placement.locked, tensor)

    def is_pinned(self, buffer: Any) -> bool:
        """True for tensors (and views of them) in the process's locked memory, and, as
        in DeepNVMe, for tensors torch has pinned."""
        self._scheduler.check_usable()
        return is_locked(self._placement.locked, buffer)

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Finish what is in flight, stop the workers and free the shared memory.

        Operations nobody waited for are waited for here, and the first failure among
        them is raised (after the handle is closed). Idempotent; any later call but
        ``close()`` raises ``ValueError``. A Ctrl-C during ``close()`` leaves the handle
        closed: its workers killed, unfinished writes undone.
        """
        if self._scheduler.closed:
            return
        try:
            if os.getpid() == self._scheduler.creator_pid:
                self._scheduler.collect()
        finally:
            if self._finalizer.detach() is not None:
                self._scheduler.release()

    def __enter__(self) -> aio_handle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        scheduler = getattr(self, "_scheduler", None)
        if scheduler is not None and not scheduler.closed \
                and os.getpid() == scheduler.creator_pid:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, source=self)
            self._finalizer()

    def __reduce__(self):
        raise TypeError(f"cannot pickle an nvmeswap {type(self).__name__}: it owns worker "
                        "processes and shared memory of this process; make a new handle "
                        "in the other process")

    def __repr__(self) -> str:
        state = "closed" if self._scheduler.closed else "open"
        return (f"<nvmeswap.{type(self).__name__} {state} block_size={self._block_size} "
                f"queue_depth={self._queue_depth} intra_op_parallelism={self._parallelism}>")

    # -- delegation ----------------------------------------------------------------------
    def _call(self, buffer, target, validate, async_op, file_offset, *, is_read):
        if checked_bool("async_op", async_op):
            return self._submit(buffer, target, file_offset, is_read=is_read, validate=validate)
        return self._run(buffer, target, file_offset, is_read=is_read, validate=validate)

    def _run(self, buffer, target, file_offset, *, is_read, validate=False):
        self._scheduler.check_usable()
        return self._scheduler.run(buffer, target, file_offset, is_read=is_read,
                                   validate=checked_bool("validate", validate))

    def _submit_future(self, buffer, target, file_offset, *, is_read):
        self._scheduler.check_usable()
        return self._scheduler.submit_future(buffer, target, file_offset, is_read=is_read)

    def _submit_many(self, buffers, target, offsets, lengths, *, is_read):
        self._scheduler.check_usable()
        self._scheduler.submit_many(buffers, target, offsets, lengths, is_read=is_read)
        return 0

    def _submit(self, buffer, target, file_offset, *, is_read, validate=False):
        self._scheduler.check_usable()
        self._scheduler.submit(buffer, target, file_offset, is_read=is_read,
                               validate=checked_bool("validate", validate))
        return 0


def _target(filename, fd):
    if fd is None:
        if filename is None:
            raise TypeError("async_pwrite() needs a filename or an fd")
        return filename
    if filename is not None:
        raise TypeError("async_pwrite() takes a filename or an fd, not both")
    if isinstance(fd, bool) or not isinstance(fd, int):
        raise TypeError(f"fd must be an int file descriptor, got {type(fd).__name__}")
    return fd


def _async_keyword(async_op, kwargs):
    if set(kwargs) - {"async"}:
        raise TypeError(f"unexpected keyword arguments: {sorted(set(kwargs) - {'async'})}")
    return checked_bool("async", kwargs["async"]) if "async" in kwargs else async_op
