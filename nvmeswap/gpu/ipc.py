"""CUDA memory shared with the worker processes by CUDA IPC.

Note [device regions]
A worker cannot use the parent's device pointers, so CUDA memory reaches it through
CUDA IPC: the parent exports the allocation that holds a tensor (cuMemGetAddressRange,
cuIpcGetMemHandle), each worker opens it in the same device's primary context,
registers the tensor's range with cuFile, and reads or writes its chunk at the
tensor's offset in it. A pinned tensor (``pin_device_tensor``) is mapped and registered
by each worker once and stays so until unpinned; any other tensor is mapped and
registered on the fly for one operation. (Registration is a speed-up, not a condition:
where cuFile refuses it, the worker goes on unregistered.) The region holds the tensor
while workers map it, so the memory cannot be freed under them. Memory that cannot be
exported (allocated with cuMemCreate, as torch's expandable segments are) takes the aio
road of aio_handle, with one warning.
"""
from .. import _cuda


class DeviceRegion:
    """A range of CUDA memory that workers map by IPC (Note [device regions])."""

    on_device = True

    def __init__(self, region_id, owner, address, nbytes, ordinal):
        self.region_id = region_id
        self.owner = owner      # the tensor, kept alive while workers map it
        self.address = address
        self.size = nbytes
        self.ordinal = ordinal
        self.ipc_handle, self.allocation_base, _ = _cuda.export(address, ordinal)

    def contains(self, address, nbytes):
        return self.address <= address and address + nbytes <= self.address + self.size

    def close(self):
        self.owner = None
