"""Page-locked shared memory that workers map, and the table that finds a region by address.

Note [memfd arenas]: a region is a range of a memfd "arena", so it reaches a worker as a
descriptor over its socket (with its offset) and can never be left behind in /dev/shm.
Regions share a few arenas rather than owning a descriptor each: a memfd's size is only
virtual (pages exist once touched), so an arena is made large and carved first-fit, and a
thousand locked tensors hold a handful of descriptors, not a thousand. A region's range
goes back to its arena only when its mapping is gone (tensors made from it hold the
mapping), its pages given back to the system at once; an arena is closed when its last
range comes back.
"""
import bisect
import collections
import errno
import os
import resource
import threading
import weakref

from .._memory import Mapping, punch_hole
from ..errors import MemoryLockWarning, warn_once
from ..units import PAGE, round_up
from .limits import DEFAULT
from .process_state import region_ids, shared


class Extents:
    """First-fit extents of ``[0, nbytes)``, taken and given back in any order, in
    multiples of ``alignment``. Used by arenas and by the staging space. Not thread-safe:
    its owner locks."""

    def __init__(self, nbytes, alignment):
        self.nbytes = nbytes
        self.alignment = alignment
        self._free = [(0, nbytes)]      # (start, length), sorted, never adjacent

    def take(self, nbytes, boundary=1):
        """The start of a free extent of at least ``nbytes`` (aligned) that starts on a
        multiple of ``boundary``, or None."""
        nbytes = round_up(nbytes, self.alignment)
        for k, (start, length) in enumerate(self._free):
            taken = round_up(start, boundary)
            left = start + length - taken - nbytes
            if left < 0:
                continue
            if left:
                self._free[k] = (taken + nbytes, left)
            else:
                del self._free[k]
            if taken > start:       # the gap before the boundary stays free
                self._free.insert(k, (start, taken - start))
            return taken
        return None

    def fits(self, nbytes):
        """Whether ``take(nbytes)`` would find an extent."""
        nbytes = round_up(nbytes, self.alignment)
        return any(length >= nbytes for _, length in self._free)

    def give(self, start, nbytes):
        """Take back the extent at ``start`` (as long as it was taken)."""
        nbytes = round_up(nbytes, self.alignment)
        k = bisect.bisect(self._free, (start, 0))
        end = start + nbytes
        if k < len(self._free) and self._free[k][0] == end:     # join the next
            end += self._free.pop(k)[1]
        if k > 0 and sum(self._free[k - 1]) == start:            # and the previous
            start = self._free.pop(k - 1)[0]
            k -= 1
        self._free.insert(k, (start, end - start))

    @property
    def all_free(self):
        return self._free == [(0, self.nbytes)]


class Arena:
    """One memfd whose ranges are regions (Note [memfd arenas])."""

    __slots__ = ("extents", "fd")

    def __init__(self, nbytes):
        limit = beyond_file_size_limit(nbytes)
        if limit is not None:       # refused before SIGXFSZ could come
            raise _past_file_size_limit(nbytes, limit)
        self.fd = _memfd_create()
        try:
            os.ftruncate(self.fd, nbytes)
        except BaseException as error:
            os.close(self.fd)
            if isinstance(error, OSError) and error.errno == errno.EFBIG:
                raise _past_file_size_limit(nbytes, file_size_limit()) from None
            raise
        self.extents = Extents(nbytes, PAGE)


#: Transparent huge pages of shared memory, where the system gives them (x86-64, arm64
#: with 4 KiB base pages).
HUGE_PAGE = 2 << 20


def _past_file_size_limit(nbytes, limit):
    return OSError(errno.EFBIG, f"cannot make {nbytes} bytes of shared memory: it is a "
                   "memfd file (locked tensors and a handle's staging space are), and the "
                   f"file-size limit (`ulimit -f`, RLIMIT_FSIZE) is {limit} bytes; raise "
                   "the limit")


