"""Page-locked shared memory: the regions that locked tensors and staging buffers live in.

A region is a memfd, so it reaches a worker as a file descriptor over its socket and
can never be left behind in /dev/shm; the memory is gone once the last mapping goes.
"""
import itertools
import os
import threading

from . import protocol
from ._memory import Mapping
from .errors import MemoryLockWarning, warn_once

PAGE = os.sysconf("SC_PAGE_SIZE")
# Host and device regions share one numbering: a worker's UNMAP names either.
region_ids = itertools.count(1)


def round_up(n, multiple):
    return -(-n // multiple) * multiple


class SharedRegion:
    """Page-aligned, page-locked (when allowed) memory that workers can map by fd."""

    read_kind, write_kind = protocol.READ, protocol.WRITE

    __slots__ = ("region_id", "fd", "mapping", "size", "address", "unregister", "__weakref__")

    def __init__(self, nbytes):
        self.region_id = next(region_ids)
        self.size = round_up(max(nbytes, 1), PAGE)
        self.fd = os.memfd_create("nvmeswap", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.mapping = Mapping(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.address = self.mapping.address
        self.unregister = None      # set by device.register_for_device_copies
        _warn_if_refused(self.mapping.lock(), self.size)

    def map_request(self):
        """The message (and descriptors) that has a worker map this region."""
        return protocol.REQUEST.pack(protocol.MAP, self.region_id, 0, 0, 0, self.size, 0, 0), \
            [self.fd]

    def contains(self, address, nbytes):
        return self.address <= address and address + nbytes <= self.address + self.size

    def close(self):
        """Drop our descriptor; the memory goes when the last mapping of it goes."""
        if self.unregister is not None:
            self.unregister()
            self.unregister = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.mapping = None


def _warn_if_refused(err, size):
    if err:
        warn_once("page-lock", f"could not page-lock {size} bytes ({os.strerror(err)}); "
                  "continuing with unlocked shared memory. Raise the limit with `ulimit -l "
                  "unlimited` (or memlock in /etc/security/limits.conf) for locked tensors.",
                  MemoryLockWarning, stacklevel=4)


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
