"""A stand-in for CUDA memory, so that the device roads run without a GPU.

Tensors marked with a ``handle`` attribute count as device memory: the handle sees
them as CUDA tensors (an IoBuffer with a device) and reaches their bytes only through
``StandInCopier``, which copies the way the CUDA copier does and can be told to fail,
corrupt or kill a worker at a given copy.
"""
import ctypes
import mmap
import os
import weakref
from typing import ClassVar

import torch

import nvmeswap.gds as gds_module
import nvmeswap.io.operation as operation_module
import nvmeswap.io.placement as placement_module
from nvmeswap import _memory
from nvmeswap.io import cufile_placement
from nvmeswap.io.buffers import IoBuffer, io_buffer


class StandInCopier:
    """Copies like CudaCopier; counts bytes, notes pipelining, fails on request."""

    made: ClassVar[list] = []

    def __init__(self, tensor, stream):
        self.address = tensor.data_ptr()
        self.copied = 0
        self.in_flight_at_copy = []
        self.fail_at_piece = getattr(tensor, "fail_at_piece", None)
        self.kill_worker_at_piece = getattr(tensor, "kill_worker_at_piece", None)
        self.corrupt_copies = getattr(tensor, "corrupt_copies", False)
        self.handle = tensor.handle
        self.calls = 0
        StandInCopier.made.append(self)

    def _copy(self, destination, source, length):
        self.in_flight_at_copy.append(self.handle._scheduler.workers.chunks_in_flight)
        if self.calls == self.fail_at_piece:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.calls == self.kill_worker_at_piece:
            worker = self.handle._scheduler.workers.pool.workers[0].process
            worker.kill()
            worker.wait()
        self.calls += 1
        _memory.copy_memory(destination, source, length)
        self.copied += length

    def to_region(self, start, length, region, region_offset):
        self._copy(region.address + region_offset, self.address + start, length)
        if self.corrupt_copies:
            ctypes.c_ubyte.from_address(region.address + region_offset).value ^= 1

    def from_region(self, start, length, region, region_offset):
        self._copy(self.address + start, region.address + region_offset, length)

    def host_bytes(self, start, length):
        return self.address + start, None


def use_stand_in_device(monkeypatch):
    """Patch the handles to see marked tensors as device memory; return the staging
    regions they would have registered with CUDA."""
    StandInCopier.made = []
    registered = []

    def buffer_of(obj, *, writable):
        buf = io_buffer(obj, writable=writable)
        if hasattr(obj, "handle"):
            return IoBuffer(buf.owner, buf.address, buf.nbytes, device=torch.device("cuda", 0))
        return buf

    for module in (operation_module, gds_module):
        monkeypatch.setattr(module, "io_buffer", buffer_of)
    monkeypatch.setattr(placement_module, "CudaCopier", StandInCopier)
    monkeypatch.setattr(placement_module, "copy_stream", lambda device, streams: None)
    monkeypatch.setattr(placement_module, "register_for_device_copies", registered.append)
    monkeypatch.setattr(cufile_placement, "wait_for_queued_work", lambda device: None)
    return registered


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
        tensor = torch.frombuffer(memory, dtype=torch.uint8)[:size]
        if isinstance(data, bytes):
            tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    elif isinstance(data, bytes):
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        tensor = torch.zeros(size, dtype=torch.uint8)
    tensor.handle = h
    for name, value in marks.items():
        setattr(tensor, name, value)
    return tensor
