# The caller queue's submitting thread on io_uring, of cdeps/ring_submitter.h.
from includes.io_uring cimport nvmeswap_uring


cdef extern from "ring_submitter.h" nogil:
    ctypedef struct nvmeswap_ring_submitter:
        pass

    nvmeswap_ring_submitter *nvmeswap_ring_submitter_start(nvmeswap_uring *ring)
    void nvmeswap_ring_submitter_post(nvmeswap_ring_submitter *s)
    long nvmeswap_ring_submitter_take_error(nvmeswap_ring_submitter *s)
    void nvmeswap_ring_submitter_stop(nvmeswap_ring_submitter *s)
