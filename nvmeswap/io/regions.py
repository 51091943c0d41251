"""Page-locked shared memory that workers map, and the table that finds a region by address.

A region is a memfd, so it reaches a worker as a file descriptor over its socket and
can never be left behind in /dev/shm; the memory is gone once the last mapping goes.
"""
import itertools
import os
import threading
import weakref

from .._memory import Mapping
from ..errors import MemoryLockWarning, warn_once
from ..workers import protocol

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
        self.unregister = None      # set by gpu.copies.register_for_device_copies
        _warn_if_refused(self.mapping.lock(), self.size)

    def map_request(self):
        """The message (and descriptors) that has a worker map this region."""
        return protocol.map_request(self.region_id, self.size), [self.fd]

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
                  MemoryLockWarning)


class RegionTable:
    """Regions that callers' tensors live in (locked host tensors, pinned device tensors),
    found by address: I/O on a tensor inside one goes to the workers without a copy.

    Thread-safe; every handle of the process shares the locked one (``LockedMemory``).
    """

    def __init__(self):
        self._regions = {}
        self._lock = threading.Lock()

    def add(self, region):
        with self._lock:
            self._regions[region.region_id] = region

    def containing(self, address, nbytes):
        """The region that holds ``[address, address + nbytes)``, or None."""
        with self._lock:
            return next((r for r in self._regions.values() if r.contains(address, nbytes)),
                        None)

    def pop_starting_at(self, address):
        """Remove and return the region that begins at ``address`` (None if there is none)."""
        with self._lock:
            for region in self._regions.values():
                if region.address == address:
                    return self._regions.pop(region.region_id)
        return None

    def pop_containing(self, address):
        """Remove and return the region that holds ``address`` (None if there is none)."""
        region = self.containing(address, 0)
        with self._lock:
            return self._regions.pop(region.region_id, None) if region is not None else None

    def __contains__(self, region_id):
        return region_id in self._regions

    def drain(self):
        """Remove every region and return them (for the caller to close)."""
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
        return regions


class LockedMemory:
    """Note [process-wide locked memory]: the locked host regions of the whole process.

    DeepSpeed keeps one pinned-tensor set per process: a tensor locked through any handle
    (or through its pin-memory op) is pinned for every handle. So every handle, and every
    ``PinMemoryBuilder().load().pin_handle()``, joins this one set as a user
    (``LockedUser``): a region added by any of them is found, and goes zero-copy, in all.

    Invariants: a freed region is unmapped by the workers of every live user before its
    descriptor is closed; the regions are closed when the last user leaves. A forked
    child starts with an empty set (``locked_memory()``), never touching the parent's.
    """

    def __init__(self):
        self.table = RegionTable()
        self._users = set()
        self._lock = threading.Lock()
        self.creator_pid = os.getpid()

    def join(self, scheduler=None):
        """A new user; ``scheduler`` (set later with ``LockedUser.attach``) owns workers
        that may map the set's regions."""
        user = LockedUser(self, scheduler)
        with self._lock:
            self._users.add(user)
        return user

    def leave(self, user):
        """Forget ``user``; if it was the last, empty the set and return its regions for
        the caller to close (nobody can do I/O on them any more)."""
        with self._lock:
            self._users.discard(user)
            return [] if self._users else self.table.drain()

    def free(self, region):
        """Unmap ``region`` in the workers of every user, then close our descriptor."""
        with self._lock:
            users = list(self._users)
        for user in users:
            user.unshare(region)
        region.close()

    @property
    def users(self):
        with self._lock:
            return len(self._users)


class LockedUser:
    """One user's view of the process-wide set, with the interface of ``RegionTable``
    that placements use (``locked``). ``drain()`` is the user leaving."""

    def __init__(self, memory, scheduler=None):
        self.memory = memory
        self._scheduler = None
        self._left = False
        if scheduler is not None:
            self.attach(scheduler)

    def attach(self, scheduler):
        # Weak: the scheduler holds its placement, which holds this user.
        self._scheduler = weakref.ref(scheduler)

    def unshare(self, region):
        scheduler = self._scheduler() if self._scheduler is not None else None
        if scheduler is not None and not scheduler.closed \
                and os.getpid() == scheduler.creator_pid:
            scheduler.unshare(region)

    # -- RegionTable's interface, on the shared table ------------------------------------
    def add(self, region):
        self.memory.table.add(region)

    def containing(self, address, nbytes):
        return self.memory.table.containing(address, nbytes)

    def pop_starting_at(self, address):
        return self.memory.table.pop_starting_at(address)

    def pop_containing(self, address):
        return self.memory.table.pop_containing(address)

    def __contains__(self, region_id):
        return region_id in self.memory.table

    def drain(self):
        """This user leaves; the regions to close if it was the last one."""
        if self._left:
            return []
        self._left = True
        return self.memory.leave(self)


_locked_memory = None
_locked_memory_lock = threading.Lock()


def locked_memory():
    """The process's ``LockedMemory`` (a fresh one in a forked child)."""
    global _locked_memory
    with _locked_memory_lock:
        if _locked_memory is None or _locked_memory.creator_pid != os.getpid():
            _locked_memory = LockedMemory()
        return _locked_memory
