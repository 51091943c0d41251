"""A stand-in for a GPU, so that the device roads run without one.

Two parts, both installed by ``use_stand_in_device``:

- Device memory: ``device_tensor`` makes a ``StandInDeviceTensor``, host memory that
  the handles see as a CUDA tensor (an IoBuffer with a device).
- A stand-in CUDA runtime (``StandInCuda``) in nvmeswap.gpu.copies, so that the real
  copy code runs: its stream, the wait on the caller's stream, the copies made inside
  ``stream(...)`` with ``non_blocking=True``, the synchronizations, and the
  ``cudaHostRegister`` of the staging regions. It behaves as CUDA does where that
  matters to correctness: a non-blocking copy is only queued on the current stream and
  happens when that stream is synchronized (so a missing synchronize leaves the bytes
  unmoved), work queued on one stream runs before another's only after ``wait_stream``,
  and a failing copy reports its error at the synchronize.

A device tensor can be told to fail at its n-th copy (``fail_at_piece``), to kill a
worker at it (``kill_worker_at_piece``), to flip a bit of every copy to the host
(``corrupt_copies``) or to call ``before_copy(start, length)`` before each copy runs;
``copied(tensor)`` says how many bytes the copies moved.
"""
import mmap
import os
import threading
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import torch

import nvmeswap.gds as gds_module
import nvmeswap.io.batch as batch_module
import nvmeswap.io.operation as operation_module
import nvmeswap.io.quick as quick_module
from nvmeswap.gpu import copies
from nvmeswap.io.buffers import IoBuffer, io_buffer

CUDA_SUCCESS = 0
_allocations = {}       # storage address -> Allocation, for every live device tensor


class Allocation:
    """What the stand-in knows of one device tensor's memory."""

    def __init__(self, handle, marks):
        self.handle = handle
        self.fail_at_piece = marks.pop("fail_at_piece", None)
        self.kill_worker_at_piece = marks.pop("kill_worker_at_piece", None)
        self.corrupt_copies = marks.pop("corrupt_copies", False)
        self.before_copy = marks.pop("before_copy", None)   # called with (start, length)
        assert not marks, f"unknown marks {marks}"
        self.copies = 0         # non-blocking copies run (the copier's pieces)
        self.copied = 0         # their bytes


def _allocation(tensor):
    return _allocations.get(tensor.untyped_storage().data_ptr())


def copied(tensor):
    """The bytes the copy code moved between ``tensor`` and the host."""
    return _allocation(tensor).copied


