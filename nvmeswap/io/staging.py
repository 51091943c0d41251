"""Staging memory for buffers the workers cannot reach: the handle's one staging region,
lent out piece by piece, and the host copier that fills and empties it.
"""
from .._memory import copy_memory
from ..units import round_up
from .chunks import chunk_bounds
from .regions import Extents, SharedRegion, file_size_limit


class StagingSpace:
    """Note [staging ring]: the one staging region of a handle, lent out piece by piece.

    Workers reach only shared memory, so the bytes of any other buffer (a plain tensor, a
    numpy array, a CUDA tensor) pass through this region: a staged operation is cut into
    pieces of at most ``piece`` bytes, and each piece borrows an extent of the region
    while it is with a worker. A write copies a piece into its extent and hands it out,
    and copies the next while the workers write; a read copies each piece out as it
    lands, freeing its extent for the next. So staging is ``nbytes`` whatever the sizes
    and the number of operations (DeepNVMe locks a bounce buffer as large as the tensor,
    per operation, and copies all of it before a write starts or after a read ends).
    Extents are taken first-fit and given back in any order; the region is made at the
    first staged operation and freed with the handle.
    """

    def __init__(self, limits, parallelism, alignment):
        self.limits = limits
        nbytes = round_up(max(limits.staging_bytes, 8 * alignment), alignment)
        file_limit = file_size_limit()
        if file_limit is not None:      # the space is a memfd file: it must fit the limit
            # Two units at least: a piece at a phase spans one more (below that, the
            # space is refused when it is made, naming the limit).
            nbytes = min(nbytes, max(2 * alignment, file_limit // alignment * alignment))
        self.nbytes = nbytes
        # Enough pieces in flight for every worker and one being copied, at least four.
        self.piece = max(alignment, (self.nbytes // max(4, 2 * parallelism)) // alignment
                         * alignment - 2 * alignment)
        self.region = None
        self.extents = Extents(self.nbytes, alignment)     # lent to pieces in flight

    def shared_region(self):
        if self.region is None:
            # Locked page by page as pieces first touch it: an operation smaller than
            # the space pays only for what it uses.
            self.region = SharedRegion(self.nbytes, lock_on_fault=True,
                                       arena_bytes=self.limits.arena_bytes)
        return self.region

    def close(self):
        """The region, for the caller to unshare (None if none was made)."""
        region, self.region = self.region, None
        return region


class StagedPieces:
    """One staged operation's pieces and the extents of the staging space they hold.

    Every piece but the first starts at an aligned file offset (``chunk_bounds``); the
    first sits in its extent at its file offset's phase, so that the aligned middle can
    go through O_DIRECT.
    """

    def __init__(self, space, file_offset, nbytes, alignment):
        self.space = space
        # A few pieces even where one would do (Limits.pipeline_pieces): the first
        # piece's copy is the one that nothing overlaps.
        limits = space.limits
        count = max(-(-nbytes // space.piece),
                    min(limits.pipeline_pieces, nbytes // limits.min_piece))
        self.pieces = chunk_bounds(file_offset, nbytes, count, alignment)
        self._phase = file_offset % alignment
        self._extent_of = {}    # piece index -> (start, length) in the space
        self.started = 0

    def start_next(self):
        """Take an extent for the next piece; return the piece's index, or None."""
        if self.started == len(self.pieces):
            return None
        index = self.started
        length = self.pieces[index][1] + (self._phase if index == 0 else 0)
        start = self.space.extents.take(length)
        if start is None:
            return None
        self._extent_of[index] = (start, length)
        self.started += 1
        return index

    def can_start_next(self):
        """Whether ``start_next`` would find room for the next piece now."""
        return self.started < len(self.pieces) and self.space.extents.fits(
            self.pieces[self.started][1] + (self._phase if self.started == 0 else 0))

    def waiting(self):
        """Whether pieces wait for room in the staging space."""
        return self.started < len(self.pieces)

    def region_offset(self, index):
        return self._extent_of[index][0] + (self._phase if index == 0 else 0)

    def finish(self, index):
        self.space.extents.give(*self._extent_of.pop(index))

    def cancel_rest(self):
        """Give up the pieces not started; return how many there were."""
        left = len(self.pieces) - self.started
        self.started = len(self.pieces)
        return left

    def release(self):
        """Give back every extent still held (the workers that had them are gone)."""
        for index in list(self._extent_of):
            self.finish(index)


class HostCopier:
    """memcpy between host memory at ``address`` and staging regions.

    ``buffer``: the caller's IoBuffer, checked before each copy (a tensor's storage can
    be resized between a call and its ``wait()``).
    """

    __slots__ = ("address", "buffer")

    def __init__(self, address, buffer=None):
        self.address = address
        self.buffer = buffer

    def to_region(self, start, length, region, region_offset):
        if self.buffer is not None:
            self.buffer.check_alive()
        copy_memory(region.address + region_offset, self.address + start, length)

    def from_region(self, start, length, region, region_offset):
        if self.buffer is not None:
            self.buffer.check_alive()
        copy_memory(self.address + start, region.address + region_offset, length)

    def host_bytes(self, start, length):
        """The buffer's bytes ``[start, start + length)`` as host memory: (address, keeper)."""
        return self.address + start, None
