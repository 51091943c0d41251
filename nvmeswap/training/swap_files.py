"""Where swapped tensors' bytes go: a file name per key, the raw-byte view, the pack file.

A tensor is swapped as its raw bytes (``as_bytes``). It gets a file of its own, named
after its key (``file_name``), unless it is small: then it goes into a slot of the one
``PackFile`` that the small tensors share, and its write waits to be batched.
"""
from __future__ import annotations

import re

from ..io.interrupts import deferred_interrupts
from ..units import ALIGNMENT, round_up

# Long enough to recognise the key; short enough that a name never nears NAME_MAX (255).
NAME_PREFIX = 64


def file_name(key, serial):
    """A safe file name for any key, unique in its swapper: a cleaned prefix of the key,
    to recognise it, and the swapper's ``serial`` number for it. (Not a digest of the
    key's text: keys that print alike, two tensors of equal values or NaNs, are
    different keys.)"""
    text = key if isinstance(key, str) else f"{type(key).__name__}:{key!r}"
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:NAME_PREFIX]
    return f"{readable}.{serial}.swp"


def as_bytes(tensor):
    """The tensor's bytes as a flat uint8 view (the swap files hold raw bytes)."""
    import torch
    if not tensor.is_contiguous():
        raise ValueError("swap needs a contiguous tensor")
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else \
        torch.empty(0, dtype=torch.uint8)


class PackFile:
    """The file the small tensors share: each key keeps an aligned slot in it while it
    fits, and the writes queued in ``batched`` go out as one write per run of adjacent
    slots (write-behind batching). A released slot joins the free space beside it, and
    free space at the end is the end no more; a key that outgrows its slot takes the
    smallest free place that fits (its own, grown, where free space follows it or it is
    last). So the file grows with the bytes held, not with the keys ever written."""

    def __init__(self, path):
        self.path = path
        self._end = 0
        self._slots = {}            # packed key -> (offset, capacity) in the pack file
        self._free = {}             # offset -> capacity of free space below the end
        self._free_ending = {}      # end -> offset of the same
        self.batched = []           # packed keys written at the next write_batches
        self.buffers = []           # staging of the batched writes in flight

    def slot(self, key, nbytes):
        """The key's place in the pack file: the one it had if it still fits, else the
        smallest free place that does, else a new one at the end."""
        offset, capacity = self._slots.get(key, (0, 0))
        if key in self._slots and capacity >= nbytes:
            return offset
        self.release(key)
        needed = round_up(nbytes, ALIGNMENT)
        fitting = [(free, at) for at, free in self._free.items() if free >= needed]
        if fitting:
            capacity, offset = min(fitting)
            self._take(offset, capacity)
            if capacity > needed:
                self._give(offset + needed, capacity - needed)
        else:
            offset, self._end = self._end, self._end + needed
        self._slots[key] = (offset, needed)
        return offset

    def release(self, key):
        """Give the key's slot up; False if it had none (its bytes are in a file of its
        own)."""
        place = self._slots.pop(key, None)
        if place is None:
            return False
        self._give(*place)
        return True

    def _give(self, offset, capacity):
        """Free ``capacity`` bytes at ``offset``, joined to the free space beside them."""
        before = self._free_ending.get(offset)
        if before is not None:
            capacity += self._take(before, offset - before)
            offset = before
        after = self._free.get(offset + capacity)
        if after is not None:
            capacity += self._take(offset + capacity, after)
        if offset + capacity == self._end:
            self._end = offset
        else:
            self._free[offset] = capacity
            self._free_ending[offset + capacity] = offset

    def _take(self, offset, capacity):
        del self._free[offset], self._free_ending[offset + capacity]
        return capacity

    def write_batches(self, handle, entries, started):
        """Start the batched writes on ``handle`` (each key's bytes are
        ``entries[key].tensor``), one per run of adjacent slots, calling ``started()`` for
        each. A run leaves ``batched`` as its write starts: interrupted (a Ctrl-C while
        its bytes are gathered), the runs not started stay there for the next call."""
        import torch
        keys = sorted(self.batched, key=lambda k: self._slots[k][0])
        runs = []
        for key in keys:
            offset, capacity = self._slots[key]
            if runs and runs[-1][-1][0] + runs[-1][-1][1] == offset:
                runs[-1].append((offset, capacity, key))
            else:
                runs.append([(offset, capacity, key)])
        done = 0
        try:
            for run in runs:
                start = run[0][0]
                staging = torch.zeros(run[-1][0] + run[-1][1] - start, dtype=torch.uint8)
                for offset, _, key in run:
                    flat = entries[key].tensor
                    staging[offset - start:offset - start + flat.numel()] = flat
                with deferred_interrupts():     # started and counted, or neither
                    handle.async_pwrite(staging, self.path, start)
                    self.buffers.append(staging)
                    started()
                    done += 1
        finally:
            self.batched = [key for run in runs[done:] for _, _, key in run]
