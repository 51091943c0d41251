# What nvmeswap._queues shares with nvmeswap._uring at the C level: the base of both
# engines. (This file's path is the module's name: Cython finds the type at run time by it.)
from _transfer_table cimport TransferTable


cdef class TransferEngine:
    cdef TransferTable table    # the transfers in progress (_transfer_table.pxd)
    cdef int *free_slots
    cdef int n_free
    cdef int in_flight          # requests with the kernel, not yet reaped
    cdef int *owner             # slot -> index of its transfer
    cdef readonly size_t block_size
    cdef readonly int queue_depth
    cdef readonly int max_transfers
    cdef readonly bint single_submit
    cdef readonly bint overlap_events

    cdef int _set_up(self, size_t block_size, int queue_depth, bint single_submit,
                     bint overlap_events, int max_transfers) except -1
    cdef int _completions_to_wait(self) noexcept nogil
