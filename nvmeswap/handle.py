"""``nvmeswap.aio_handle``: DeepNVMe's aio_handle, on a pool of worker processes.

The road of one call: check the arguments, open the file, pick the memory the workers
will use (the caller's locked tensor as is, or a staging region), cut the operation
into chunks, send each chunk to a worker, and gather the responses in ``wait()``.
"""
import errno
import functools
import itertools
import operator
import os
import threading
import warnings
import weakref

from . import protocol
from ._engine import transfer_in_caller
from ._memory import buffer_address, first_difference
from .buffers import io_buffer
from .config import handle_arguments
from .device import CudaCopier, HostCopier, copy_stream, register_for_device_copies
from .errors import ValidationError, WorkerDied, os_error, short_file_error, transfer_error
from .files import ALIGNMENT, open_target
from .memory import SharedRegion, StagingPool
from .plan import StagingRing, chunk_bounds, chunk_count
from .pool import WorkerPool

MAX_QUEUE_DEPTH = 1024
MAX_BLOCK_SIZE = 1 << 30
MAX_FILE_END = (1 << 63) - 1
# Synchronous operations up to this size (and one block) run in the calling thread.
INLINE_LIMIT = 256 << 10
# Started operations wait while this many chunks are with the workers.
MAX_CHUNKS_IN_FLIGHT = 128
# Writes that grow a file by at least this much preallocate (Note [preallocation]).
PREALLOCATE_MIN = 1 << 20


class Operation:
    """One call in flight: where its bytes go, its chunks still out, and its first error."""

    __slots__ = ("op_id", "is_read", "buffer", "file", "file_offset", "region", "region_offset",
                 "staged", "owns_region", "copier", "ring", "chunks", "remaining", "error",
                 "validate", "done")

    def __init__(self, op_id, is_read, buffer, file, file_offset, validate):
        self.op_id = op_id
        self.is_read = is_read
        self.buffer = buffer
        self.file = file
        self.file_offset = file_offset
        self.validate = validate
        self.region = None
        self.region_offset = 0
        self.staged = False     # the region is staging memory, given back at the end
        self.owns_region = False    # the region was made for this operation alone
        self.copier = None      # moves bytes between the buffer and a staging region
        self.ring = None        # a CUDA tensor's staging slots (Note [device pipeline])
        self.chunks = []
        self.remaining = 0
        self.error = None
        self.done = False

    def is_done(self):
        return self.done

    def describe(self):
        verb = "read of" if self.is_read else "write of"
        return f"{verb} {self.buffer.nbytes} bytes at offset {self.file_offset} of {self.file.name}"


class _Resources:
    """What a handle must give back, kept apart so that a finalizer can reach it."""

    def __init__(self):
        self.pool = None
        self.locked = {}
        self.staging = StagingPool()
        self.descriptors = []

    def release(self, creator_pid):
        if os.getpid() != creator_pid:
            return      # a forked child never tears down its parent's workers
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.stop()
        for region in [*self.locked.values(), *self.staging.drain()]:
            region.close()
        self.locked.clear()
        for fd in self.descriptors:
            os.close(fd)
        self.descriptors.clear()


