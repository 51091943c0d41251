"""The io_uring queues: a worker's transfer loop and the caller's own queue (pyx/_uring.pyx).

The kernel AIO queues of nvmeswap._queues on io_uring, with the same interfaces and the
same results:

- a failure of the call itself raises ``OSError`` with its errno, naming the system call
  (pyx/_check.pxd); no function returns an errno;
- each transfer or request ends in a :class:`~nvmeswap._transfers.Completion`, a request
  the kernel refused included (it comes back from ``UringQueue.reap``);
- a full ``UringQueue`` is a False return from ``post``/``submit`` (the request goes to
  a worker instead); misuse raises ``ValueError`` (a closed queue) or ``RuntimeError``
  (an engine with no room).
"""
from collections.abc import Sequence

from nvmeswap._queues import TransferEngine
from nvmeswap._transfers import Completion

class UringEngine(TransferEngine):
    """One ring running many transfers at once (a worker's); ``AioEngine``'s interface."""

    def __init__(self, block_size: int, queue_depth: int, single_submit: bool,
                 overlap_events: bool, max_transfers: int = 256,
                 ring: tuple[int, int, bytes] | None = None) -> None:
        """``ring``: one ``make_worker_ring`` made (in another process), adopted and started."""
    def register_buffers(self, address: int, nbytes: int) -> bool:
        """Register memory as fixed buffers for the requests inside it; False if refused."""
    def clone_buffers(self, registry_fd: int, first: int, count: int) -> bool:
        """Take a ``BufferRegistry``'s slots ``first`` .. ``first + count - 1``; False if
        the kernel refuses."""
    def drop_buffers(self, first: int, count: int) -> None:
        """Empty slots ``clone_buffers`` took."""
    def unregister_buffers(self, address: int) -> None:
        """Undo ``register_buffers(address, ...)``, before the memory is unmapped."""
    def advance(self, block: bool) -> list[Completion]:
        """Start and reap requests; the Completions of the transfers that have ended."""

class UringQueue:
    """The calling process's own ring for small aligned requests; ``CallerQueue``'s
    interface."""

    def __init__(self, capacity: int) -> None: ...
    @property
    def capacity(self) -> int: ...
    @property
    def in_flight(self) -> int:
        """Requests submitted or posted and not yet reaped."""
    @property
    def eventfd(self) -> int:
        """Readable when requests have ended; -1 once closed."""
    def close(self) -> None:
        """Wait for the requests in flight and free the ring; idempotent."""
    def submit(self, op_id: int, chunk: int, is_read: bool, fd: int, address: int,
               nbytes: int, offset: int) -> bool:
        """Start one request from the calling thread; False if the queue is full."""
    def post(self, op_id: int, chunk: int, is_read: bool, fd: int, address: int,
             nbytes: int, offset: int) -> bool:
        """``submit``, in the calling thread (no submitting thread); False if full."""
    def post_many(self, op_id: int, is_read: bool, fd: int, addresses: Sequence[int],
                  nbytes: int | Sequence[int], offsets: Sequence[int]) -> int:
        """Start a request per address and offset (chunk = index) with one system call;
        how many the queue took."""
    def reap(self, wait_all: bool = False) -> list[Completion]:
        """The Completions of the requests that have ended (with ``wait_all``, of all)."""

class BufferRegistry:
    """A ring that only holds registered buffers, for workers' rings to clone."""

    def __init__(self) -> None: ...
    @property
    def fd(self) -> int: ...
    def register(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """Register memory in consecutive slots: ``(first, count)``; None if refused."""
    def unregister(self, first: int, count: int) -> None:
        """Empty slots ``register`` filled."""
    def close(self) -> None:
        """Empty every slot and close the ring; idempotent."""

def make_worker_ring(queue_depth: int) -> tuple[int, int, bytes]:
    """A disabled ring for a worker to adopt: (descriptor, flags taken, parameters)."""

def clone_supported() -> bool:
    """Whether rings made here take each other's registered buffers (tried once)."""

def probe() -> str | None:
    """None if io_uring works here; else why not, in one sentence."""
