"""Ctrl-C held back while the scheduler's books are half-written.

Note [deferred interrupts]
Python runs a SIGINT handler between any two bytecodes of the main thread. If it fired
after a response was read from a worker but before its operation was completed, or
after some of an operation's chunks were sent but not the rest, that operation would
never complete and the next ``wait()`` would block forever. So the scheduler blocks
(in ``poll``) where an interrupt loses nothing, and holds the handler back only while
it moves responses and requests; the held interrupt is raised the moment the books
balance again.
"""
import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred_interrupts():
    """Run the block with SIGINT's Python handler held back, and call it afterwards.

    Only the main thread runs Python signal handlers, so elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):      # SIG_IGN, SIG_DFL, or set from C: nothing to hold
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(signal.SIGINT, held[0])
