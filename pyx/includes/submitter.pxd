# The caller queue's submitting thread of cdeps/submitter.h.
from includes.kernel_aio cimport aio_context_t, iocb


cdef extern from "submitter.h" nogil:
    ctypedef struct nvmeswap_submitter:
        pass

    nvmeswap_submitter *nvmeswap_submitter_start(aio_context_t ctx, int eventfd, int capacity)
    void nvmeswap_submitter_post(nvmeswap_submitter *s, iocb *cb)
    void nvmeswap_submitter_drain(nvmeswap_submitter *s)
    int nvmeswap_submitter_take_failed(nvmeswap_submitter *s, int *slots, int *errnos)
    void nvmeswap_submitter_stop(nvmeswap_submitter *s)