class aio_handle:
    """Asynchronous file I/O through kernel AIO, fanned out to worker processes.

    Parameters
    ----------
    block_size : int
        Bytes per kernel I/O request; a multiple of 4096.
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
    share_locked_memory_with : aio_handle, optional
        Share locked tensors with another handle: those made by either are zero-copy for
        both (a read handle and a write handle over the same swap buffers, say). Workers
        of the other handle keep such memory mapped until that handle is closed.

    Buffers that come from ``new_cpu_locked_tensor`` go to the workers without a copy;
    any other buffer is copied through a reusable pool of locked staging memory. Any
    size and any file offset is allowed (see Note [O_DIRECT tail] in files.py).
    """

    def __init__(self, block_size=1048576, queue_depth=128, single_submit=False,
                 overlap_events=False, intra_op_parallelism=1, *, o_direct=None,
                 share_locked_memory_with=None):
        self._block_size = _checked_int("block_size", block_size, ALIGNMENT, MAX_BLOCK_SIZE)
        if self._block_size % ALIGNMENT:
            raise ValueError(f"block_size must be a multiple of {ALIGNMENT}, got {block_size}")
        self._queue_depth = _checked_int("queue_depth", queue_depth, 1, MAX_QUEUE_DEPTH)
        self._parallelism = _checked_int("intra_op_parallelism", intra_op_parallelism, 1,
                                         max(8, 4 * (os.cpu_count() or 1)))
        self._single_submit = _checked_bool("single_submit", single_submit)
        self._overlap_events = _checked_bool("overlap_events", overlap_events)
        if o_direct not in (None, True, False):
            raise TypeError(f"o_direct must be None, True or False, got {o_direct!r}")
        self._o_direct = o_direct
        self._creator_pid = os.getpid()
        self._closed = False
        self._cond = threading.Condition()
        self._pumping = False
        self._ops = {}
        self._async_ops = []
        self._op_ids = itertools.count(1)
        self._next_worker = 0
        self._chunks_in_flight = 0
        self._copy_streams = {}
        self._driving = False
        self._resources = _Resources()
        if share_locked_memory_with is not None:
            self._resources.locked = share_locked_memory_with._resources.locked
        self._finalizer = weakref.finalize(self, self._resources.release, self._creator_pid)
        with self._cond:
            self._running_pool()

    @classmethod
    def from_config(cls, config, **overrides):
        """A handle from a DeepSpeed ``"aio"`` section or a tuner result (dict or JSON text)."""
        return cls(**{**handle_arguments(config), **overrides})

    # -- getters (DeepNVMe names) ------------------------------------------------------
    def get_block_size(self):
        return self._block_size

    def get_queue_depth(self):
        return self._queue_depth

    def get_single_submit(self):
        return self._single_submit

    def get_overlap_events(self):
        return self._overlap_events

    def get_intra_op_parallelism(self):
        return self._parallelism

    def get_alignment(self):
        """File offsets, sizes and addresses that avoid any staging or buffered tail."""
        return ALIGNMENT

    # -- operations ------------------------------------------------------------------
    def sync_pread(self, buffer, filename, file_offset=0):
        """Read ``buffer``'s size in bytes from ``filename`` at ``file_offset``; returns 1."""
        return self._run(buffer, filename, file_offset, is_read=True, validate=False)

    def sync_pwrite(self, buffer, filename, file_offset=0):
        """Write ``buffer`` to ``filename`` at ``file_offset`` (created if missing); returns 1."""
        return self._run(buffer, filename, file_offset, is_read=False, validate=False)

    def async_pread(self, buffer, filename, file_offset=0):
        """Start a read; returns 0. The data is in ``buffer`` once ``wait()`` returns."""
        self._submit(buffer, filename, file_offset, is_read=True, validate=False, is_async=True)
        return 0

    def async_pwrite(self, buffer, filename, file_offset=0):
        """Start a write to a file name or an open int fd (used, never closed); returns 0."""
        self._submit(buffer, filename, file_offset, is_read=False, validate=False, is_async=True)
        return 0

    def pread(self, buffer, filename, validate=False, async_op=False, file_offset=0, **kwargs):
        """DeepNVMe's pread: 1 when done synchronously, 0 when started (``async_op``).

        DeepNVMe's keyword ``async`` is accepted too: ``pread(..., **{"async": True})``.
        """
        return self._call(buffer, filename, validate, _async_keyword(async_op, kwargs),
                          file_offset, is_read=True)

    def pwrite(self, buffer, filename, validate=False, async_op=False, file_offset=0, **kwargs):
        """DeepNVMe's pwrite: 1 when done synchronously, 0 when started (``async_op``)."""
        return self._call(buffer, filename, validate, _async_keyword(async_op, kwargs),
                          file_offset, is_read=False)

    def read(self, buffer, filename, validate=False, file_offset=0):
        """DeepNVMe's synchronous read; returns 1."""
        return self._run(buffer, filename, file_offset, is_read=True, validate=validate)

    def write(self, buffer, filename, validate=False, file_offset=0):
        """DeepNVMe's synchronous write; returns 1."""
        return self._run(buffer, filename, file_offset, is_read=False, validate=validate)

    def wait(self):
        """Wait for every started operation; return how many completed (0 if none).

        If any failed, the first failure is raised once all have completed; its
        ``failed_operations`` attribute (and, on Python 3.11+, its note) says how many.
        """
        self._check_usable()
        with self._cond:
            ops = list(self._async_ops)
        if not ops:
            return 0
        self._wait_until(functools.partial(_all_done, ops))
        with self._cond:
            collected = set(map(id, ops))
            self._async_ops = [op for op in self._async_ops if id(op) not in collected]
        failed = [op.error for op in ops if op.error is not None]
        if not failed:
            return len(ops)
        first = failed[0]
        first.failed_operations = len(failed)
        if hasattr(first, "add_note"):      # Python 3.11+
            first.add_note(f"{len(failed)} of {len(ops)} operations failed")
        # Note [no reference cycle]: the traceback holds this frame; this frame must not
        # hold the error, or the operations (and the caller's buffers) through them, or
        # only the garbage collector would free them, locked memory included.
        del failed, ops
        try:
            raise first
        finally:
            del first

    # -- locked tensors -----------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem, example_tensor=None, *, example_tenosr=None):
        """A 1-D tensor of ``num_elem`` elements of ``example_tensor``'s dtype in locked,
        page-aligned memory shared with the workers: I/O on it (or on its slices) is zero-copy.
        """
        import torch

        example = example_tensor if example_tensor is not None else example_tenosr
        if not isinstance(example, torch.Tensor):
            raise TypeError("new_cpu_locked_tensor() needs an example tensor for the dtype")
        num_elem = _checked_int("num_elem", num_elem, 0, None)
        self._check_usable()
        itemsize = torch.empty((), dtype=example.dtype).element_size()
        region = SharedRegion(num_elem * itemsize)
        if torch.cuda.is_initialized():
            # Like DeepNVMe's (pin_memory) tensors: non_blocking copies to the GPU are DMA.
            register_for_device_copies(region)
        with self._cond:
            self._resources.locked[region.region_id] = region
        tensor = torch.frombuffer(region.mapping, dtype=torch.uint8)
        return tensor[: num_elem * itemsize].view(example.dtype)

    def free_cpu_locked_tensor(self, tensor):
        """Stop sharing a locked tensor with the workers; the memory goes with the tensor."""
        self._check_usable()
        with self._cond:
            region = self._locked_region(tensor.data_ptr(), 0)
            if region is None:
                return False
            del self._resources.locked[region.region_id]
            self._unshare(region)
        return True

    def is_pinned(self, tensor):
        """True for tensors (and views of them) in this handle's locked memory."""
        nbytes = tensor.numel() * tensor.element_size() if hasattr(tensor, "numel") else 0
        with self._cond:
            return self._locked_region(tensor.data_ptr(), nbytes) is not None

    # -- lifetime ------------------------------------------------------------------------
    def close(self):
        """Finish what is in flight, stop the workers and free the shared memory."""
        if self._closed:
            return
        try:
            if os.getpid() == self._creator_pid:
                self._wait_until(lambda: not self._ops)
        finally:
            self._closed = True
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True) and os.getpid() == self._creator_pid:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, source=self)
            self._finalizer()

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return (f"<nvmeswap.aio_handle {state} block_size={self._block_size} "
                f"queue_depth={self._queue_depth} intra_op_parallelism={self._parallelism}>")

    # -- the road of one operation -------------------------------------------------------
    def _call(self, buffer, target, validate, async_op, file_offset, *, is_read):
        if async_op:
            self._submit(buffer, target, file_offset, is_read=is_read, validate=validate,
                         is_async=True)
            return 0
        return self._run(buffer, target, file_offset, is_read=is_read, validate=validate)

    def _run(self, buffer, target, file_offset, *, is_read, validate):
        op = self._open_operation(buffer, target, file_offset, is_read, validate)
        if op.buffer.nbytes <= self._inline_limit(op):
            self._run_inline(op)
        else:
            self._start(op, is_async=False)
            self._wait_until(op.is_done)
        error = op.error
        if error is None:
            return 1
        del op      # Note [no reference cycle] in wait()
        try:
            raise error
        finally:
            del error

    def _submit(self, buffer, target, file_offset, *, is_read, validate, is_async):
        op = self._open_operation(buffer, target, file_offset, is_read, validate)
        self._start(op, is_async)
        return op

    def _open_operation(self, buffer, target, file_offset, is_read, validate):
        """Check the arguments and open the file: everything that can fail before I/O."""
        self._check_usable()
        buf = io_buffer(buffer, writable=is_read)
        file_offset = _checked_int("file_offset", file_offset, 0, MAX_FILE_END - buf.nbytes)
        if buf.nbytes == 0:
            raise ValueError(f"nothing to transfer: the buffer for {target!r} is empty")
        file = open_target(target, for_write=not is_read, offset=file_offset, nbytes=buf.nbytes,
                           o_direct=self._o_direct)
        if not is_read and buf.nbytes >= PREALLOCATE_MIN:
            try:
                file.preallocate(file_offset + buf.nbytes)
            except BaseException:
                file.close()
                raise
        return Operation(next(self._op_ids), is_read, buf, file, file_offset, validate)

    def _start(self, op, is_async):
        """Place the operation and hand its chunks to the workers."""
        try:
            # Back-pressure: every chunk in flight holds descriptors in a worker.
            self._wait_until(lambda: self._chunks_in_flight < MAX_CHUNKS_IN_FLIGHT)
            with self._cond:
                self._check_usable()
                pool = self._running_pool()     # before registering: it may fail what is out
                self._place(op)
                self._ops[op.op_id] = op
                if is_async:
                    self._async_ops.append(op)
                if op.ring is None:
                    self._dispatch(op, pool)
                    return
                self._feed(op)
                if is_async and not op.done and not self._driving:
                    self._drive_in_background()
        except BaseException:
            if op.op_id not in self._ops:
                self._abandon(op)
            raise

    def _inline_limit(self, op):
        """Operations up to this size run in the calling thread (Note below)."""
        limit = min(INLINE_LIMIT, self._block_size)
        if op.buffer.device is not None:
            limit = min(limit, StagingRing.PIECE)    # one piece: one slot
        return limit

    def _run_inline(self, op):
        """Note [small synchronous operations]: an operation of one request runs in the
        calling thread. A round trip to a worker costs two process wake-ups, more than
        the request itself on a fast device, and one request gains nothing from fan-out.
        """
        try:
            with self._cond:
                self._check_usable()
                self._place(op)
                if op.ring is not None:
                    op.ring.start_next()
            region_offset = self._region_offset(op, 0)
            if op.copier is not None and not op.is_read:
                op.copier.to_region(0, op.buffer.nbytes, op.region, region_offset)
            result = transfer_in_caller(op.is_read, op.file.direct_fd, op.file.buffered_fd,
                                        op.region.address + region_offset, op.buffer.nbytes,
                                        op.file_offset, op.file.alignment)
        except BaseException:
            self._abandon(op)
            raise
        with self._cond:
            self._complete_chunk(op, 0, *result)

    def _abandon(self, op):
        """Give back what an operation that never started holds."""
        op.file.close()
        if op.staged:
            self._give_back_staging(op.region)

    def _give_back_staging(self, region):
        for surplus in self._resources.staging.release(region):
            self._unshare(surplus)

    def _unshare(self, region):
        """Have the workers unmap ``region`` and drop our descriptor of it."""
        pool = self._resources.pool
        for worker in pool.workers if pool is not None else []:
            if region.region_id in worker.mapped:
                worker.mapped.discard(region.region_id)
                try:
                    worker.send(protocol.REQUEST.pack(protocol.UNMAP, region.region_id,
                                                      0, 0, 0, 0, 0, 0))
                except OSError:
                    pass    # a dead worker maps nothing; the pump will see its death
        region.close()

    def _place(self, op):
        """Choose the memory the workers use, and cut the operation into chunks."""
        buf, alignment = op.buffer, op.file.alignment
        if buf.device is not None:
            op.ring = StagingRing(op.file_offset, buf.nbytes, alignment,
                                  max(4, 2 * self._parallelism))
            op.region = self._resources.staging.acquire(op.ring.region_size())
            op.staged = True
            register_for_device_copies(op.region)
            # Made in the caller's call: it orders the copies after the work queued so far.
            op.copier = CudaCopier(buf.owner, copy_stream(buf.device, self._copy_streams))
            op.chunks = op.ring.pieces
            op.remaining = len(op.chunks)
            return
        region = self._locked_region(buf.address, buf.nbytes)
        if region is not None and (buf.address - op.file_offset) % alignment == 0:
            op.region, op.region_offset = region, buf.address - region.address
        else:
            # Note: the staged copy sits at the file offset's alignment phase so that
            # its aligned middle can go through O_DIRECT.
            op.region = self._resources.staging.acquire(buf.nbytes + alignment)
            op.region_offset = op.file_offset % alignment
            op.staged = True
            op.copier = HostCopier(buf.address)
        parts = chunk_count(buf.nbytes, self._parallelism, op.staged)
        op.chunks = chunk_bounds(op.file_offset, buf.nbytes, parts, alignment)
        op.remaining = len(op.chunks)

    def _region_offset(self, op, index):
        if op.ring is not None:
            return op.ring.region_offset(index)
        return op.region_offset + op.chunks[index][0]

    def _dispatch(self, op, pool):
        """Hand every chunk out; a staged write copies each just before it goes."""
        for index, (start, length) in enumerate(op.chunks):
            if op.copier is not None and not op.is_read:
                op.copier.to_region(start, length, op.region, self._region_offset(op, index))
            if not self._send(op, index, pool.workers):
                break
        op.file.close()

    def _feed(self, op):
        """Start the ring's next pieces while it has free slots (Note [device pipeline])."""
        while not op.done and op.error is None:
            index = op.ring.start_next()
            if index is None:
                return
            if not op.is_read:
                start, length = op.chunks[index]
                try:
                    op.copier.to_region(start, length, op.region, op.ring.region_offset(index))
                except Exception as error:
                    op.error = _copy_error(op, error)
                    op.ring.finish(index)
                    op.remaining -= 1
                    break
            if not self._send(op, index, self._resources.pool.workers):
                return
        if op.error is not None and not op.done:
            op.remaining -= op.ring.cancel_rest()
            if op.remaining == 0:
                self._finish(op)

    def _send(self, op, index, workers):
        """Send chunk ``index`` to the next worker; False if that worker is gone."""
        worker = workers[self._next_worker]
        self._next_worker = (self._next_worker + 1) % len(workers)
        start, length = op.chunks[index]
        region = op.region
        self._chunks_in_flight += 1
        try:
            if region.region_id not in worker.mapped:
                for message, fds in self._map_requests(worker, region):
                    worker.send(message, fds)
                worker.mapped.add(region.region_id)
            worker.send(protocol.REQUEST.pack(
                region.read_kind if op.is_read else region.write_kind, region.region_id,
                op.op_id, index, self._region_offset(op, index), length,
                op.file_offset + start, op.file.alignment), op.file.descriptors())
        except OSError:
            # The worker is dead or dying; the pump sees its pidfd and fails the
            # operations in flight, this one included.
            return False
        return True

    def _map_requests(self, worker, region):
        """What a worker must be sent before its first request on ``region``."""
        return [region.map_request()]

    def _drive_in_background(self):
        """Note [device pipeline]: an async CUDA operation has more pieces than slots, and
        only a thread reading responses frees slots; without one it would stall until
        ``wait()``. The thread ends when no such operation is left.
        """
        self._driving = True

        def drive():
            try:
                self._wait_until(self._ring_work_done)
            except BaseException:
                with self._cond:
                    self._driving = False
                raise

        threading.Thread(target=drive, name="nvmeswap-device-pipeline", daemon=True).start()

    def _ring_work_done(self):
        # Decided under the lock that _start holds, so no operation is left undriven.
        done = all(op.ring is None for op in self._ops.values())
        if done:
            self._driving = False
        return done

    def _running_pool(self):
        """The current workers; a set with a member that died while idle is replaced."""
        pool = self._resources.pool
        if pool is not None and not self._ops and not self._pumping:
            death = pool.first_death()      # with operations out, the pump sees a death
            if death is not None:
                self._fail_pool(pool, WorkerDied(death))
        if self._resources.pool is None:
            self._resources.pool = WorkerPool(
                self._parallelism, (self._block_size, self._queue_depth,
                                    int(self._single_submit), int(self._overlap_events)))
        return self._resources.pool

    def _wait_until(self, finished):
        """Block (GIL released) until ``finished()``; one thread at a time reads responses."""
        while True:
            with self._cond:
                if finished():
                    return
                if self._pumping:
                    self._cond.wait()
                    continue
                pool = self._resources.pool
                self._pumping = True
            try:
                try:
                    responses = pool.receive()
                except WorkerDied as death:
                    with self._cond:
                        self._fail_pool(pool, death)
                    continue
                with self._cond:
                    for response in responses:
                        self._on_response(response)
            finally:
                with self._cond:
                    self._pumping = False
                    self._cond.notify_all()

    def _on_response(self, response):
        op_id, chunk, err, at_offset, requested, got = response
        op = self._ops.get(op_id)
        if op is None:
            return
        self._chunks_in_flight -= 1
        self._complete_chunk(op, chunk, err, at_offset, requested, got)

    def _complete_chunk(self, op, chunk, err, at_offset, requested, got):
        start, length = op.chunks[chunk]
        if err or got != requested:
            if op.error is None:
                op.error = _transfer_error(op, err, at_offset, requested, got)
        elif op.copier is not None and op.is_read and op.error is None:
            try:
                op.copier.from_region(start, length, op.region, self._region_offset(op, chunk))
            except Exception as error:
                op.error = _copy_error(op, error)
        op.remaining -= 1
        if op.ring is not None:
            op.ring.finish(chunk)
            self._feed(op)
        if op.remaining == 0 and not op.done:
            self._finish(op)

    def _fail_pool(self, pool, death):
        """A worker died: kill its siblings, fail everything in flight, restart on next use."""
        if pool is not self._resources.pool:
            return
        pool.kill()     # reaped: no kernel AIO of theirs touches our memory any more
        self._resources.pool = None
        self._chunks_in_flight = 0
        for op in list(self._ops.values()):
            if op.error is None:
                op.error = WorkerDied(f"{death}: {op.describe()}")
            self._finish(op)

    def _finish(self, op):
        self._ops.pop(op.op_id, None)
        if op.error is None and op.validate:
            try:
                _validate(op, self._bytes_reader(op))
            except (ValidationError, OSError) as error:
                op.error = error
        if op.error is not None and not op.is_read:
            op.file.undo_growth(op.file_offset + op.buffer.nbytes)
        op.file.close()
        if op.staged:
            self._give_back_staging(op.region)
        elif op.owns_region:
            self._unshare(op.region)
        op.buffer = op.region = op.copier = None
        op.done = True

    def _bytes_reader(self, op):
        """Something that shows the buffer's bytes on the host (for validation)."""
        if op.copier is not None:
            return op.copier
        if op.buffer.device is not None:
            return CudaCopier(op.buffer.owner, copy_stream(op.buffer.device, self._copy_streams))
        return HostCopier(op.buffer.address)

    def _locked_region(self, address, nbytes):
        for region in list(self._resources.locked.values()):
            if region.contains(address, nbytes):
                return region
        return None

    def _check_usable(self):
        if self._closed:
            raise ValueError("I/O operation on a closed nvmeswap handle")
        if os.getpid() != self._creator_pid:
            raise RuntimeError(f"this nvmeswap handle belongs to process {self._creator_pid}; "
                               "after fork() create a new handle in the child")


