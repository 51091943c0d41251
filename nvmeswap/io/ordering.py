"""Which earlier operations a new one must wait for.

Note [ordering]: operations on overlapping bytes of one file, at least one of them a
write, run in the order they were started, whatever their size and whichever thread
or worker runs them: a read started after a write sees the write's bytes, a write
started after a read does not change what the read returns, and of two writes the
later one's bytes stay. Operations that do not conflict run at once. DeepNVMe gets
this from each thread running its share of every operation in turn; here chunks go to
different workers, the caller queue, or the calling thread, so the scheduler holds an
operation back until the earlier ones it conflicts with have finished.
"""
import itertools


class Ordering:
    """The operations in flight (started, not finished), by file, for conflict checks."""

    def __init__(self):
        self._by_file = {}      # file identity -> (reads, writes) in flight

    def conflicts(self, op):
        """The operations in flight that ``op`` must wait for."""
        in_flight = self._by_file.get(op.file.identity)
        if in_flight is None:
            return set()
        reads, writes = in_flight
        start, end = op.file_offset, op.file_offset + op.buffer.nbytes
        candidates = writes if op.is_read else itertools.chain(writes, reads)
        return {other for other in candidates
                if other.file_offset < end and start < other.file_offset + other.buffer.nbytes}

    def writes_in_flight(self, identity):
        """Whether a write of the file ``identity`` names is in flight."""
        in_flight = self._by_file.get(identity)
        return in_flight is not None and bool(in_flight[1])

    def add(self, op):
        """Count ``op`` in flight; return the earlier operations it must wait for."""
        waits_for = self.conflicts(op)
        self.track(op)
        return waits_for

    def track(self, op):
        """Count ``op`` in flight, known to wait for nothing."""
        reads, writes = self._by_file.setdefault(op.file.identity, (set(), set()))
        (reads if op.is_read else writes).add(op)

    def remove(self, op):
        in_flight = self._by_file.get(op.file.identity)
        if in_flight is None:
            return
        reads, writes = in_flight
        (reads if op.is_read else writes).discard(op)
        if not reads and not writes:
            del self._by_file[op.file.identity]
