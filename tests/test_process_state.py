"""Note [process state]: one of each shared thing per process, none of them inherited by
a forked child, and a fork while another thread holds the lock leaves the child free."""
import os
import signal
import threading

from nvmeswap.io import process_state
from nvmeswap.io.operation import ConcurrentWrites, writes
from nvmeswap.io.regions import LockedMemory, locked_memory


def _in_child(check):
    """Run ``check()`` in a forked child; its exit status (0: it returned True)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_one_of_each_per_process():
    assert locked_memory() is locked_memory() and isinstance(locked_memory(), LockedMemory)
    assert writes() is writes() and isinstance(writes(), ConcurrentWrites)


def test_a_forked_child_gets_its_own():
    parents = locked_memory(), writes()
    assert _in_child(lambda: locked_memory() is not parents[0] and writes() is not parents[1]
                     and locked_memory() is locked_memory()) == 0
    assert (locked_memory(), writes()) == parents


def test_a_fork_while_another_thread_holds_the_lock_does_not_hang_the_child():
    class Slow:
        def __init__(self):
            holding.set()
            release.wait(10)

    holding, release = threading.Event(), threading.Event()
    maker = threading.Thread(target=process_state.shared, args=(Slow,))
    maker.start()
    assert holding.wait(10)     # the lock is held while Slow is made
    try:
        # The child makes something new: with the parent's lock it would wait forever
        # (the alarm ends it then).
        class Fresh:
            pass

        def make_fresh():
            signal.alarm(5)
            return isinstance(process_state.shared(Fresh), Fresh)

        assert _in_child(make_fresh) == 0
    finally:
        release.set()
        maker.join()
