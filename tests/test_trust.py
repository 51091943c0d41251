"""Promises kept when the world misbehaves: threads sharing a handle, full disks, files
replaced while written, resource limits, fork, folders removed under the swapper."""
import os
import signal
import threading
import time

from conftest import random_bytes

KiB, MiB = 1 << 10, 1 << 20


def _worker_pids(h):
    return [w.process.pid for w in h._scheduler.workers.pool.workers]


def _signal_all(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the awaited state never came"
        time.sleep(0.005)


# -- threads ---------------------------------------------------------------------------
def test_a_threads_wait_is_not_emptied_by_another_threads_wait(handle_factory, tmp_path):
    """Thread A starts a write; the main thread's wait() runs meanwhile; A's own wait()
    must still wait for A's write and count it (it used to return 0 at once, the write
    unfinished, because the other wait() had taken it)."""
    h = handle_factory(intra_op_parallelism=2)
    data = bytearray(random_bytes(8 * MiB, seed=3))
    path = tmp_path / "a"
    submitted, others_waiting = threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        h.async_pwrite(data, path)
        submitted.set()
        others_waiting.wait()
        seen["count"] = h.wait()
        seen["content"] = path.read_bytes()

    pids = _worker_pids(h)
    _signal_all(pids, signal.SIGSTOP)
    try:
        a = threading.Thread(target=thread_a)
        a.start()
        assert submitted.wait(30)
        counted_by_main = []
        main_wait = threading.Thread(target=lambda: counted_by_main.append(h.wait()))
        main_wait.start()
        _until(lambda: h._scheduler.books.pumping_thread is not None)
        others_waiting.set()
        a.join(0.5)
        assert a.is_alive(), "A's wait() returned while its write was held up"
    finally:
        _signal_all(pids, signal.SIGCONT)
    a.join(60)
    main_wait.join(60)
    assert seen["count"] == 1 and seen["content"] == data
    assert counted_by_main == [0]


def test_eight_threads_each_wait_for_their_own_reads(handle_factory, tmp_path):
    """Eight threads share a handle, each reading its own file into zeroed memory and
    waiting: every wait() counts that thread's reads, and the bytes are there when it
    returns."""
    h = handle_factory(intra_op_parallelism=2)
    sizes = [4 * KiB, 64 * KiB, 1 * MiB + 7]
    sources = []
    for k in range(8):
        path = tmp_path / f"src{k}"
        path.write_bytes(random_bytes(2 * MiB, seed=k))
        sources.append((path, path.read_bytes()))
    failures = []

    def reader(k):
        path, data = sources[k]
        try:
            for round_number in range(30):
                size = sizes[(k + round_number) % len(sizes)]
                offsets = [(round_number * 4096 * (k + 1) + i * size) % (len(data) - size)
                           // 4096 * 4096 for i in range(2)]
                buffers = [bytearray(size) for _ in offsets]
                for buffer, offset in zip(buffers, offsets):
                    h.async_pread(buffer, path, offset)
                count = h.wait()
                if count != len(buffers):
                    failures.append(f"thread {k} round {round_number}: wait() gave {count}")
                for buffer, offset in zip(buffers, offsets):
                    if buffer != data[offset:offset + size]:
                        failures.append(f"thread {k} round {round_number}: wrong bytes "
                                        f"at {offset} when wait() returned")
        except BaseException as error:
            failures.append(repr(error))

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures
    assert h.wait() == 0


def test_the_operations_of_a_thread_that_ended_are_counted_by_the_next_wait(
        handle_factory, tmp_path):
    h = handle_factory()
    data = bytearray(random_bytes(3 * MiB, seed=5))
    thread = threading.Thread(target=lambda: [h.async_pwrite(data, tmp_path / f"f{i}")
                                              for i in range(3)])
    thread.start()
    thread.join()
    assert h.wait() == 3
    assert all((tmp_path / f"f{i}").read_bytes() == data for i in range(3))
