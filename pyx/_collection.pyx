# cython: language_level=3
"""Whether this thread is inside a garbage collection (Note [releasing dropped handles]
in io/reaper.py), kept by a ``gc.callbacks`` entry written in C: a Python callback is
where a Ctrl-C can land, and there it is lost ("Exception ignored in garbage collector")
and the mark left wrong. Here no Python code runs: the signal waits for the next line.
"""

cdef extern from *:
    """
    static __thread int nvmeswap_collecting = 0;
    """
    int nvmeswap_collecting


def mark_collection(phase, info):
    """The ``gc.callbacks`` entry: "start" and "stop" of each collection."""
    global nvmeswap_collecting
    nvmeswap_collecting = phase == "start"


def in_collection():
    """Whether this thread is inside a garbage collection now."""
    return nvmeswap_collecting != 0
