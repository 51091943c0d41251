"""Worker processes: a death becomes WorkerDied promptly, and nothing outlives its owner."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
from conftest import (
    in_flight,
    needs_torch,
    random_bytes,
    stopped_workers,
    wait_until,
    worker_processes,
)

import nvmeswap

DEADLINE = 60.0      # for a hang only: each test waits on an event, never on a duration


def _workers():
    return [p for p in psutil.Process().children() if "nvmeswap.worker" in " ".join(p.cmdline())]


def _call_with_deadline(function):
    """Run ``function`` in a thread; fail the test instead of hanging."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"no answer within {DEADLINE} s"
    return outcome


def _killed_during(h, operation, victim, signal_number=signal.SIGKILL, ready=None):
    """Run ``operation`` (in a thread) with ``h``'s workers stopped, so that its requests
    stay with them however fast the storage is; once they are in flight (and ``ready()``
    holds), send ``signal_number`` to ``victim`` and let the other workers go on. The
    outcome."""
    outcome = {}

    def run():
        try:
            outcome["value"] = operation()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    with stopped_workers(h):
        thread.start()
        wait_until(lambda: in_flight(h) and (ready is None or ready()),
                   "the requests reach the workers")
        victim.send_signal(signal_number)
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"no answer within {DEADLINE} s of the death"
    return outcome


@pytest.fixture
def big_file(tmp_path):
    # Real data (holes are read without touching the device).
    path = tmp_path / "big"
    path.write_bytes(random_bytes(16 << 20))
    return path


@needs_torch
@pytest.mark.parametrize("use_async", [False, True])
def test_killed_worker_fails_the_operation_then_recovers(handle_factory, big_file, tmp_path,
                                                         use_async):
    import torch

    h = handle_factory(block_size=4096, queue_depth=1, intra_op_parallelism=2)
    target = h.new_cpu_locked_tensor(16 << 20, torch.empty(0, dtype=torch.uint8))
    victim = _workers()[0]
    if use_async:
        def operation():
            h.async_pread(target, big_file)
            h.async_pread(bytearray(4096), big_file)      # another operation queued behind it
            return h.wait()
    else:
        def operation():
            return h.sync_pread(target, big_file)
    outcome = _killed_during(h, operation, victim)
    assert isinstance(outcome.get("error"), nvmeswap.WorkerDied), outcome
    assert "killed by signal 9" in str(outcome["error"]) and str(big_file) in str(outcome["error"])
    assert not victim.is_running()
    # Recovered: new workers, and a correct round trip.
    data = random_bytes(3 << 20)
    h.sync_pwrite(bytearray(data), tmp_path / "after")
    back = bytearray(len(data))
    h.sync_pread(back, tmp_path / "after")
    assert back == data and len(_workers()) == 2


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGSEGV])
def test_worker_that_died_while_idle_is_replaced(handle, tmp_path, signal_number):
    """A death between operations fails nothing: the next operation gets new workers."""
    data = random_bytes(4 << 20)
    handle.sync_pwrite(bytearray(data), tmp_path / "x")
    for worker in _workers():
        worker.send_signal(signal_number)
        worker.wait(5)
    back = bytearray(len(data))
    outcome = _call_with_deadline(lambda: handle.sync_pread(back, tmp_path / "x"))
    assert outcome == {"value": 1} and back == data


@needs_torch
def test_a_worker_dead_while_idle_is_replaced_with_caller_queue_reads_out(handle_factory,
                                                                          tmp_path):
    """Small reads in the caller queue are not the workers': a worker that died while
    idle is replaced for the next operation though such reads are out (Note [caller
    queue]), and every read comes back whole."""
    import torch

    h = handle_factory(intra_op_parallelism=2)
    data = random_bytes(8 << 20)
    (tmp_path / "x").write_bytes(data)
    big = bytearray(len(data) - 4096)
    h.sync_pread(big, tmp_path / "x", 4096)          # the workers are up, then idle
    for worker in _workers():
        worker.kill()
        worker.wait(5)
    small = h.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.uint8))
    h.async_pread(small, tmp_path / "x", 0)          # the caller queue's
    h.async_pread(big, tmp_path / "x", 4096)         # the workers'
    assert _call_with_deadline(h.wait) == {"value": 2}
    assert bytes(small.numpy()) + big == data