class StandInDeviceTensor(torch.Tensor):
    """Host memory that plays device memory: copies to and from it go through the
    stand-in runtime's streams."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_":
            return StandInCuda.active.copy(args[0], args[1], kwargs.get("non_blocking", False))
        if name == "to" and args[1:] == ("cpu",):
            StandInCuda.active.current_stream().synchronize()   # a blocking copy
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].to("cpu", copy=True)
        return super().__torch_function__(func, types, args, kwargs)


class StandInStream:
    """A queue of work, run in order at ``synchronize``."""

    def __init__(self, cuda, device=None):
        self._cuda = cuda
        self.device = device
        self._queued = []       # (sequence number, callable)
        self._submitted = 0
        self._done = 0

    def enqueue(self, work):
        """Queue ``work`` (a callable): a kernel, a copy, a wait on another stream."""
        with self._cuda.lock:
            self._submitted += 1
            self._queued.append((self._submitted, work))
            self._cuda.events.append(("queued", self))

    def wait_stream(self, other):
        """What is queued here from now on runs after what ``other`` has queued so far."""
        upto = other._submitted
        self._cuda.events.append(("wait_stream", self, other))
        self.enqueue(lambda: other._run_through(upto))

    def synchronize(self):
        self._cuda.events.append(("synchronize", self))
        self._run_through(self._submitted)

    def _run_through(self, upto):
        with self._cuda.lock:
            while self._queued and self._queued[0][0] <= upto:
                _, work = self._queued.pop(0)
                self._done += 1
                work()      # an error here is the copy's: CUDA reports it at synchronize


class StandInCuda:
    """The part of ``torch.cuda`` nvmeswap.gpu.copies calls, without a GPU; it records
    the calls (``events``) and the registered host memory (``registered``)."""

    active = None

    def __init__(self):
        self.lock = threading.RLock()
        self.events = []
        self.registered = {}        # address -> size: cudaHostRegister'd memory
        self.streams_made = []
        self._default = StandInStream(self)
        self._current = threading.local()   # as in CUDA, the current stream is per thread

    # -- the torch.cuda calls -------------------------------------------------------
    def current_stream(self, device=None):
        return getattr(self._current, "stream", None) or self._default

    def Stream(self, device=None):     # torch.cuda's name
        stream = StandInStream(self, device)
        self.streams_made.append(stream)
        return stream

    @contextmanager
    def stream(self, stream):
        previous = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = previous

    def cudart(self):
        def register(address, size, flags):
            assert flags == copies.HOST_REGISTER_PORTABLE
            assert address not in self.registered, "registered twice"
            self.registered[address] = size
            return CUDA_SUCCESS

        def unregister(address):
            del self.registered[address]
            return CUDA_SUCCESS

        return SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=unregister,
                               cudaError=SimpleNamespace(success=CUDA_SUCCESS))

    # -- copies --------------------------------------------------------------------------
    def copy(self, target, source, non_blocking):
        """``target.copy_(source)``: queued on the current stream when non-blocking (as a
        copy between device and host memory is), else at once after what is queued."""
        device = target if isinstance(target, StandInDeviceTensor) else source
        allocation = _allocation(device)

        def run():
            if non_blocking and allocation is not None:
                self._copy_hooks(allocation, device)
            with torch._C.DisableTorchFunctionSubclass():
                target.copy_(source)
                if non_blocking and allocation is not None:
                    allocation.copied += target.numel() * target.element_size()
                    if allocation.corrupt_copies and device is source:
                        target.view(torch.uint8)[0] ^= 1
            if non_blocking:
                self.events.append(("copied", target.numel() * target.element_size()))

        stream = self.current_stream()
        if non_blocking:
            stream.enqueue(run)
        else:
            stream.synchronize()
            run()
        return target

    def _copy_hooks(self, allocation, device):
        if allocation.before_copy is not None:
            allocation.before_copy(device.storage_offset(), device.numel())
        if allocation.copies == allocation.fail_at_piece:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if allocation.copies == allocation.kill_worker_at_piece:
            worker = allocation.handle._scheduler.workers.pool.workers[0].process
            worker.kill()
            worker.wait()
        allocation.copies += 1


def use_stand_in_device(monkeypatch):
    """Make the handles see device tensors as CUDA memory, and put a stand-in CUDA
    runtime under nvmeswap.gpu.copies; return the runtime."""
    cuda = StandInCuda()

    def buffer_of(obj, *, writable):
        buf = io_buffer(obj, writable=writable)
        if isinstance(obj, StandInDeviceTensor):
            return IoBuffer(buf.owner, buf.address, buf.nbytes, device=torch.device("cuda", 0))
        return buf

    for module in (operation_module, batch_module, quick_module, gds_module):
        monkeypatch.setattr(module, "io_buffer", buffer_of)
    monkeypatch.setattr(copies, "runtime", cuda)
    monkeypatch.setattr(StandInCuda, "active", cuda)
    return cuda


def device_tensor(h, data, *, shared=False, **marks):
    """A stand-in device tensor holding ``data`` (bytes) or ``data`` zero bytes.

    ``shared``: in a memfd mapping of its own, which other processes can map: its
    descriptor stays open while the mapping lives, for the fake CUDA driver's IPC to
    name (fake_gpu.py).
    """
    size = len(data) if isinstance(data, bytes) else data
    if shared:
        fd = os.memfd_create("stand-in-device", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(size, 1))
            memory = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            raise
        weakref.finalize(memory, os.close, fd)
        host = torch.frombuffer(memory, dtype=torch.uint8)[:size]
        if isinstance(data, bytes):
            host.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    elif isinstance(data, bytes):
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        host = torch.zeros(size, dtype=torch.uint8)
    tensor = host.as_subclass(StandInDeviceTensor)
    key = tensor.untyped_storage().data_ptr()
    _allocations[key] = Allocation(h, marks)
    weakref.finalize(tensor, _allocations.pop, key, None)
    return tensor
