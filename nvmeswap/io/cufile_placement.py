"""gds_handle's placement: CUDA tensors go to the workers' cuFile as device regions
(gpu/ipc.py); everything else as the host placement puts it.

See Note [device regions] in gpu/ipc.py.
"""
import os

from ..errors import CudaError, GdsFallbackWarning, warn_once
from ..gpu.copies import wait_for_queued_work
from ..gpu.ipc import DeviceRegion
from .chunks import plan_chunks
from .process_state import region_ids
from .regions import RegionTable


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

    @property
    def cufile(self):
        return self if self.libraries is not None else None

    @property
    def host_inline_limit(self):
        return self.host.host_inline_limit

    def inline_limit(self, op):
        if op.buffer.device is not None and self.libraries is not None:
            return 0        # cuFile runs in the workers, never in the calling thread
        return self.host_inline_limit

    def place(self, op):
        buf = op.buffer
        region = self._cufile_region(buf) if buf.device is not None else None
        if region is None:
            self.host.place(op)
            return
        wait_for_queued_work(buf.device)
        op.region, op.region_offset = region, buf.address - region.address
        op.owns_region = region.region_id not in self.pinned
        op.chunks = plan_chunks(op.file_offset, buf.nbytes, self.host.parallelism,
                                op.file.alignment, self.limits.min_chunk)

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
        return self.host.give_back(op)

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
