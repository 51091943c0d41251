"""The chunk plan: how one operation's bytes are cut into chunks for the workers."""


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


def plan_chunks(file_offset, nbytes, parallelism, alignment, min_chunk):
    """The ``(start, length)`` chunks of a zero-copy operation: up to one per worker, none
    smaller than ``min_chunk`` (Limits). (Staged operations are cut by their staging space.)"""
    parts = min(parallelism, max(1, nbytes // min_chunk))
    return chunk_bounds(file_offset, nbytes, parts, alignment)
