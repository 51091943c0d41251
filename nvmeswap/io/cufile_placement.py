"""gds_handle's placement: CUDA tensors go to the workers' cuFile as device regions
(gpu/ipc.py); everything else as the host placement puts it.

See Note [device regions] in gpu/ipc.py.
"""
import os

from .. import mounts
from ..errors import CudaError, CuFileError, GdsFallbackWarning, warn_once
from ..gpu.copies import wait_for_queued_work
from ..gpu.ipc import DeviceRegion
from .chunks import plan_chunks
from .process_state import region_ids
from .regions import RegionTable

# cuFile statuses that say a file cannot go through cuFile, whatever the memory.
FILE_REFUSALS = frozenset({
    5007,   # PLATFORM_NOT_SUPPORTED
    5008,   # IO_NOT_SUPPORTED
    5009,   # DEVICE_NOT_SUPPORTED
    5010,   # NVFS_DRIVER_ERROR
    5018,   # INVALID_FILE_TYPE
    5019,   # INVALID_FILE_OPEN_FLAG
    5020,   # DIO_NOT_SET
    5027,   # HANDLE_NOT_REGISTERED: cloud VMs without nvidia-fs refuse every file so
    5029,   # DEVICE_NOT_FOUND
    5033,   # NVFS_SETUP_ERROR
    5034,   # IO_DISABLED
})


class CufilePlacement:
    """CUDA tensors as device regions for cuFile; everything else as ``host`` places it.

    ``libraries``: the (cuFile, driver) paths the workers load, or None where cuFile is
    not usable (then CUDA tensors take the host placement's staging ring).
    ``config_fd``: a memfd of cuFile's JSON configuration, or -1; closed by ``release``.
    Both are what a worker is sent to load cuFile (``cufile``), before its first device
    region.
    """

    def __init__(self, host, libraries, config_fd=-1):
        self.host = host
        self.locked = host.locked
        self.limits = host.limits
        self.pinned = RegionTable()
        self.libraries = libraries
        self.config_fd = config_fd
        self.refused = set()    # identities of the files cuFile refused

    @property
    def cufile(self):
        return self if self.libraries is not None else None

    @property
    def host_inline_limit(self):
        return self.host.host_inline_limit

    def inline_limit(self, op):
        if self._for_cufile(op):
            return 0        # cuFile runs in the workers, never in the calling thread
        return self.host_inline_limit

    def place(self, op):
        buf = op.buffer
        region = self._cufile_region(buf) if self._for_cufile(op) else None
        if region is None:
            self.host.place(op)
            return
        wait_for_queued_work(buf.device)
        op.region, op.region_offset = region, buf.address - region.address
        op.owns_region = region.region_id not in self.pinned
        op.chunks = plan_chunks(op.file_offset, buf.nbytes, self.host.parallelism,
                                op.file.alignment, self.limits.min_chunk)

    def refuse(self, op):
        """Note [cuFile refusing a file]: True if ``op`` failed because cuFile refused its
        file; the file takes the staging road from now on, ``op`` is to be done again
        there.

        cuFile can load and open its driver and still refuse every file (a cloud VM
        without nvidia-fs answers cuFileHandleRegister with HANDLE_NOT_REGISTERED), or
        the files of one filesystem. Such a file's operations move through locked host
        memory, as aio_handle moves CUDA tensors; other files still try cuFile. An
        operation that met the refusal is done again whole on the staging road (its
        descriptors kept for it, its place in the order of the file's operations kept):
        what cuFile wrote of it is written again, a read fills the tensor anew. Real I/O
        errors stay errors.
        """
        error = op.error
        if not isinstance(error, CuFileError) or error.code not in FILE_REFUSALS:
            return False
        self.refused.add(op.file.identity)
        warn_gds(("refused", error.code, op.file.identity[0]),
                 f"cuFile refuses {op.file.name} ({error.name}; a file on "
                 f"{filesystem_of(op.file.identity[0])}): CUDA tensors move through locked "
                 "host memory for it, as aio_handle moves them")
        return True

    def _for_cufile(self, op):
        return (op.buffer.device is not None and self.libraries is not None
                and op.file.identity not in self.refused)

    def pin(self, buf):
        """Keep ``buf``'s CUDA memory as a region every worker maps once; False if it cannot
        go to cuFile."""
        if self.libraries is None:
            return False
        if self.pinned.containing(buf.address, buf.nbytes) is not None:
            return True
        region = self._export(buf)
        if region is None:
            return False
        self.pinned.add(region)
        return True

    def give_back(self, op):
        regions = self.host.give_back(op)
        region = op.region
        if (region is not None and region.on_device and not op.owns_region
                and region.region_id not in self.pinned):
            # Unpinned while ``op`` was held: sending it mapped the region in a worker
            # again, and nothing else will unmap it there.
            regions.append(region)
        return regions

    def bytes_reader(self, op):
        return self.host.bytes_reader(op)

    def release(self):
        if self.config_fd >= 0:
            os.close(self.config_fd)
            self.config_fd = -1
        return [*self.host.release(), *self.pinned.drain()]

    def _cufile_region(self, buf):
        if self.libraries is None:
            return None
        return self.pinned.containing(buf.address, buf.nbytes) or self._export(buf)

    def _export(self, buf):
        try:
            # The region holds the tensor and its storage while workers map it.
            return DeviceRegion(next(region_ids), (buf.owner, buf.storage), buf.address,
                                buf.nbytes, buf.device.index)    # a tensor's device has one
        except CudaError as error:
            warn_gds("export", f"CUDA memory the workers cannot map ({error}; torch's "
                     "expandable_segments allocates such memory) moves through locked host "
                     "memory instead of cuFile")
            return None


def warn_gds(key, message):
    warn_once(("gds", key), message, GdsFallbackWarning)


def filesystem_of(device):
    """``"ext4 at /mnt/nvme"``: the type and mount point of the filesystem on ``device``
    (an ``st_dev``); or the device's numbers."""
    mount = mounts.of_device(device)
    if mount is None:
        return f"device {os.major(device)}:{os.minor(device)}"
    return f"{mount.fs_type} at {mount.point}"