def file_size_limit():
    """The file-size limit in bytes (None: no limit). A memfd is a file too: batch
    schedulers' ``ulimit -f`` limits the shared memory an arena or staging space can be,
    so both are made no larger than it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def beyond_file_size_limit(end):
    """The file-size limit, if a file that reaches ``end`` bytes would pass it; else None."""
    limit = file_size_limit()
    return limit if limit is not None and end > limit else None


def _memfd_create():
    try:
        return os.memfd_create("nvmeswap", os.MFD_CLOEXEC)
    except OSError as error:
        if error.errno != errno.EMFILE:
            raise
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise OSError(errno.EMFILE, "cannot create shared memory for a locked region: too "
                      f"many open files (RLIMIT_NOFILE is {soft}); raise the limit with "
                      "`ulimit -n` or close some files") from None


class Arenas:
    """The process's arenas: carves ranges, takes them back when their mapping is gone.

    Thread-safe. A range comes back from a weakref callback, which may run at any
    allocation (a garbage collection), even while this thread holds the lock in ``map``:
    so it only queues the range, and whoever holds or next takes the lock settles the
    queue (the callback never waits for the lock).
    """

    def __init__(self):
        self.creator_pid = os.getpid()
        self._arenas = []
        self._lock = threading.Lock()
        self._returned = collections.deque()     # (arena, offset, size), mappings gone

    def map(self, size, arena_bytes):
        """A mapping of a free ``size``-byte range (page multiple) of an arena (a new one
        is ``arena_bytes`` or ``size``), and the (arena, offset) of the range; the range
        comes back when the mapping is gone."""
        with self._lock:
            self._settle_locked()
            arena, offset = self._carve_locked(size, arena_bytes)
        try:
            # The arena's descriptor stays open while the mapping lives.
            mapping = Mapping(arena.fd, size, offset, private_after_fork=True)
        except BaseException:
            self._returned.append((arena, offset, size))
            self._settle()
            raise
        finalizer = weakref.finalize(mapping, self._give_back, arena, offset, size)
        finalizer.atexit = False    # at exit, pending writes may still read the memory
        self._settle()      # what a collection inside the lock returned
        return mapping, arena, offset

    @property
    def count(self):
        """How many arenas (descriptors) are open."""
        with self._lock:
            self._settle_locked()
            return len(self._arenas)

    def _carve_locked(self, size, arena_bytes):
        # A range that can hold a huge page starts on one (Note [huge pages] in
        # pyx/_memory.pyx), so that all of it can be in huge pages.
        boundary = HUGE_PAGE if size >= HUGE_PAGE else PAGE
        for arena in self._arenas:
            offset = arena.extents.take(size, boundary)
            if offset is not None:
                return arena, offset
        limit = file_size_limit()
        if limit is not None:
            arena_bytes = min(arena_bytes, limit // PAGE * PAGE)
        arena = Arena(max(size, arena_bytes))
        self._arenas.append(arena)
        return arena, arena.extents.take(size, boundary)

    def _give_back(self, arena, offset, size):
        if os.getpid() != self.creator_pid:
            return      # a forked child's copy of a mapping: the parent's memory
        # Freed now, so that idle ranges hold no memory; an error only keeps the pages.
        try:
            punch_hole(arena.fd, offset, size)
        except OSError:
            pass
        finally:    # even past a Ctrl-C: else the range would stay taken for good
            self._returned.append((arena, offset, size))
            self._settle()

    def _settle(self):
        while self._returned and self._lock.acquire(blocking=False):
            try:
                self._settle_locked()
            finally:
                self._lock.release()

    def _settle_locked(self):
        while self._returned:
            arena, offset, size = self._returned.popleft()
            arena.extents.give(offset, size)
            if arena.extents.all_free:
                self._arenas.remove(arena)
                os.close(arena.fd)


def arenas():
    """The process's arenas (Note [process state])."""
    return shared(Arenas)


