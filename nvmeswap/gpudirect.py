"""``nvmeswap.gds_handle``: DeepNVMe's gds_handle, with cuFile in the worker processes.

Note [device regions]
A worker cannot use the parent's device pointers, so CUDA memory reaches it through
CUDA IPC: the parent exports the allocation that holds a tensor (cuMemGetAddressRange,
cuIpcGetMemHandle), each worker opens it in the same device's primary context,
registers the tensor's range with cuFile, and reads or writes its chunk at the
tensor's offset in it. A pinned tensor (``pin_device_tensor``) is mapped and registered
by each worker once and stays so until unpinned; any other tensor is mapped and
registered on the fly for one operation. (Registration is a speed-up, not a condition:
where cuFile refuses it, the worker goes on unregistered.) The handle holds the tensor
while workers map it, so the memory cannot be freed under them. Memory that cannot be
exported (allocated with cuMemCreate, as torch's expandable segments are) takes the aio
road of aio_handle, with one warning.
"""
import json
import os

from . import _cuda, protocol
from .buffers import io_buffer
from .device import wait_for_queued_work
from .errors import CudaError, GdsFallbackWarning, warn_once
from .gds import gds_available, gds_unavailable_reason, library_paths, nvidia_fs_loaded
from .handle import aio_handle
from .memory import region_ids
from .plan import chunk_bounds, chunk_count


class DeviceRegion:
    """A range of CUDA memory that workers map by IPC (Note [device regions])."""

    read_kind, write_kind = protocol.GDS_READ, protocol.GDS_WRITE

    def __init__(self, owner, address, nbytes, ordinal):
        self.region_id = next(region_ids)
        self.owner = owner      # the tensor, kept alive while workers map it
        self.address = address
        self.size = nbytes
        self.ordinal = ordinal
        self.ipc_handle, self.allocation_base, _ = _cuda.export(address, ordinal)

    def map_request(self):
        header = protocol.REQUEST.pack(protocol.GDS_MAP, self.region_id, 0, 0, 0, self.size, 0, 0)
        return header + protocol.DEVICE_REGION.pack(
            self.ipc_handle, self.ordinal, self.address - self.allocation_base), []

    def contains(self, address, nbytes):
        return self.address <= address and address + nbytes <= self.address + self.size

    def close(self):
        self.owner = None


