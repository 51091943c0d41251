"""Which earlier operations a new one must wait for.

Note [ordering]: operations on overlapping bytes of one file, at least one of them a
write, run in the order they were started, whatever their size and whichever thread
or worker runs them: a read started after a write sees the write's bytes, a write
started after a read does not change what the read returns, and of two writes the
later one's bytes stay. Operations that do not conflict run at once. DeepNVMe gets
this from each thread running its share of every operation in turn; here chunks go to
different workers, the caller queue, or the calling thread, so the scheduler holds an
operation back until the earlier ones it conflicts with have finished.

Every operation is counted from the moment it is routed to its end, those that run in
their caller's thread too: a quick synchronous one (Note [quick synchronous
operations]) is counted before its file is opened, so as a ``QuickSyncOperation`` of a
file not yet known, which conflicts with any operation of any file that it would
conflict with in one file (a write with everything, a read with every write). It runs
for microseconds, and only while nothing else is in flight; what starts meanwhile waits.
"""
import itertools

UNKNOWN_FILE = None


class QuickSyncOperation:
    """A quick synchronous operation while it runs, as the books see it: it has no
    ``Operation`` (its file is opened in the same call that moves its bytes)."""

    __slots__ = ("is_read",)

    def __init__(self, is_read):
        self.is_read = is_read


class Ordering:
    """The operations in flight (started, not finished), by file, for conflict checks."""

    def __init__(self):
        self._by_file = {}      # file identity (or UNKNOWN_FILE) -> (reads, writes) in flight

    def conflicts(self, op):
        """The operations in flight that ``op`` must wait for."""
        found = self._anywhere(op.is_read)
        in_flight = self._by_file.get(op.file.identity)
        if in_flight is None:
            return found
        reads, writes = in_flight
        start, end = op.file_offset, op.file_offset + op.buffer.nbytes
        candidates = writes if op.is_read else itertools.chain(writes, reads)
        found.update(other for other in candidates
                     if other.file_offset < end and start < other.file_offset + other.buffer.nbytes)
        return found

    def conflicts_with_quick(self, is_read):
        """Whether a ``QuickSyncOperation`` started now would conflict with one in flight."""
        return any(writes or (reads and not is_read) for reads, writes in self._by_file.values())

    def _anywhere(self, is_read):
        """The ``QuickSyncOperation``s in flight that an operation must wait for."""
        in_flight = self._by_file.get(UNKNOWN_FILE)
        if in_flight is None:
            return set()
        reads, writes = in_flight
        return set(writes) if is_read else set(itertools.chain(writes, reads))

    def writes_in_flight(self, identity):
        """Whether a write of the file ``identity`` names (or of a file not yet known) is
        in flight."""
        # Asked before every read a run takes: two lookups, no generator.
        in_flight = self._by_file.get(identity)
        if in_flight is not None and in_flight[1]:
            return True
        unknown = self._by_file.get(UNKNOWN_FILE)
        return unknown is not None and bool(unknown[1])

    def written_end(self, identity):
        """Where the writes in flight of the file ``identity`` names end (0: none): a read
        started now follows them, so it may read up to there."""
        in_flight = self._by_file.get(identity)
        if in_flight is None:
            return 0
        return max((write.file_offset + write.buffer.nbytes for write in in_flight[1]),
                   default=0)

    def add(self, op):
        """Count ``op`` in flight; return the earlier operations it must wait for."""
        waits_for = self.conflicts(op)
        self.track(op)
        return waits_for

    def track(self, op):
        """Count ``op`` in flight, known to wait for nothing."""
        reads, writes = self._by_file.setdefault(_identity(op), (set(), set()))
        (reads if op.is_read else writes).add(op)

    def remove(self, op):
        """Count ``op`` out (nothing if it is not counted)."""
        identity = _identity(op)
        in_flight = self._by_file.get(identity)
        if in_flight is None:
            return
        reads, writes = in_flight
        (reads if op.is_read else writes).discard(op)
        if not reads and not writes:
            del self._by_file[identity]


def _identity(op):
    return UNKNOWN_FILE if type(op) is QuickSyncOperation else op.file.identity
