"""Where the workers find an operation's bytes, and the chunks they take them in.

A buffer inside a locked region goes as is (zero-copy); any other host buffer is
copied through a staging region; a CUDA tensor takes the staging ring, piece by piece.
``gds_handle`` puts its own placement in front of this one (io/cufile_placement.py).
"""
from ..gpu.copies import CudaCopier, copy_stream, register_for_device_copies
from .chunks import plan_chunks
from .regions import RegionTable
from .staging import HostCopier, StagingPool, StagingRing

# Synchronous operations up to this size (and one block) run in the calling thread.
INLINE_LIMIT = 256 << 10


class HostPlacement:
    """Places operations in host memory the workers share: locked regions or staging."""

    def __init__(self, parallelism, block_size, locked=None):
        self.parallelism = parallelism
        self.block_size = block_size
        self.locked = locked if locked is not None else RegionTable()
        self.staging = StagingPool()
        self._copy_streams = {}

    def inline_limit(self, op):
        """Synchronous operations up to this size run in the calling thread
        (Note [small synchronous operations] in io/scheduler.py)."""
        limit = min(INLINE_LIMIT, self.block_size)
        if op.buffer.device is not None:
            limit = min(limit, StagingRing.PIECE)    # one piece: one slot
        return limit

    def place(self, op):
        """Choose the memory the workers use, and cut the operation into chunks."""
        buf, alignment = op.buffer, op.file.alignment
        if buf.device is not None:
            op.ring = StagingRing(op.file_offset, buf.nbytes, alignment,
                                  max(4, 2 * self.parallelism))
            op.region = self.staging.acquire(op.ring.region_size())
            op.staged = True
            register_for_device_copies(op.region)
            # Made in the caller's call: it orders the copies after the work queued so far.
            op.copier = CudaCopier(buf.owner, copy_stream(buf.device, self._copy_streams))
            op.chunks = op.ring.pieces
            op.remaining = len(op.chunks)
            return
        region = self.locked.containing(buf.address, buf.nbytes)
        if region is not None and (buf.address - op.file_offset) % alignment == 0:
            op.region, op.region_offset = region, buf.address - region.address
        else:
            # The staged copy sits at the file offset's alignment phase so that its
            # aligned middle can go through O_DIRECT.
            op.region = self.staging.acquire(buf.nbytes + alignment)
            op.region_offset = op.file_offset % alignment
            op.staged = True
            op.copier = HostCopier(buf.address, buf)
        op.chunks = plan_chunks(op.file_offset, buf.nbytes, self.parallelism, alignment,
                                op.staged)
        op.remaining = len(op.chunks)

    def map_requests(self, worker, region):
        """What a worker must be sent before its first request on ``region``."""
        return [region.map_request()]

    def give_back(self, op):
        """Take back the memory of a finished operation; return regions to unshare."""
        if op.staged:
            return self.staging.release(op.region)
        return [op.region] if op.owns_region else []

    def bytes_reader(self, op):
        """Something that shows the buffer's bytes on the host (for validation)."""
        if op.copier is not None:
            return op.copier
        if op.buffer.device is not None:
            return CudaCopier(op.buffer.owner, copy_stream(op.buffer.device, self._copy_streams))
        return HostCopier(op.buffer.address)

    def release(self):
        """Every region this placement holds, for the caller to close."""
        return [*self.locked.drain(), *self.staging.drain()]
