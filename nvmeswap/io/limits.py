"""Every tuning value of a handle, in one record the handle owns and passes down.

The defaults were measured (the bench named beside each); a handle takes another record
through its private ``_limits`` keyword, which is how tests and bench choose values
(a smaller staging space, a zero inline limit) without touching module state.
"""
from __future__ import annotations

import dataclasses

from .roads import ALL_ROADS


@dataclasses.dataclass(frozen=True)
class Limits:
    """A handle's tuning values (bytes unless named otherwise)."""

    #: One-request operations up to this size run in the calling thread or the caller
    #: queue (Note [roads]); also capped by the block size and a staging piece.
    inline_bytes: int = 256 << 10
    #: The handle's staging space (Note [staging ring]).
    staging_bytes: int = 64 << 20
    #: A staged operation is cut into at least this many pieces where each is
    #: ``min_piece`` or more: the first piece's copy is the one nothing overlaps.
    pipeline_pieces: int = 4
    min_piece: int = 1 << 20
    #: Below this a zero-copy chunk costs more in dispatch than it gains in parallelism.
    min_chunk: int = 256 << 10
    #: Started operations wait while this many chunks are in flight (back-pressure).
    max_chunks_in_flight: int = 128
    #: Descriptors a process keeps for itself besides those of chunks in flight.
    reserved_fds: int = 32
    #: Writes that grow a file by at least this much preallocate (Note [preallocation]).
    preallocate_min: int = 1 << 20
    #: The virtual size of a new memfd arena (Note [memfd arenas]).
    arena_bytes: int = 256 << 20
    #: The roads this handle may take (Note [roads]); the workers' road is always open.
    roads: frozenset = ALL_ROADS

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "roads":
                if not isinstance(value, frozenset) or not value <= ALL_ROADS:
                    raise TypeError(f"roads must be a frozenset of Road, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field.name} must be an int >= 0, got {value!r}")

    def replace(self, **changes) -> Limits:
        return dataclasses.replace(self, **changes)


DEFAULT = Limits()
