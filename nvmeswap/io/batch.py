"""Many requests on one file in one call: checked together, booked as one, posted in bulk.

Note [batches]
An offloading loop over small tensors (KV-cache blocks, embedding rows, paged optimizer
state) issues thousands of small reads, and one Python call per 4 KiB costs more than
the device needs for it. ``async_pread_many`` / ``async_pwrite_many`` take the requests
of one file together: every argument is checked before any I/O, the file is opened
once per slice, and a slice of requests whose memory is locked and whose offsets and
lengths are O_DIRECT-aligned and small (Note [roads]: BATCH) is one operation in the
books, posted to the caller queue in one call (``post_many``) and completed request by
request as the kernel ends them. ``wait()`` counts each request as one operation, as if
each had been started on its own; a failed request's error names the file and its
offset. A slice that cannot go whole (plain memory, unaligned, large) takes the road
each of its requests would take alone (EACH). The requests of a batch run in no set
order, so a batch whose writes overlap is refused at the call. Slices hold at most
``slice_limit`` requests, so that back-pressure and the caller queue's room work on them
as on any operation.
"""
from .buffers import IoBuffer, io_buffer
from .operation import MAX_FILE_END, Operation, checked_int

#: Requests of one batch booked as one operation, at most.
SLICE = 64


class Request:
    """One request of a batch: the caller's buffer, its memory and its file range."""

    __slots__ = ("address", "buffer", "nbytes", "offset")

    def __init__(self, buffer, address, nbytes, offset):
        self.buffer = buffer
        self.address = address
        self.nbytes = nbytes
        self.offset = offset


def checked_requests(buffers, offsets, lengths, *, is_read):
    """The requests of a batch, every argument checked before any I/O: ``buffers`` a
    sequence of buffers, or one buffer cut by ``lengths``."""
    offsets = _checked_sequence("offsets", offsets)
    if lengths is None:
        buffers = _checked_sequence("buffers", buffers)
        if len(buffers) != len(offsets):
            raise ValueError(f"{len(buffers)} buffers but {len(offsets)} offsets")
        described = [io_buffer(buffer, writable=is_read) for buffer in buffers]
    else:
        lengths = _checked_sequence("lengths", lengths)
        if len(lengths) != len(offsets):
            raise ValueError(f"{len(lengths)} lengths but {len(offsets)} offsets")
        whole = io_buffer(buffers, writable=is_read)
        described, start = [], 0
        for k, length in enumerate(lengths):
            length = checked_int(f"lengths[{k}]", length, 1, None)
            described.append(IoBuffer(whole.owner, whole.address + start, length,
                                      whole.device, whole.storage))
            start += length
        if start > whole.nbytes:
            raise ValueError(f"the lengths add up to {start} bytes, more than the buffer's "
                             f"{whole.nbytes}")
    requests = []
    for k, (buf, offset) in enumerate(zip(described, offsets)):
        if buf.nbytes == 0:
            raise ValueError(f"nothing to transfer: buffer {k} of the batch is empty")
        offset = checked_int(f"offsets[{k}]", offset, 0, MAX_FILE_END - buf.nbytes)
        requests.append(Request(buf, buf.address, buf.nbytes, offset))
    if not is_read:
        _check_disjoint(requests)
    return requests


def _check_disjoint(requests):
    """The writes of one batch run in no set order, so none may overlap another."""
    ordered = sorted(range(len(requests)), key=lambda k: requests[k].offset)
    for before, after in zip(ordered, ordered[1:]):
        first, second = requests[before], requests[after]
        if first.offset + first.nbytes > second.offset:
            raise ValueError(f"requests {min(before, after)} and {max(before, after)} of the "
                             f"batch write overlapping bytes (from offset {second.offset}); "
                             "a batch's writes run in no set order: write them in two calls")


def _checked_sequence(name, value):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"{name} must be a sequence, got {type(value).__name__}")
    if hasattr(value, "tolist"):    # a tensor or an array of offsets
        value = value.tolist()
    if len(value) == 0:
        raise ValueError(f"{name} is empty: a batch needs at least one request")
    return value


class BatchOperation(Operation):
    """Requests of one file booked as one operation (Note [batches]): chunk ``k`` is
    request ``k``, at its own address and file offset. ``file_offset`` and ``buffer``
    span them all, which is what ordering and undoing growth need."""

    __slots__ = ("requests",)

    def __init__(self, op_id, is_read, requests, file):
        start = min(request.offset for request in requests)
        end = max(request.offset + request.nbytes for request in requests)
        # The span: its owner holds the caller's buffers until the batch has ended.
        span = IoBuffer([request.buffer for request in requests], 0, end - start)
        super().__init__(op_id, is_read, span, file, start, False)
        self.requests = requests
        self.count = len(requests)
        self.chunks = [(request.offset - start, request.nbytes) for request in requests]

    def describe(self):
        verb = "read" if self.is_read else "write"
        total = sum(request.nbytes for request in self.requests)
        return (f"batch {verb} of {self.count} requests ({total} bytes) between offsets "
                f"{self.file_offset} and {self.file_offset + self.buffer.nbytes} of "
                f"{self.file.name}")

    def addresses(self):
        return [request.address for request in self.requests]

    def offsets(self):
        return [request.offset for request in self.requests]

    def lengths(self):
        return [request.nbytes for request in self.requests]

    def memory_spans(self):
        return [(request.address, request.nbytes) for request in self.requests]

