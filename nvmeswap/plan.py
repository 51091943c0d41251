"""How one operation is cut into chunks for the workers."""

# Below this a chunk costs more in dispatch than it gains in parallelism.
MIN_CHUNK = 256 << 10
# Staged operations are cut finer so that copying one piece overlaps the I/O of others.
STAGING_PIECE = 32 << 20


def chunk_bounds(file_offset, nbytes, parts, alignment):
    """Split ``[0, nbytes)`` into up to ``parts`` contiguous ``(start, length)`` chunks.

    Every boundary between chunks falls on an aligned *file* offset, so only the first
    chunk can have an unaligned head and only the last an unaligned tail.
    """
    if parts == 1:
        return [(0, nbytes)]
    bounds = [0]
    for k in range(1, parts):
        cut = (file_offset + nbytes * k // parts) // alignment * alignment - file_offset
        if bounds[-1] < cut < nbytes:
            bounds.append(cut)
    bounds.append(nbytes)
    return [(start, end - start) for start, end in zip(bounds, bounds[1:])]


def chunk_count(nbytes, parallelism, staged):
    """How many chunks an operation of ``nbytes`` is cut into."""
    parts = min(parallelism, max(1, nbytes // MIN_CHUNK))
    if staged:
        parts = max(parts, -(-nbytes // STAGING_PIECE))
    return parts


class StagingRing:
    """Note [device pipeline]: a CUDA tensor's bytes pass through a ring of host slots.

    A worker cannot reach device memory on the aio road, so the operation is cut into
    pieces of about ``PIECE`` bytes that take turns in ``slots`` slots of one locked
    region: a write copies a piece into a free slot and hands it to a worker, and the
    next copy runs while the workers write; a read lets the workers fill slots and
    copies each piece to the device as it lands, freeing its slot for the next piece.
    Staging stays at ``slots`` pieces whatever the size of the tensor (DeepNVMe locks a
    bounce buffer as large as the tensor per operation, and copies all of it before a
    write starts or after a read ends).
    """

    PIECE = 16 << 20

    def __init__(self, file_offset, nbytes, alignment, slots):
        self.pieces = chunk_bounds(file_offset, nbytes, -(-nbytes // self.PIECE), alignment)
        self._phase = file_offset % alignment
        # A piece is at most PIECE + alignment long and sits at its file offset's phase.
        self._stride = self.PIECE + 2 * alignment
        self._free = list(range(min(slots, len(self.pieces))))
        self._slot_of = {}
        self.started = 0

    def region_size(self):
        return len(self._free) * self._stride

    def start_next(self):
        """Take a free slot for the next piece; return the piece's index, or None."""
        if self.started == len(self.pieces) or not self._free:
            return None
        index = self.started
        self.started += 1
        self._slot_of[index] = self._free.pop()
        return index

    def region_offset(self, index):
        # Only the first piece can start off an aligned file offset (chunk_bounds).
        return self._slot_of[index] * self._stride + (self._phase if index == 0 else 0)

    def finish(self, index):
        self._free.append(self._slot_of.pop(index))

    def cancel_rest(self):
        """Give up the pieces not started; return how many there were."""
        left = len(self.pieces) - self.started
        self.started = len(self.pieces)
        return left