def _transfer_error(op, err, at_offset, requested, got):
    where = f"{requested} bytes at offset {at_offset}"
    if err:
        return transfer_error(err, op.file.name, f"{'read' if op.is_read else 'write'} of {where}")
    if op.is_read:
        return short_file_error(op.file.name, f"short read: got {got} of {where}; "
                                              "was the file truncated while it was read?")
    return os_error(errno.ENOSPC, op.file.name, f"short write: wrote {got} of {where}")


def _validate(op, reader):
    """Re-read exactly the bytes just transferred and compare them with the buffer."""
    step = 16 << 20
    fd = os.open(op.file.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for start in range(0, op.buffer.nbytes, step):
            length = min(step, op.buffer.nbytes - start)
            data = os.pread(fd, length, op.file_offset + start)
            if len(data) != length:
                raise short_file_error(op.file.name, f"validation read {len(data)} of {length} "
                                                     f"bytes at offset {op.file_offset + start}")
            address, _keeper = reader.host_bytes(start, length)
            diff = first_difference(buffer_address(data, False)[0], address, length)
            if diff >= 0:
                at = op.file_offset + start + diff
                raise ValidationError(f"{op.file.name}: validation failed at file offset {at}: "
                                      "the file and the buffer differ", op.file.name, at)
    finally:
        os.close(fd)


def _copy_error(op, error):
    """A failed copy between the buffer and staging memory, as an error of the operation.

    (A new exception: the caught one's traceback holds frames that hold the operation.)
    """
    return RuntimeError(f"copying the {op.describe()} through host memory failed: "
                        f"{type(error).__name__}: {error}")


def _all_done(ops):
    return all(op.done for op in ops)


def _async_keyword(async_op, kwargs):
    if set(kwargs) - {"async"}:
        raise TypeError(f"unexpected keyword arguments: {sorted(set(kwargs) - {'async'})}")
    return bool(kwargs.get("async", async_op))


def _checked_int(name, value, low, high):
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _checked_bool(name, value):
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)
