"""The kernel AIO queues: a worker's transfer loop and the caller's own queue (pyx/_queues.pyx).

Results cross the Cython edge as in nvmeswap._transfers:

- a failure of the call itself raises ``OSError`` with its errno, naming the system call
  (pyx/_check.pxd); no function returns an errno;
- each transfer or request ends in a :class:`~nvmeswap._transfers.Completion`, a request
  the kernel refused included (it comes back from ``CallerQueue.reap``);
- a full ``CallerQueue`` is a False return from ``post``/``submit`` (the request goes to
  a worker instead); misuse raises ``ValueError`` (a closed queue) or ``RuntimeError``
  (an engine with no room).
"""
from collections.abc import Sequence

from nvmeswap._transfers import Completion

class TransferEngine:
    """What both engines share: request slots and the transfers in progress, begun here
    and ended by the engine's ``advance``."""

    @property
    def block_size(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def max_transfers(self) -> int: ...
    @property
    def single_submit(self) -> bool: ...
    @property
    def overlap_events(self) -> bool: ...
    @property
    def busy(self) -> bool:
        """Whether transfers are in progress."""
    @property
    def full(self) -> bool:
        """Whether ``begin`` must wait for a transfer to end."""
    def transfer(self, op_id: int, chunk: int, is_read: bool, direct_fd: int,
                 buffered_fd: int, address: int, nbytes: int, offset: int,
                 alignment: int) -> Completion:
        """Move the bytes and wait for them (an engine with nothing else in progress)."""
    def begin(self, op_id: int, chunk: int, is_read: bool, direct_fd: int, buffered_fd: int,
              address: int, nbytes: int, offset: int, alignment: int, fixed_slot: int = -1,
              fixed_base: int = 0, fixed_address: int = 0) -> None:
        """Start a transfer; ``advance`` returns its Completion. On io_uring, the
        registered buffers from ``fixed_slot`` on hold its memory as registered at
        ``fixed_base`` (its bytes at ``fixed_address`` there)."""

class AioEngine(TransferEngine):
    """One kernel AIO context running many transfers at once (a worker's)."""

    def __init__(self, block_size: int, queue_depth: int, single_submit: bool,
                 overlap_events: bool, max_transfers: int = 256) -> None: ...
    def advance(self, block: bool) -> list[Completion]:
        """Start and reap requests; the Completions of the transfers that have ended."""

class CallerQueue:
    """The calling process's own kernel AIO context for small aligned requests."""

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
        """Wait for the requests in flight and free the context; idempotent."""
    def submit(self, op_id: int, chunk: int, is_read: bool, fd: int, address: int,
               nbytes: int, offset: int) -> bool:
        """Start one request from the calling thread; False if the queue is full."""
    def post(self, op_id: int, chunk: int, is_read: bool, fd: int, address: int,
             nbytes: int, offset: int) -> bool:
        """Hand one request to the submitting thread; False if the queue is full."""
    def post_many(self, op_id: int, is_read: bool, fd: int, addresses: Sequence[int],
                  nbytes: int | Sequence[int], offsets: Sequence[int]) -> int:
        """Start a request per address and offset (chunk = index) in one io_submit; how
        many the queue took."""
    def reap(self, wait_all: bool = False) -> list[Completion]:
        """The Completions of the requests that have ended (with ``wait_all``, of all)."""
