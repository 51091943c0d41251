"""Whether this thread is inside a garbage collection, marked by a ``gc.callbacks``
entry written in C (pyx/_collection.pyx; Note [releasing dropped handles])."""

def mark_collection(phase: str, info: dict) -> None:
    """The ``gc.callbacks`` entry: "start" and "stop" of each collection."""

def in_collection() -> bool:
    """Whether this thread is inside a garbage collection now."""