def test_worker_killed_with_operations_queued_behind(handle_factory, tmp_path):
    """Every operation out at the death fails with WorkerDied; later ones succeed."""
    h = handle_factory(block_size=4096, queue_depth=1, intra_op_parallelism=2)
    data = random_bytes(16 << 20)
    (tmp_path / "src").write_bytes(data)
    targets = [bytearray(len(data)) for _ in range(3)]
    submitted = threading.Event()

    def operation():
        for target in targets:
            h.async_pread(target, tmp_path / "src")
        submitted.set()
        return h.wait()

    # Killed only once all three are out: one submitted after the death would rightly
    # go to the new workers and succeed.
    outcome = _killed_during(h, operation, psutil.Process(worker_processes(h)[1].pid),
                             signal.SIGSEGV, ready=submitted.is_set)
    error = outcome.get("error")
    assert isinstance(error, nvmeswap.WorkerDied) and "signal 11" in str(error)
    assert error.failed_operations == 3
    if sys.version_info >= (3, 11):
        assert any("3 of 3 operations failed" in note for note in error.__notes__)
    assert h.wait() == 0
    h.async_pread(targets[0], tmp_path / "src")
    assert h.wait() == 1 and targets[0] == data


def test_close_leaves_no_process(handle_factory):
    h = handle_factory(intra_op_parallelism=4)
    workers = _workers()
    assert len(workers) == 4
    h.close()
    assert not any(w.is_running() for w in workers)


PARENT_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    import nvmeswap
    h = nvmeswap.aio_handle(block_size=4096, queue_depth=1, intra_op_parallelism=2)
    h.async_pread(bytearray(16 << 20), sys.argv[1])
    print(" ".join(str(p.pid) for p in __import__("psutil").Process().children()), flush=True)
    time.sleep(60)
""")


def test_killed_parent_takes_its_workers_along(big_file):
    package_root = os.path.dirname(os.path.dirname(nvmeswap.__file__))
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, str(big_file), package_root],
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait()

        def gone(pid):
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_until(lambda: all(gone(p) for p in pids), "the orphaned workers exit")
    finally:
        parent.kill()
        parent.stdout.close()
        parent.wait()


@needs_torch
@pytest.mark.parametrize("use_async", [False, True])
def test_worker_died_error_does_not_keep_locked_memory_mapped(handle_factory, big_file,
                                                              use_async):
    """Regression: the raised error's traceback held the operation (and the caller's
    tensor) in a reference cycle, so locked memory stayed mapped until a gc pass."""
    import gc

    import torch

    def mappings():
        with open("/proc/self/maps") as maps:
            return sum("memfd:nvmeswap" in line for line in maps)

    h = handle_factory(block_size=4096, queue_depth=1, intra_op_parallelism=2)
    gc.collect()
    gc.disable()
    try:
        before = mappings()
        held = [h.new_cpu_locked_tensor(16 << 20, torch.empty(0, dtype=torch.uint8))]

        def operation():
            if use_async:
                h.async_pread(held[0], big_file)
                return h.wait()
            return h.sync_pread(held[0], big_file)

        outcome = _killed_during(h, operation, _workers()[0])
        assert isinstance(outcome.pop("error", None), nvmeswap.WorkerDied)
        h.free_cpu_locked_tensor(held.pop())
        assert mappings() == before
    finally:
        gc.enable()


def test_ctrl_c_while_workers_are_reaped_closes_each_descriptor_once(handle_factory, tmp_path,
                                                                   monkeypatch):
    """A Ctrl-C between two workers' reaping waits until all are reaped, then raises: the
    clean-up that follows must not close a worker's descriptors a second time (by then
    the numbers may be someone else's)."""
    from nvmeswap.workers.pool import Worker

    h = handle_factory(intra_op_parallelism=2)
    data = bytes(range(256)) * 64
    assert h.sync_pwrite(bytearray(data), str(tmp_path / "f")) == 1     # the pool runs
    pool = h._scheduler.workers.pool
    processes = [worker.process for worker in pool.workers]
    assert len(processes) == 2
    close = Worker.close

    def close_then_interrupt(worker):
        close(worker)
        os.kill(os.getpid(), signal.SIGINT)     # lands before the next worker's close

    monkeypatch.setattr(Worker, "close", close_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        h.close()
    monkeypatch.undo()
    assert pool.workers == [] and all(p.returncode is not None for p in processes)
    assert (tmp_path / "f").read_bytes() == data
