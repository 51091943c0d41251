# What nvmeswap._transfers shares with the other extensions at the C level: the record of
# a transfer's outcome. (This file's path is the module's name: Cython finds the type at
# run time by it.)


cdef class Completion:
    cdef readonly unsigned long long op_id
    cdef readonly unsigned int chunk
    cdef readonly int err
    cdef readonly long long at_offset
    cdef readonly long long requested
    cdef readonly long long got


cdef inline Completion completion(unsigned long long op_id, unsigned int chunk, int err,
                                  long long at_offset, long long requested, long long got):
    """A new Completion, filled from C without a Python-level call."""
    cdef Completion done = Completion.__new__(Completion)
    done.op_id = op_id
    done.chunk = chunk
    done.err = err
    done.at_offset = at_offset
    done.requested = requested
    done.got = got
    return done
