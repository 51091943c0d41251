"""Copies between a CUDA tensor and the host staging memory the workers see.

On the aio road a worker never touches CUDA: a CUDA tensor's bytes are copied into a
shared region before a write and out of it after a read (io/staging.py has the ring and
the host copier), on a stream of the handle's own, through torch (already loaded
wherever there are CUDA tensors).

Note [stream order]
A copy from a CUDA tensor must see the work the caller queued before handing it to us
(the kernel that produced it), and a read must be complete for work queued after
``wait()``. So the copy stream first waits for the caller's current stream as it was at
submission, and every copy is synchronized before its slot is reused or the operation
is declared done: work queued later, on any stream, sees the bytes.
"""
from ..errors import warn_once

HOST_REGISTER_PORTABLE = 1     # cudaHostRegisterPortable

#: The CUDA runtime every copy goes through: None for ``torch.cuda``. The tests put a
#: stand-in with the same calls here (tests/stand_in_device.py), so that the code below
#: runs, streams, events and registration included, on machines without a GPU.
runtime = None


def cuda():
    """``torch.cuda``, or the stand-in runtime in ``runtime``."""
    if runtime is not None:
        return runtime
    import torch

    return torch.cuda


class CudaCopier:
    """Copies between the CUDA memory of an IoBuffer and staging regions (Note [stream
    order]). The buffer may be part of its tensor (a batch's request): its bytes start
    at its address, not at the tensor's."""

    __slots__ = ("_buffer", "_bytes", "_cuda", "_stream", "_torch")

    def __init__(self, buffer, stream):
        import torch

        tensor = buffer.owner
        self._torch = torch
        self._cuda = cuda()
        start = buffer.address - tensor.data_ptr()
        self._bytes = tensor.detach().reshape(-1).view(torch.uint8)[start:start + buffer.nbytes]
        self._buffer = buffer
        self._stream = stream
        stream.wait_stream(self._cuda.current_stream(tensor.device))

    def to_region(self, start, length, region, region_offset):
        self._buffer.check_alive()
        host = self._host(region, region_offset, length)
        with self._cuda.stream(self._stream):
            host.copy_(self._bytes[start:start + length], non_blocking=True)
        self._stream.synchronize()

    def from_region(self, start, length, region, region_offset):
        self._buffer.check_alive()
        host = self._host(region, region_offset, length)
        with self._cuda.stream(self._stream):
            self._bytes[start:start + length].copy_(host, non_blocking=True)
        self._stream.synchronize()

    def host_bytes(self, start, length):
        with self._cuda.stream(self._stream):
            copy = self._bytes[start:start + length].to("cpu")
        return copy.data_ptr(), copy

    def _host(self, region, offset, length):
        return self._torch.frombuffer(region.mapping, dtype=self._torch.uint8, count=length,
                                      offset=offset)


def wait_for_queued_work(device):
    """Note [stream order], for cuFile: it reads and writes device memory outside any
    stream, so the work the caller has queued must be finished before it starts."""
    cuda().current_stream(device).synchronize()


def mark_queued_work(device):
    """An event recorded on the caller's current stream of ``device``: synchronizing it,
    from any thread, waits for the work queued there so far (Note [stream order])."""
    event = cuda().Event()
    event.record(cuda().current_stream(device))
    return event


def copy_stream(device, streams):
    """The handle's own stream on ``device`` (made once, kept in ``streams``)."""
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = cuda().Stream(device=device)
    return stream


def register_for_device_copies(region):
    """Note [registered staging]: ``cudaHostRegister`` a staging region once, so copies
    between it and the GPU are DMA at full speed instead of passing through the driver's
    own bounce buffers. Registration costs milliseconds per GiB, so a region stays
    registered for its life; ``SharedRegion.close`` unregisters it. Refusal (the memory
    limit, a driver without it) costs speed, not correctness: one warning.
    """
    if region.unregister is None:
        region.unregister = register_range(region.address, region.size)


def register_range(address, size):
    """``cudaHostRegister`` (portable: pinned for every device's context, not only the
    current one) the ``size`` bytes at ``address``, as Note [registered staging]; the
    call that unregisters them, to be made before the memory goes, or None where
    registration was refused (one warning)."""
    cudart = cuda().cudart()
    status = cudart.cudaHostRegister(address, size, HOST_REGISTER_PORTABLE)
    if status != cudart.cudaError.success:
        warn_once("cudaHostRegister", f"cudaHostRegister of {size} bytes of host "
                  f"memory failed ({status}); GPU copies continue through unregistered memory, "
                  "more slowly", RuntimeWarning)
        return None

    def unregister():
        cudart.cudaHostUnregister(address)

    return unregister

