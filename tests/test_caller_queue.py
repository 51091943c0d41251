"""Note [caller queue]: small aligned async operations go into the handle's own kernel AIO
context, many at once, and never through a worker."""
import os
import signal
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes, submitting_threads

KiB, MiB = 1 << 10, 1 << 20


def _workers(h):
    return [w.process.pid for w in h._scheduler.workers.pool.workers]


def _stopped_workers(h):
    """SIGSTOP every worker of ``h``; a context manager that lets them go on after."""
    class Stopped:
        def __enter__(self):
            self.pids = _workers(h)
            for pid in self.pids:
                os.kill(pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass        # killed and reaped meanwhile
    return Stopped()


@pytest.mark.parametrize("locked", [True, False], ids=["locked", "plain"])
def test_small_async_operations_run_without_the_workers(handle_factory, tmp_path, locked):
    """With every worker stopped, 4 KiB and 64 KiB async writes and reads at random aligned
    offsets still complete, many in flight at once, and move the right bytes."""
    h = handle_factory(intra_op_parallelism=2)
    path = str(tmp_path / "f")
    data = np.frombuffer(random_bytes(8 * MiB, seed=3), dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
    h.sync_pread(torch.empty(MiB, dtype=torch.uint8), path)     # the workers are up
    rng = np.random.default_rng(1)
    sizes = rng.choice([4 * KiB, 64 * KiB], 200)
    offsets = [int(rng.integers(0, (8 * MiB - s) // (4 * KiB))) * 4 * KiB for s in sizes]
    total = int(sizes.sum())
    if locked:
        buffer = h.new_cpu_locked_tensor(total, torch.empty(0, dtype=torch.uint8))
    else:
        buffer = torch.zeros(total, dtype=torch.uint8)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    queue = h._scheduler.workers.queue
    with _stopped_workers(h):
        # The most in flight at once, seen as they are started: at the end it may be one,
        # when back-pressure reaped all the others just before the last was submitted.
        most = 0
        for start, size, offset in zip(starts, sizes, offsets):
            assert h.async_pread(buffer[start:start + size], path, offset) == 0
            most = max(most, queue.in_flight)
        assert most > 1
        assert h.wait() == len(sizes)
        for start, size, offset in zip(starts, sizes, offsets):
            assert np.array_equal(buffer[start:start + size].numpy(), data[offset:offset + size])
        # Writes: each to its own 64 KiB slot of a second file, then the file read back.
        second = str(tmp_path / "g")
        buffer.copy_(torch.from_numpy(rng.integers(0, 256, total, dtype=np.uint8)))
        slots = [i * 64 * KiB for i in range(len(sizes))]
        for start, size, slot in zip(starts, sizes, slots):
            assert h.async_pwrite(buffer[start:start + size], second, slot) == 0
        assert h.wait() == len(sizes)
    written = np.fromfile(second, dtype=np.uint8)
    for start, size, slot in zip(starts, sizes, slots):
        assert np.array_equal(written[slot:slot + size], buffer[start:start + size].numpy())
    if locked:
        assert h.free_cpu_locked_tensor(buffer)


def test_a_large_operation_waits_for_the_small_ones_before_it(handle_factory, tmp_path):
    """Queued small writes, then a large write over the same bytes: the large one's bytes
    are what the file holds (it did not overtake them)."""
    h = handle_factory(intra_op_parallelism=2)
    path = str(tmp_path / "f")
    for round_number in range(5):
        small = h.new_cpu_locked_tensor(4 * KiB, torch.empty(0, dtype=torch.uint8))
        small.fill_(0x11)
        for slot in range(64):
            h.async_pwrite(small, path, slot * 4 * KiB)
        large = torch.full((4 * MiB,), 0x22 + round_number, dtype=torch.uint8)
        h.async_pwrite(large, path)
        assert h.wait() == 65
        assert set(np.fromfile(path, dtype=np.uint8).tolist()) == {0x22 + round_number}
        assert h.free_cpu_locked_tensor(small)


def test_queued_operations_outlive_a_worker_death(handle_factory, tmp_path):
    """A worker killed while small reads are queued fails only what it held: the queued
    reads complete with the right bytes, and the handle goes on with new workers."""
    h = handle_factory(intra_op_parallelism=2)
    path = str(tmp_path / "f")
    data = random_bytes(4 * MiB, seed=5)
    with open(path, "wb") as f:
        f.write(data)
    h.sync_pread(torch.empty(MiB, dtype=torch.uint8), path)
    buffer = h.new_cpu_locked_tensor(64 * 4 * KiB, torch.empty(0, dtype=torch.uint8))
    with _stopped_workers(h) as stopped:
        for k in range(64):
            h.async_pread(buffer[k * 4 * KiB:(k + 1) * 4 * KiB], path, (63 - k) * 4 * KiB)
        _kill_and_await(_workers(h)[0])
        assert h.wait() == 64
    for k in range(64):
        offset = (63 - k) * 4 * KiB
        assert bytes(buffer[k * 4 * KiB:(k + 1) * 4 * KiB].numpy()) == data[offset:offset + 4 * KiB]
    whole = torch.empty(4 * MiB, dtype=torch.uint8)
    assert h.sync_pread(whole, path) == 1 and bytes(whole.numpy()) == data
    del stopped


def test_close_without_wait_finishes_queued_writes(handle_factory, tmp_path):
    h = handle_factory()
    path = str(tmp_path / "f")
    h.sync_pread(torch.empty(4 * KiB, dtype=torch.uint8), _file(tmp_path, 4 * KiB))
    source = h.new_cpu_locked_tensor(128 * 4 * KiB, torch.empty(0, dtype=torch.uint8))
    source.copy_(torch.frombuffer(bytearray(random_bytes(512 * KiB, seed=9)), dtype=torch.uint8))
    for k in range(128):
        h.async_pwrite(source[k * 4 * KiB:(k + 1) * 4 * KiB], path, k * 4 * KiB)
    expected = bytes(source.numpy())
    h.close()
    with open(path, "rb") as f:
        assert f.read() == expected


def test_the_queue_reports_what_the_kernel_says(tmp_path):
    """Completions like a worker's: success, a short read at end of file (no errno, the
    bytes got), a failed request (its errno), a request the kernel refused (submitted from
    the caller or from the submitting thread); a full queue says no, a closed one raises."""
    import errno
    import mmap

    from nvmeswap._queues import CallerQueue

    path = _file(tmp_path, 64 * KiB)
    memory = mmap.mmap(-1, 64 * KiB)
    address = np.frombuffer(memory, dtype=np.uint8).ctypes.data
    queue = CallerQueue(4)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    read_only = os.open(path, os.O_RDONLY)

    def reaped():
        done = queue.reap(wait_all=True)
        assert queue.in_flight == 0
        return sorted((c.op_id, c.chunk, c.err, c.at_offset, c.requested, c.got, c.failed)
                      for c in done)

    try:
        assert queue.submit(1, 0, True, direct, address, 8 * KiB, 4 * KiB) is True
        assert queue.submit(2, 3, True, direct, address + 8 * KiB, 8 * KiB, 60 * KiB) is True
        assert queue.submit(3, 1, True, direct, 4 * KiB, 4 * KiB, 0) is True    # unmapped
        assert queue.submit(4, 0, False, read_only, address, 4 * KiB, 0) is True
        assert queue.in_flight == 4
        assert reaped() == [(1, 0, 0, 4 * KiB, 8 * KiB, 8 * KiB, False),
                            (2, 3, 0, 60 * KiB, 8 * KiB, 4 * KiB, True),
                            (3, 1, errno.EFAULT, 0, 4 * KiB, 0, True),
                            (4, 0, errno.EBADF, 0, 4 * KiB, 0, True)]
        assert memory[:8 * KiB] == Path(path).read_bytes()[4 * KiB:12 * KiB]
        assert [queue.submit(k, 0, True, direct, address, 4 * KiB, 0) for k in range(5)] == [
            True, True, True, True, False]
        assert len(queue.reap(wait_all=True)) == 4
        # Posted to the submitting thread: the kernel's refusal comes back as well.
        assert queue.post(1, 0, True, direct, address, 8 * KiB, 4 * KiB) is True
        assert queue.post(4, 2, False, read_only, address, 4 * KiB, 8 * KiB) is True
        assert queue.in_flight == 2
        assert reaped() == [(1, 0, 0, 4 * KiB, 8 * KiB, 8 * KiB, False),
                            (4, 2, errno.EBADF, 8 * KiB, 4 * KiB, 0, True)]
        assert [queue.post(k, 0, True, direct, address, 4 * KiB, 0) for k in range(5)] == [
            True, True, True, True, False]
        assert len(queue.reap(wait_all=True)) == 4
    finally:
        queue.close()
        os.close(direct)
        os.close(read_only)
        del address
    for start in (queue.submit, queue.post):
        with pytest.raises(ValueError, match="closed"):
            start(1, 0, True, -1, 0, 4 * KiB, 0)


def test_a_refusal_in_the_caller_wakes_the_thread_reading_completions(tmp_path):
    """A request the kernel refuses to ``submit`` never completes in the kernel: the eventfd
    says so, as for a completion, and a reap without waiting returns it."""
    import errno
    import select

    from nvmeswap._queues import CallerQueue

    path = _file(tmp_path, 4 * KiB)
    queue = CallerQueue(4)
    read_only = os.open(path, os.O_RDONLY)
    try:
        assert select.select([queue.eventfd], [], [], 0)[0] == []
        assert queue.submit(5, 1, False, read_only, 0, 4 * KiB, 0)
        assert select.select([queue.eventfd], [], [], 10)[0] == [queue.eventfd]
        (done,) = queue.reap()
        assert (done.op_id, done.chunk, done.err, done.failed) == (5, 1, errno.EBADF, True)
        assert queue.in_flight == 0 and queue.reap() == []
    finally:
        queue.close()
        os.close(read_only)


def _exit_code(pid, within):
    """The exit code of child ``pid``; killed and failed if it runs past ``within`` s."""
    import time
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"child {pid} still running after {within} s")


def test_the_submitting_thread_lives_from_the_first_post_to_close(tmp_path):
    """Note [submitter]: one thread, started by the first post, ended by close() after it
    has submitted what was posted; a forked child drops its copy of the queue without
    waiting for a thread it does not have."""
    import mmap

    from nvmeswap._queues import CallerQueue

    path = _file(tmp_path, 256 * KiB)
    memory = mmap.mmap(-1, 256 * KiB)
    address = np.frombuffer(memory, dtype=np.uint8).ctypes.data
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    before = submitting_threads()
    queue = CallerQueue(64)
    try:
        assert submitting_threads() == before
        for k in range(64):
            assert queue.post(k, 0, True, direct, address + k * 4 * KiB, 4 * KiB,
                              (63 - k) * 4 * KiB)
        assert submitting_threads() == before + 1
        pid = os.fork()
        if pid == 0:
            del queue       # a join here would wait forever
            os._exit(0)
        assert _exit_code(pid, within=30) == 0
        queue.close()       # before reaping: close submits and waits for what is posted
        assert submitting_threads() == before
        data = Path(path).read_bytes()
        for k in range(64):
            got, offset = memory[k * 4 * KiB:(k + 1) * 4 * KiB], (63 - k) * 4 * KiB
            assert got == data[offset:offset + 4 * KiB]
    finally:
        queue.close()
        os.close(direct)
        del address


def _kill_and_await(pid):
    """SIGKILL a worker and wait until it has exited (its parent reaps it later)."""
    import select
    pidfd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        select.select([pidfd], [], [])
    finally:
        os.close(pidfd)


def _file(tmp_path, nbytes):
    path = str(tmp_path / "source")
    with open(path, "wb") as f:
        f.write(random_bytes(nbytes))
    return path


@pytest.mark.parametrize("parallelism", [1, 2])
def test_conflicting_operations_run_in_the_order_they_were_started(handle_factory, tmp_path,
                                                                   parallelism):
    """Note [ordering]: whatever road each takes (workers, caller queue, calling thread),
    a read sees the writes started before it, a write does not change a read started
    before it, and of overlapping writes the later one's bytes stay."""
    h = handle_factory(intra_op_parallelism=parallelism)
    path = str(tmp_path / "f")
    old = random_bytes(8 * MiB, seed=11)
    with open(path, "wb") as f:
        f.write(old)
    for round_number in range(3):
        new = bytearray(random_bytes(8 * MiB, seed=round_number))
        h.async_pwrite(torch.frombuffer(new, dtype=torch.uint8), path)     # staged, large
        small = torch.empty(4 * KiB, dtype=torch.uint8)
        assert h.sync_pread(small, path, 8 * KiB) == 1     # would run in this thread
        assert bytes(small.numpy()) == new[8 * KiB:12 * KiB]
        locked = h.new_cpu_locked_tensor(64 * KiB, torch.empty(0, dtype=torch.uint8))
        h.async_pread(locked, path, MiB)                   # would go to the caller queue
        assert h.wait() == 2
        assert bytes(locked.numpy()) == new[MiB:MiB + 64 * KiB]
        # A large read, then a small write into its range: the read keeps the old bytes.
        whole = torch.empty(8 * MiB, dtype=torch.uint8)
        h.async_pread(whole, path)
        locked.fill_(round_number + 1)
        h.async_pwrite(locked, path, 2 * MiB)
        assert h.wait() == 2
        assert bytes(whole.numpy()) == new
        new[2 * MiB:2 * MiB + 64 * KiB] = bytes([round_number + 1]) * (64 * KiB)
        with open(path, "rb") as f:
            assert f.read() == new
        assert h.free_cpu_locked_tensor(locked)
        assert not h._scheduler.books.held


def test_a_small_read_waiting_for_staging_room_outlives_a_worker_death(handle_factory,
                                                                       tmp_path):
    """A small plain read bound for the caller queue waits for staging room held by a
    large write; the worker dies: the write fails, the read gets the room and its bytes."""
    import nvmeswap
    from nvmeswap.io.roads import Road
    h = handle_factory(staging_bytes=4 * MiB)
    source = _file(tmp_path, MiB)
    h.sync_pread(torch.empty(MiB, dtype=torch.uint8), source)      # the workers are up
    small = torch.zeros(256 * KiB, dtype=torch.uint8)     # more than the room left
    with _stopped_workers(h):
        h.async_pwrite(torch.ones(16 * MiB, dtype=torch.uint8), str(tmp_path / "big"))
        h.async_pread(small, source, 8 * KiB)
        waiting = h._scheduler.books.staged_ops[-1]
        assert waiting.road is Road.CALLER_QUEUE and waiting.staged.waiting()
        _kill_and_await(_workers(h)[0])
        with pytest.raises(nvmeswap.WorkerDied):
            h.wait()
    with open(source, "rb") as f:
        assert bytes(small.numpy()) == f.read()[8 * KiB:264 * KiB]
    assert not os.path.exists(tmp_path / "big") or os.path.getsize(tmp_path / "big") == 0


@pytest.mark.parametrize("locked", [True, False], ids=["locked", "plain"])
def test_a_read_of_bytes_a_pending_write_appends_follows_it(handle_factory, tmp_path, locked):
    """Note [ordering]: the read is not refused as past the end of the file the write has
    not grown yet; it runs after the write and returns its bytes. With the workers
    stopped, the writes they take are surely pending when the reads start."""
    h = handle_factory(intra_op_parallelism=2)
    memory = h.new_cpu_locked_tensor(2 * 300 * KiB, torch.empty(0, dtype=torch.uint8))
    for index, nbytes in enumerate((4 * KiB, 300 * KiB)):
        path = str(tmp_path / f"new{index}")
        data = torch.frombuffer(bytearray(random_bytes(nbytes, seed=index)), dtype=torch.uint8)
        source, target = (memory[:nbytes], memory[nbytes:2 * nbytes]) if locked else \
            (data.clone(), torch.zeros(nbytes, dtype=torch.uint8))
        source.copy_(data)
        target.zero_()
        pieces = [torch.zeros(KiB, dtype=torch.uint8) for _ in range(2)]
        with _stopped_workers(h):
            h.async_pwrite(source, path)
            h.async_pread(target, path)
            h.async_pread_many(pieces, path, [0, nbytes - KiB])
        assert h.wait() == 4        # the batch counts its requests
        assert torch.equal(target, data)
        assert torch.equal(pieces[0], data[:KiB]) and torch.equal(pieces[1], data[-KiB:])
    h.free_cpu_locked_tensor(memory)