class gds_handle(aio_handle):
    """DeepNVMe's gds_handle: CUDA tensors go straight between the GPU and the file.

    Takes aio_handle's arguments, and

    cufile_config : dict or str, optional
        cuFile's configuration (the JSON of cufile.json, as a dict, or the path of such a
        file), handed to the workers' cuFile explicitly; nothing is written to disk.
        None leaves cuFile to its defaults ($CUFILE_ENV_PATH_JSON or /etc/cufile.json).

    CUDA tensors are read and written with cuFile, split over ``intra_op_parallelism``
    workers (Note [device regions]); ``pin_device_tensor`` registers a tensor with cuFile
    for the fastest transfers, and slices of a pinned tensor use its registration. CPU
    tensors take the aio road. Where cuFile cannot be used (not installed, no CUDA
    driver) the handle still works, moving CUDA tensors as aio_handle does, after one
    ``GdsFallbackWarning``; it never exits the process.
    """

    def __init__(self, block_size=1048576, queue_depth=128, single_submit=False,
                 overlap_events=False, intra_op_parallelism=1, *, cufile_config=None,
                 **options):
        config = _config_json(cufile_config)
        super().__init__(block_size, queue_depth, single_submit, overlap_events,
                         intra_op_parallelism, **options)
        self._pinned = {}
        self._config_fd = -1
        self._libraries = library_paths() if gds_available() else None
        if self._libraries is None:
            _warn_once("unavailable", f"{gds_unavailable_reason()}; gds_handle moves CUDA "
                       "tensors through locked host memory instead, as aio_handle does")
            return
        if not nvidia_fs_loaded():
            _warn_once("compat", "the nvidia-fs kernel module is not loaded, so cuFile runs in "
                       "compat mode (POSIX I/O through its own host bounce buffers)")
        if config is not None:
            self._config_fd = os.memfd_create("nvmeswap-cufile-json", os.MFD_CLOEXEC)
            os.write(self._config_fd, config)
            self._resources.descriptors.append(self._config_fd)

    # -- cuFile buffer registration (DeepNVMe names) ---------------------------------------
    def new_pinned_device_tensor(self, num_elem, example_tensor):
        """A 1-D CUDA tensor of ``example_tensor``'s dtype (and device, if a CUDA one),
        registered with cuFile."""
        import torch

        device = example_tensor.device if example_tensor.is_cuda else \
            torch.device("cuda", torch.cuda.current_device())
        tensor = torch.empty(num_elem, dtype=example_tensor.dtype, device=device)
        self.pin_device_tensor(tensor)
        return tensor

    def free_pinned_device_tensor(self, tensor):
        """Unregister a tensor from ``new_pinned_device_tensor``; the memory goes with it."""
        return self.unpin_device_tensor(tensor)

    def pin_device_tensor(self, tensor):
        """Keep a CUDA tensor mapped in every worker, registered with cuFile there (on
        each worker's first use of it); True when its I/O goes to cuFile.

        False when cuFile is not in use here or the memory cannot be shared with the
        workers (each with one warning): its I/O still works, on the aio road. The handle
        holds the tensor until ``unpin_device_tensor``.
        """
        self._check_usable()
        buf = io_buffer(tensor, writable=True)
        if buf.device is None:
            raise TypeError(f"pin_device_tensor takes CUDA tensors; got one on {tensor.device}")
        if self._libraries is None:
            return False
        with self._cond:
            if self._pinned_region(buf.address, buf.nbytes) is not None:
                return True
            region = self._export(buf)
            if region is None:
                return False
            self._pinned[region.region_id] = region
        return True

    def unpin_device_tensor(self, tensor):
        """Undo ``pin_device_tensor``; False if the tensor was not pinned by this handle."""
        self._check_usable()
        with self._cond:
            for region in list(self._pinned.values()):
                if region.address == tensor.data_ptr():
                    del self._pinned[region.region_id]
                    self._unshare(region)
                    return True
        return False

    def close(self):
        super().close()
        self._pinned.clear()

    def __repr__(self):
        return super().__repr__().replace("aio_handle", "gds_handle", 1)

    # -- the cuFile road ---------------------------------------------------------------------
    def _inline_limit(self, op):
        if op.buffer.device is not None and self._libraries is not None:
            return 0        # cuFile runs in the workers, never in the calling thread
        return super()._inline_limit(op)

    def _place(self, op):
        region = self._cufile_region(op.buffer) if op.buffer.device is not None else None
        if region is None:
            super()._place(op)
            return
        wait_for_queued_work(op.buffer.device)
        op.region, op.region_offset = region, op.buffer.address - region.address
        op.owns_region = region.region_id not in self._pinned
        parts = chunk_count(op.buffer.nbytes, self._parallelism, False)
        op.chunks = chunk_bounds(op.file_offset, op.buffer.nbytes, parts, op.file.alignment)
        op.remaining = len(op.chunks)

    def _cufile_region(self, buf):
        if self._libraries is None:
            return None
        return self._pinned_region(buf.address, buf.nbytes) or self._export(buf)

    def _pinned_region(self, address, nbytes):
        for region in self._pinned.values():
            if region.contains(address, nbytes):
                return region
        return None

    def _export(self, buf):
        try:
            return DeviceRegion(buf.owner, buf.address, buf.nbytes,
                                buf.device.index)    # a tensor's device has one
        except CudaError as error:
            _warn_once("export", f"CUDA memory the workers cannot map ({error}; torch's "
                       "expandable_segments allocates such memory) moves through locked host "
                       "memory instead of cuFile")
            return None

    def _map_requests(self, worker, region):
        requests = super()._map_requests(worker, region)
        if isinstance(region, DeviceRegion) and "cufile" not in worker.mapped:
            worker.mapped.add("cufile")     # load cuFile there before its first device map
            paths = b"\0".join(os.fsencode(path) for path in self._libraries)
            setup = protocol.REQUEST.pack(protocol.GDS_SETUP, 0, 0, 0, 0, 0, 0, 0) + paths
            requests.insert(0, (setup, [self._config_fd] if self._config_fd >= 0 else []))
        return requests


def _config_json(config):
    """cuFile's configuration as JSON bytes (Note [cuFile configuration] in gds_worker.py)."""
    if config is None:
        return None
    if isinstance(config, dict):
        return json.dumps(config).encode()
    if isinstance(config, (str, os.PathLike)):
        with open(config, "rb") as source:
            data = source.read()
        try:
            json.loads(data)
        except ValueError as error:
            raise ValueError(f"{os.fspath(config)}: not a cuFile JSON configuration: "
                             f"{error}") from None
        return data
    raise TypeError(f"cufile_config must be a dict or a path, got {type(config).__name__}")


def _warn_once(key, message):
    warn_once(("gds", key), message, GdsFallbackWarning, stacklevel=3)
