# The transfers an engine has in progress (Note [concurrent transfers] in _queues.pyx),
# kept the same way by both engines: kernel AIO's (_queues.pyx) and io_uring's (_uring.pyx).
from libc.stdlib cimport malloc, free

from _transfer_steps cimport Transfer, _transfer_ended
from nvmeswap._transfers cimport completion


cdef struct TransferTable:
    Transfer *transfers
    bint *used
    int *order          # indices of the transfers in progress, oldest first
    int n_order
    int size


cdef inline bint _table_init(TransferTable *table, int size) noexcept:
    """Allocate room for ``size`` transfers; False if memory ran out (then free it)."""
    table.n_order = 0
    table.size = size
    table.transfers = <Transfer *>malloc(sizeof(Transfer) * size)
    table.used = <bint *>malloc(sizeof(bint) * size)
    table.order = <int *>malloc(sizeof(int) * size)
    if not (table.transfers and table.used and table.order):
        return False
    cdef int i
    for i in range(size):
        table.used[i] = False
    return True


cdef inline void _table_free(TransferTable *table) noexcept nogil:
    free(table.transfers)
    free(table.used)
    free(table.order)
    table.transfers = NULL
    table.used = NULL
    table.order = NULL


cdef inline int _table_add(TransferTable *table) noexcept nogil:
    """The index of a free transfer, now the newest in progress; -1 if all are in use."""
    if table.n_order == table.size:
        return -1
    cdef int index = 0
    while table.used[index]:
        index += 1
    table.used[index] = True
    table.order[table.n_order] = index
    table.n_order += 1
    return index


cdef inline list _table_ended(TransferTable *table):
    """The ``Completion`` of every transfer that has ended, oldest first; they leave."""
    cdef list ended = []
    cdef int k, kept = 0, index
    cdef Transfer *t
    for k in range(table.n_order):
        index = table.order[k]
        t = &table.transfers[index]
        if _transfer_ended(t):
            table.used[index] = False
            ended.append(completion(t.op_id, t.chunk, t.out.err, t.out.at_offset,
                                    t.out.requested, t.out.got))
        else:
            table.order[kept] = index
            kept += 1
    table.n_order = kept
    return ended
