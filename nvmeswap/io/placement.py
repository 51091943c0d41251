"""Where the workers find an operation's bytes, and the chunks they take them in.

A buffer inside a locked region goes as is (zero-copy); any other buffer (plain host
memory, a CUDA tensor) is copied through the handle's staging space, piece by piece
(Note [staging ring] in io/staging.py). ``gds_handle`` puts its own placement in front
of this one (io/cufile_placement.py).
"""
from ..gpu.copies import CudaCopier, copy_stream, register_for_device_copies
from ..units import ALIGNMENT
from .chunks import plan_chunks
from .regions import RegionTable
from .staging import HostCopier, StagedPieces, StagingSpace


class HostPlacement:
    """Places operations in host memory the workers share: locked regions or staging."""

    cufile = None   # what a worker needs to load cuFile (CufilePlacement's)

    def __init__(self, parallelism, block_size, limits, locked=None):
        self.parallelism = parallelism
        self.block_size = block_size
        self.limits = limits
        self.locked = locked if locked is not None else RegionTable()
        self.staging = StagingSpace(limits, parallelism, ALIGNMENT)
        # Operations on host memory up to this size are small (Note [roads]).
        self.host_inline_limit = min(limits.inline_bytes, block_size, self.staging.piece)
        self._copy_streams = {}

    def inline_limit(self, op):
        """The same limit for ``op``: every buffer this placement takes is reached from
        host memory."""
        return self.host_inline_limit

    def place(self, op):
        """Choose the memory the workers use, and cut the operation into chunks."""
        buf, alignment = op.buffer, op.file.alignment
        if buf.device is None:
            region = self.locked.containing(buf.address, buf.nbytes)
            if region is not None and (buf.address - op.file_offset) % alignment == 0:
                op.region, op.region_offset = region, buf.address - region.address
                op.chunks = plan_chunks(op.file_offset, buf.nbytes, self.parallelism,
                                        alignment, self.limits.min_chunk)
                return
        op.staged = StagedPieces(self.staging, op.file_offset, buf.nbytes, alignment)
        op.region = self.staging.shared_region()
        if buf.device is None:
            op.copier = HostCopier(buf.address, buf)
        else:
            register_for_device_copies(op.region)
            # Made in the caller's call: it orders the copies after the work queued so far.
            # (Made again on another thread when cuFile refused the file, Note [cuFile
            # refusing a file]: cuFile's placement had already waited for that work.)
            op.copier = CudaCopier(buf, copy_stream(buf.device, self._copy_streams))
        op.chunks = op.staged.pieces

    def give_back(self, op):
        """Take back the memory of a finished operation; return regions to unshare."""
        if op.staged is not None:
            op.staged.release()
            return []
        return [op.region] if op.owns_region else []

    def bytes_reader(self, op):
        """Something that shows the buffer's bytes on the host (for validation)."""
        if op.copier is not None:
            return op.copier
        if op.buffer.device is not None:
            return CudaCopier(op.buffer, copy_stream(op.buffer.device, self._copy_streams))
        return HostCopier(op.buffer.address)

    def release(self):
        """Every region this placement holds, for the caller to close."""
        staging = self.staging.close()
        return [*self.locked.drain(), *([staging] if staging is not None else [])]
