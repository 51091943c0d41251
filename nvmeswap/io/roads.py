"""Which road an operation takes: every rule in one pure function.

Note [roads]
An operation's bytes move on one of these roads. ``route`` takes the first row whose
condition holds (and that the handle's ``Limits.roads`` allows), twice: before the file
is opened (a quick road, or OPEN: open it, place it, then ask again) and once the
operation is opened and placed. "Small" is at most the placement's inline limit
(``Limits.inline_bytes``, the block size and a staging piece; 0 for cuFile memory);
"aligned" is address, offset and length on O_DIRECT blocks.

| condition                                | road         | saves            | measured by       |
|------------------------------------------|--------------|------------------|-------------------|
| sync, small, aligned, host memory,       | QUICK_SYNC   | opening, booking | peers_table.py    |
| nothing of the handle in flight          |              | in Python: ~60us | (sync rows)       |
| async read, small, aligned, locked       | QUICK_READ   | opening, placing | small_async.py    |
| memory, the caller queue has room        |              | in Python; one   |                   |
|                                          |              | booking per run  |                   |
| otherwise, before the file is opened     | OPEN         |                  |                   |
| a batch's slice: small, aligned, locked  | BATCH        | one booking and  | small_async.py    |
| memory, the caller queue has room        |              | one post for all | (--batch)         |
| any other batch slice                    | EACH         | (each request    |                   |
|                                          |              | routed alone)    |                   |
| CUDA memory that cuFile takes            | CUFILE       | the host copy    | studies/gpu_roads |
| small, nothing to follow, staging room;  | INLINE       | two process      | peers_table.py    |
| sync, or async with nothing in flight    |              | wake-ups and a   | (sync rows)       |
| and the caller queue unable to take it   |              | socket trip      |                   |
| small, aligned, host memory, the caller  | CALLER_QUEUE | the same; many   | small_async.py    |
| queue has room                           |              | reads in flight  |                   |
| everything else                          | WORKERS      | (fans out)       | peers_table.py    |

(Scripts under bench/.) Batches: Note [batches]. QUICK_READ, CALLER_QUEUE and BATCH go
to the handle's own kernel AIO context (Note [caller queue]); WORKERS and CUFILE to the
worker processes. A quick road may still decline (its file does not qualify, or it must
follow an operation in flight): the operation is then opened the ordinary way; a
CUFILE operation whose file cuFile refuses is done again on WORKERS (Note [cuFile
refusing a file]). Any other road decided is final: the caller queue's room counts every booked operation that
may still post to it, so a post never finds it full. Memory is the placement's to
choose: on INLINE, CALLER_QUEUE and WORKERS a buffer outside locked memory goes through
a staging piece (Note [staging ring]).
"""
from __future__ import annotations

import enum
from typing import NamedTuple


class Road(enum.Enum):
    QUICK_SYNC = "quick sync"   # Note [quick synchronous operations]
    QUICK_READ = "quick read"   # Note [quick asynchronous reads]
    OPEN = "open"               # not decided yet: open and place the operation, then route
    INLINE = "inline"           # Note [small synchronous operations]
    CALLER_QUEUE = "caller queue"   # Note [caller queue]
    BATCH = "batch"             # Note [batches]: a slice of a batch, posted in one call
    EACH = "each"               # a slice of a batch whose requests go their own roads
    WORKERS = "workers"
    CUFILE = "cufile"           # Note [device regions]


ALL_ROADS = frozenset(Road)
#: The roads no handle can be kept off: every operation can take one of them.
ALWAYS_OPEN = frozenset({Road.OPEN, Road.EACH, Road.WORKERS, Road.CUFILE})
#: The roads whose requests the worker processes move, and those the caller queue moves.
WORKER_ROADS = frozenset({Road.WORKERS, Road.CUFILE})
CALLER_ROADS = frozenset({Road.QUICK_READ, Road.CALLER_QUEUE, Road.BATCH})


class Memory(enum.Enum):
    LOCKED = "locked"   # host memory the workers and the kernel reach as it is
    HOST = "host"       # other host memory: staged
    DEVICE = "device"   # CUDA memory copied through host staging
    CUFILE = "cufile"   # CUDA memory the workers' cuFile moves


class Facts(NamedTuple):
    """What ``route`` looks at. Before the file is opened, ``opened`` is False and the
    facts that need the file (``conflicts``, ``staging_room``) are False."""
    opened: bool
    is_async: bool
    is_read: bool
    nbytes: int
    inline_limit: int
    aligned: bool       # address, offset, length on O_DIRECT blocks (before opening: and
                        # a path named, O_DIRECT allowed, no validation asked)
    memory: Memory
    busy: bool          # the handle has operations in flight
    queue_room: bool    # the caller queue exists and can take one more request
    conflicts: bool = False     # it must follow an operation in flight (Note [ordering])
    staging_room: bool = False  # no staging needed, or a piece of it is free now
    batch: bool = False         # a slice of a batch (Note [batches]); nbytes: its largest


def route(facts: Facts, roads: frozenset = ALL_ROADS) -> Road:
    """The road of an operation (Note [roads]); only roads in ``roads`` are taken."""
    small = 0 < facts.nbytes <= facts.inline_limit
    host = facts.memory is not Memory.CUFILE
    if not facts.opened:
        if small and facts.aligned:
            if not facts.is_async:
                if not facts.busy and facts.memory in (Memory.LOCKED, Memory.HOST) \
                        and Road.QUICK_SYNC in roads:
                    return Road.QUICK_SYNC
            elif facts.is_read and facts.memory is Memory.LOCKED and facts.queue_room \
                    and Road.QUICK_READ in roads:
                return Road.QUICK_READ
        return Road.OPEN
    if facts.batch:
        return (Road.BATCH if small and facts.aligned and facts.memory is Memory.LOCKED
                and facts.queue_room and Road.BATCH in roads else Road.EACH)
    if not host:
        return Road.CUFILE
    to_queue = (small and facts.aligned and facts.queue_room
                and Road.CALLER_QUEUE in roads)
    if (small and not facts.conflicts and facts.staging_room
            and Road.INLINE in roads
            and (not facts.is_async or not (facts.busy or to_queue))):
        return Road.INLINE
    return Road.CALLER_QUEUE if to_queue else Road.WORKERS
