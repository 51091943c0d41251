"""Ctrl-C held back while the scheduler's books are half-written.

Note [deferred interrupts]
Python runs a SIGINT handler between any two bytecodes of the main thread. If it fired
after a response was read from a worker but before its operation was completed, or
after some of an operation's chunks were sent but not the rest, that operation would
never complete and the next ``wait()`` would block forever. So the scheduler blocks
(in ``poll`` and in waits on its condition) where an interrupt loses nothing, and holds
the handler back only while it moves requests, responses and its books; the held
interrupt is raised the moment the books balance again. This costs two ``sigaction``
calls per section (``_signal`` directly: the ``signal`` module's enum conversions
cost more than the rest of a small operation).
"""
import _signal
import threading

_SIGINT = int(_signal.SIGINT)
_held = []      # frames of interrupts that arrived while held back (main thread only)


def _hold(signum, frame):
    _held.append(frame)


class deferred_interrupts:
    """Run the block with SIGINT's Python handler held back, and call it afterwards.

    Only the main thread runs Python signal handlers, so elsewhere this does nothing;
    nested sections hold nothing more.
    """

    __slots__ = ("_previous",)

    def __enter__(self):
        self._previous = None
        if threading.get_ident() != threading.main_thread().ident:
            return self
        previous = _signal.getsignal(_SIGINT)
        if previous is _hold or not callable(previous):     # nested, or SIG_IGN/SIG_DFL
            return self
        _signal.signal(_SIGINT, _hold)
        self._previous = previous
        return self

    def __exit__(self, *exc_info):
        previous = self._previous
        if previous is None:
            return False
        _signal.signal(_SIGINT, previous)
        if _held:
            frame = _held[0]
            _held.clear()
            previous(_SIGINT, frame)
        return False
