"""Staging memory for buffers the workers cannot reach: a reusable pool of locked regions,
the ring a CUDA tensor's pieces take turns in, and the host copier that fills them.
"""
import threading

from .._memory import copy_memory
from .chunks import chunk_bounds
from .regions import SharedRegion, round_up


class StagingPool:
    """Reusable locked regions that ordinary buffers are copied through.

    Regions are kept after use, so an operation costs no allocation, page fault or
    mlock once the pool has grown to the sizes in use. Idle regions beyond
    ``idle_limit`` bytes are handed back for freeing, smallest first, but the largest
    is always kept: a program that moves one big plain tensor over and over keeps its
    staging, one that once had many in flight does not keep them all.
    """

    GRANULE = 1 << 21

    def __init__(self, idle_limit=256 << 20):
        self._idle = []
        self._idle_limit = idle_limit
        self._lock = threading.Lock()

    def acquire(self, nbytes):
        with self._lock:
            fitting = [r for r in self._idle if r.size >= nbytes]
            if fitting:
                region = min(fitting, key=lambda r: r.size)
                self._idle.remove(region)
                return region
        return SharedRegion(round_up(nbytes, self.GRANULE))

    def release(self, region):
        """Take ``region`` back; return the idle regions the caller should free."""
        with self._lock:
            self._idle.append(region)
            self._idle.sort(key=lambda r: r.size)
            surplus = []
            while len(self._idle) > 1 and sum(r.size for r in self._idle) > self._idle_limit:
                surplus.append(self._idle.pop(0))
            return surplus

    def drain(self):
        """Hand back every idle region (for the caller to unmap and close)."""
        with self._lock:
            idle, self._idle = self._idle, []
        return idle


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
