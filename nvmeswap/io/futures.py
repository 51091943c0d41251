"""A future for one asynchronous operation, in KvikIO's manner."""
from __future__ import annotations

import warnings

from ..errors import caller_stacklevel


class Future:
    """One read or write started by ``submit_pread`` / ``submit_pwrite``: ``done()``
    looks without waiting, ``result()`` waits and returns the bytes moved or raises the
    operation's error. ``wait()`` does not count it; ``close()`` waits for it. A failure
    nobody asked ``result()`` for is named in a ResourceWarning when the future goes.
    """

    __slots__ = ("_asked", "_books", "_op")

    def __init__(self, books, op):
        self._books = books
        self._op = op
        self._asked = False

    def done(self) -> bool:
        """Whether the operation has ended (successfully or not); never blocks."""
        if not self._op.done:
            self._books.progress()
        return self._op.done

    def result(self) -> int:
        """Wait for the operation; the bytes it moved, or its error raised."""
        op = self._op
        if not op.done:
            self._books.wait_until(op.is_done)
        self._asked = True
        if op.error is None:
            return sum(length for _, length in op.chunks)
        error = op.error
        try:
            raise error
        finally:
            del error

    def __repr__(self) -> str:
        state = "done" if self._op.done else "pending"
        return f"<nvmeswap.Future {state}>"

    def __del__(self) -> None:
        op = getattr(self, "_op", None)
        if op is not None and op.done and op.error is not None and not self._asked:
            warnings.warn(f"a future nobody asked for its result failed: {op.error}",
                          ResourceWarning, stacklevel=caller_stacklevel())