class SharedRegion:
    """Page-aligned, page-locked (when allowed) memory that workers can map by fd: a
    range of an arena (Note [memfd arenas]). ``lock_on_fault``: each page is locked as
    it is first touched, so that making the region costs nothing up front."""

    on_device = False

    __slots__ = (
        "__weakref__",
        "address",
        "arena",
        "mapping",
        "offset",
        "region_id",
        "size",
        "unregister",
    )

    def __init__(self, nbytes, lock_on_fault=False, arena_bytes=DEFAULT.arena_bytes):
        self.region_id = next(region_ids)
        self.size = round_up(max(nbytes, 1), PAGE)
        self.mapping, self.arena, self.offset = arenas().map(self.size, arena_bytes)
        self.address = self.mapping.address
        self.unregister = None      # set by gpu.copies.register_for_device_copies
        try:
            self.mapping.lock(lock_on_fault)
        except OSError as error:
            _warn_if_refused(error.errno, self.size)

    @property
    def fd(self):
        """The memfd a worker maps this region from (at ``offset``)."""
        if self.arena is None:
            raise OSError(errno.EBADF, "the shared region was closed")
        return self.arena.fd

    def contains(self, address, nbytes):
        return self.address <= address and address + nbytes <= self.address + self.size

    def close(self):
        """Drop our mapping; the memory goes back to the arena once tensors made from it
        are gone too."""
        if self.unregister is not None:
            self.unregister()
            self.unregister = None
        self.arena = None
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

    Regions never overlap, so they are kept sorted by start address and found by
    bisection: every operation asks, and DeepSpeed's swappers keep hundreds of buffers.
    Thread-safe; every handle of the process shares the locked one (``LockedMemory``).
    """

    def __init__(self):
        self._starts = []       # sorted start addresses
        self._by_start = {}     # start address -> region
        self._ids = set()
        self._lock = threading.Lock()

    def add(self, region):
        with self._lock:
            bisect.insort(self._starts, region.address)
            self._by_start[region.address] = region
            self._ids.add(region.region_id)

    def containing(self, address, nbytes):
        """The region that holds ``[address, address + nbytes)``, or None."""
        with self._lock:
            k = bisect.bisect_right(self._starts, address) - 1
            region = self._by_start[self._starts[k]] if k >= 0 else None
            return region if region is not None and region.contains(address, nbytes) else None

    def pop_starting_at(self, address):
        """Remove and return the region that begins at ``address`` (None if there is none)."""
        with self._lock:
            return self._remove_locked(self._by_start.get(address))

    def __contains__(self, region_id):
        return region_id in self._ids

    def drain(self):
        """Remove every region and return them (for the caller to close)."""
        with self._lock:
            regions = list(self._by_start.values())
            self._starts, self._by_start, self._ids = [], {}, set()
        return regions

    def _remove_locked(self, region):
        if region is None or self._by_start.get(region.address) is not region:
            return None
        del self._by_start[region.address]
        del self._starts[bisect.bisect_left(self._starts, region.address)]
        self._ids.discard(region.region_id)
        return region


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

    def check_unused(self, region):
        """RuntimeError if an operation of any user is in flight on ``region``."""
        with self._lock:
            users = list(self._users)
        for user in users:
            op = user.operation_on(region)
            if op is not None:
                raise RuntimeError(f"this locked tensor is in use by an operation in flight "
                                   f"({op.describe()}); wait() for it before freeing the "
                                   "tensor")

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

    def operation_on(self, region):
        """An operation of this user in flight on ``region``, or None."""
        scheduler = self._live_scheduler()
        return scheduler.books.operation_on(region) if scheduler is not None else None

    def unshare(self, region):
        scheduler = self._live_scheduler()
        if scheduler is not None:
            scheduler.unshare(region)

    def _live_scheduler(self):
        """This user's scheduler while it is open in the process that made it, else None."""
        scheduler = self._scheduler() if self._scheduler is not None else None
        if scheduler is None or scheduler.closed or os.getpid() != scheduler.creator_pid:
            return None
        return scheduler

    # -- RegionTable's interface, on the shared table ------------------------------------
    def add(self, region):
        self.memory.table.add(region)

    def containing(self, address, nbytes):
        return self.memory.table.containing(address, nbytes)

    def pop_starting_at(self, address):
        return self.memory.table.pop_starting_at(address)

    def __contains__(self, region_id):
        return region_id in self.memory.table

    def drain(self):
        """This user leaves; the regions to close if it was the last one."""
        if self._left:
            return []
        self._left = True
        return self.memory.leave(self)


def locked_memory():
    """The process's locked set (Note [process state])."""
    return shared(LockedMemory)
