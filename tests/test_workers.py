"""Worker processes: a death becomes WorkerDied promptly, and nothing outlives its owner."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
from conftest import random_bytes

import nvmeswap

DEADLINE = 10.0


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
    started = time.monotonic()
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"no answer within {DEADLINE} s"
    return outcome, time.monotonic() - started


@pytest.fixture
def big_file(tmp_path):
    # Real data (holes are read without touching the device) that takes a second or
    # so to read with 4 KiB requests, one in flight.
    path = tmp_path / "big"
    path.write_bytes(random_bytes(64 << 20))
    return path


@pytest.mark.parametrize("use_async", [False, True])
def test_killed_worker_fails_the_operation_then_recovers(handle_factory, big_file, tmp_path,
                                                         use_async):
    h = handle_factory(block_size=4096, queue_depth=1, intra_op_parallelism=2)
    target = h.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))
    victim = _workers()[0]
    if use_async:
        h.async_pread(target, big_file)
        h.async_pread(bytearray(4096), big_file)      # another operation queued behind it
        operation = h.wait
    else:
        def operation():
            return h.sync_pread(target, big_file)
    threading.Timer(0.1, victim.send_signal, args=(signal.SIGKILL,)).start()
    outcome, elapsed = _call_with_deadline(operation)
    assert isinstance(outcome.get("error"), nvmeswap.WorkerDied), outcome
    assert elapsed < 3.0, f"WorkerDied took {elapsed:.1f} s"
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
    outcome, _ = _call_with_deadline(lambda: handle.sync_pread(back, tmp_path / "x"))
    assert outcome == {"value": 1} and back == data


def test_worker_killed_with_operations_queued_behind(handle_factory, tmp_path):
    """Every operation out at the death fails with WorkerDied; later ones succeed."""
    h = handle_factory(block_size=4096, queue_depth=1, intra_op_parallelism=2)
    data = random_bytes(16 << 20)
    (tmp_path / "src").write_bytes(data)
    targets = [bytearray(len(data)) for _ in range(3)]
    for target in targets:
        h.async_pread(target, tmp_path / "src")
    _workers()[1].send_signal(signal.SIGSEGV)
    outcome, _ = _call_with_deadline(h.wait)
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
    h.async_pread(bytearray(64 << 20), sys.argv[1])
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
        time.sleep(0.2)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
            time.sleep(0.02)
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                       for p in pids)
    finally:
        parent.kill()
        parent.stdout.close()
        parent.wait()


@pytest.mark.parametrize("use_async", [False, True])
def test_worker_died_error_does_not_keep_locked_memory_mapped(handle_factory, big_file,
                                                              use_async):
    """Regression: the raised error's traceback held the operation (and the caller's
    tensor) in a reference cycle, so locked memory stayed mapped until a gc pass."""
    import gc

    def mappings():
        with open("/proc/self/maps") as maps:
            return sum("memfd:nvmeswap" in line for line in maps)

    h = handle_factory(block_size=4096, queue_depth=1, intra_op_parallelism=2)
    gc.collect()
    gc.disable()
    try:
        before = mappings()
        target = h.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))
        if use_async:
            h.async_pread(target, big_file)
        threading.Timer(0.1, _workers()[0].send_signal, args=(signal.SIGKILL,)).start()
        with pytest.raises(nvmeswap.WorkerDied):
            h.wait() if use_async else h.sync_pread(target, big_file)
        h.free_cpu_locked_tensor(target)
        del target
        assert mappings() == before
    finally:
        gc.enable()


def _resident_mappings_kib(pid):
    """(size, Rss) in KiB of each memfd mapping of process ``pid``."""
    found, size = [], None
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 6:     # a mapping's header line
                size = "memfd:nvmeswap" in line
            elif size and fields[0] == "Size:":
                size = int(fields[1])
            elif size and fields[0] == "Rss:":
                found.append((size, int(fields[1])))
                size = None
    return found


def test_new_locked_tensor_is_mapped_by_every_worker_before_its_first_transfer(
        handle_factory, tmp_path):
    """Note [early mapping]: each worker maps a new locked tensor, every page of it, while
    the caller fills it; its first transfer then moves the right bytes."""
    h = handle_factory(intra_op_parallelism=2)
    nbytes = (8 << 20) + (12 << 10)     # a size no other region of the test has
    t = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    pids = [worker.process.pid for worker in h._scheduler.workers.pool.workers]
    assert len(pids) == 2
    wanted = (nbytes >> 10, nbytes >> 10)
    deadline = time.monotonic() + DEADLINE
    while not all(wanted in _resident_mappings_kib(pid) for pid in pids):
        assert time.monotonic() < deadline, "the workers did not map the new tensor"
        time.sleep(0.01)
    data = torch.frombuffer(bytearray(random_bytes(nbytes, seed=11)), dtype=torch.uint8)
    t.copy_(data)
    assert h.sync_pwrite(t, tmp_path / "f") == 1
    t.zero_()
    assert h.sync_pread(t, tmp_path / "f") == 1 and torch.equal(t, data)
    assert (tmp_path / "f").read_bytes() == data.numpy().tobytes()


def test_new_locked_tensors_do_not_wait_for_a_stopped_worker(handle_factory, tmp_path):
    """Note [early mapping]: sharing a new tensor never waits for a worker's socket, so
    tensors made while a worker is stopped (its socket full) do not hang; they are mapped
    on their first transfer instead, and move the right bytes."""
    h = handle_factory()
    worker = h._scheduler.workers.pool.workers[0]
    example = torch.empty(0, dtype=torch.uint8)
    nbytes = 1 << 20    # past the inline limit: its transfers go to the worker
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        outcome, _ = _call_with_deadline(lambda: (
            [h.new_cpu_locked_tensor(4096, example) for _ in range(3000)],
            [h.new_cpu_locked_tensor(nbytes, example) for _ in range(2)]))
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)
    assert "error" not in outcome, outcome.get("error")
    small, big = outcome["value"]
    regions = [h._placement.locked.containing(t.data_ptr(), t.numel()) for t in big]
    assert not any(r.region_id in worker.mapped for r in regions), \
        "3000 map requests fit a stopped worker's socket: the test shows nothing"
    data = torch.frombuffer(bytearray(random_bytes(2 * nbytes, seed=12)), dtype=torch.uint8)
    for k, t in enumerate(big):
        t.copy_(data[k * nbytes:(k + 1) * nbytes])
        assert h.sync_pwrite(t, tmp_path / "f", k * nbytes) == 1
    for k, t in enumerate(big):
        t.zero_()
        h.async_pread(t, tmp_path / "f", (1 - k) * nbytes)
    assert h.wait() == 2
    assert torch.equal(big[0], data[nbytes:]) and torch.equal(big[1], data[:nbytes])
    assert (tmp_path / "f").read_bytes() == data.numpy().tobytes()
    assert all(r.region_id in worker.mapped for r in regions)
