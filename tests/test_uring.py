"""Note [engines]: io_uring moves the same bytes as kernel AIO and says so in the same
records, on both queues; a handle picks its engine; where io_uring is refused, "auto"
falls back to kernel AIO and "uring" says why."""
import errno
import functools
import json
import mmap
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import (
    may_lock,
    needs_torch,
    random_bytes,
    submitter_ids,
    uring_unusable,
    wait_until,
)
from test_completion import by_caller, by_caller_queue, by_engine, by_worker
from test_engine import _address, _file, fields

import nvmeswap
from nvmeswap._queues import AioEngine, CallerQueue
from nvmeswap._uring import UringEngine, UringQueue, probe
from nvmeswap.io import engines

KiB, MiB = 1 << 10, 1 << 20
ROOT = Path(__file__).resolve().parent.parent

REFUSED = probe()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=f"io_uring: {REFUSED}")
ENGINES = {"aio": AioEngine, "uring": UringEngine}
QUEUES = {"aio": CallerQueue, "uring": UringQueue}


# -- the engine (the tests shared with kernel AIO are in test_engine.py) ------------------
@pytest.mark.parametrize("single_submit, overlap_events",
                         [(False, False), (False, True), (True, False), (True, True)])
def test_odd_sizes_and_offsets_write_and_read_back_as_kernel_aio_does(tmp_path, single_submit,
                                                                      overlap_events):
    """Writes then reads of odd sizes at odd offsets (heads and tails through the buffered
    descriptor), on both engines: the same Completions, the same file, the same bytes."""
    memory = mmap.mmap(-1, 4 * MiB)
    base = _address(memory)
    records = {}
    try:
        for name, kind in ENGINES.items():
            engine = kind(256 * KiB, 4, single_submit, overlap_events)
            path = str(tmp_path / name)
            direct = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
            buffered = os.open(path, os.O_RDWR)
            records[name] = []
            try:
                for k, (size, offset) in enumerate((s, o) for s in (1, 4095, 4097, 3 * MiB + 5)
                                                   for o in (0, 7, 4096)):
                    data = random_bytes(size, seed=k)
                    memory[offset:offset + size] = data     # memory and file at one phase
                    for is_read in (False, True):
                        if is_read:
                            memory[offset:offset + size] = bytes(size)
                        records[name].append(fields(engine.transfer(
                            k, is_read, is_read, direct, buffered, base + offset, size,
                            offset + 8 * MiB * k, 4096)))
                    assert memory[offset:offset + size] == data, (name, size, offset)
            finally:
                os.close(direct)
                os.close(buffered)
        assert records["uring"] == records["aio"]
        assert (tmp_path / "uring").read_bytes() == (tmp_path / "aio").read_bytes()
    finally:
        del base
        memory.close()


def _ring_fdinfo(path):
    """A ring's fdinfo with its registered buffers: the kernel lists them only when it can
    take the ring's lock at once, so a read while the ring's owner holds it is read again."""
    deadline = time.monotonic() + 10
    while True:
        info = Path(path).read_text()
        if "UserBufs:" in info or time.monotonic() > deadline:
            return info
        time.sleep(0.001)


def _registered(pid=None, but=None):
    """The buffers registered with the rings of process ``pid`` (ours by default), as
    /proc lists them, but for the ring at descriptor ``but``: ``[(address, length), ...]``."""
    found = []
    base = f"/proc/{pid or 'self'}"
    for fd in os.listdir(f"{base}/fd"):
        if but is not None and int(fd) == but:
            continue
        try:
            if os.readlink(f"{base}/fd/{fd}") != "anon_inode:[io_uring]":
                continue
            info = _ring_fdinfo(f"{base}/fdinfo/{fd}")
        except FileNotFoundError:
            continue
        found += [(int(a, 16), int(n)) for a, n in re.findall(r"^\s+\d+: (0x[0-9a-f]+)/(\d+)$",
                                                             info, re.MULTILINE)]
    return found


def test_registered_memory_moves_the_same_bytes(tmp_path):
    """register_buffers (io_uring's fixed buffers): the ring lists the memory; transfers
    in it, and one running past its end, move the right bytes; unregistered, it is gone
    from the ring and its transfers go as before."""
    # Small enough for the cluster-default RLIMIT_MEMLOCK (64 KiB), which io_uring
    # charges registered pages to.
    path = _file(tmp_path, 32 * KiB, seed=8)
    data = Path(path).read_bytes()
    engine = UringEngine(4096, 8, False, True)
    memory, outside = mmap.mmap(-1, 32 * KiB), mmap.mmap(-1, 32 * KiB)
    base = _address(memory)
    direct = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        assert engine.register_buffers(base, 16 * KiB) is True
        assert _registered() == [(base, 16 * KiB)]
        for at, n in ((0, 16 * KiB), (4 * KiB, 8 * KiB), (8 * KiB, 24 * KiB)):
            memory[:] = bytes(32 * KiB)
            done = engine.transfer(1, 0, True, direct, -1, base + at, n, at, 4096)
            assert fields(done) == (1, 0, 0, at, n, n, False)
            assert memory[at:at + n] == data[at:at + n]
        memory[:] = random_bytes(32 * KiB, seed=1)
        assert not engine.transfer(2, 0, False, direct, -1, base, 32 * KiB, 0, 4096).failed
        assert Path(path).read_bytes() == memory[:]
        engine.unregister_buffers(base)
        engine.unregister_buffers(base)
        assert _registered() == []
        assert not engine.transfer(3, 0, True, direct, -1, _address(outside), 32 * KiB, 0,
                                   4096).failed
        assert outside[:] == memory[:]
        assert engine.register_buffers(0, 4096) is False
    finally:
        os.close(direct)
        del base
        memory.close()
        outside.close()


# -- the caller queue ---------------------------------------------------------------------
def test_the_queue_reports_what_the_kernel_says(tmp_path):
    """As CallerQueue's: success, a short read at end of file (no errno, the bytes got), a
    failed request (its errno), a request the kernel refused; a full queue says no, a
    closed one raises."""
    path = _file(tmp_path, 64 * KiB)
    memory = mmap.mmap(-1, 64 * KiB)
    address = _address(memory)
    queue = UringQueue(4)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    read_only = os.open(path, os.O_RDONLY)

    def reaped():
        done = queue.reap(wait_all=True)
        assert queue.in_flight == 0
        return sorted(fields(c) for c in done)

    try:
        assert queue.capacity == 4
        for start in (queue.submit, queue.post):
            assert start(1, 0, True, direct, address, 8 * KiB, 4 * KiB) is True
            assert start(2, 3, True, direct, address + 8 * KiB, 8 * KiB, 60 * KiB) is True
            assert start(3, 1, True, direct, 4 * KiB, 4 * KiB, 0) is True    # unmapped
            assert start(4, 0, False, read_only, address, 4 * KiB, 0) is True
            assert queue.in_flight == 4
            assert start(5, 0, True, direct, address, 4 * KiB, 0) is False
            assert reaped() == [(1, 0, 0, 4 * KiB, 8 * KiB, 8 * KiB, False),
                                (2, 3, 0, 60 * KiB, 8 * KiB, 4 * KiB, True),
                                (3, 1, errno.EFAULT, 0, 4 * KiB, 0, True),
                                (4, 0, errno.EBADF, 0, 4 * KiB, 0, True)]
            assert memory[:8 * KiB] == Path(path).read_bytes()[4 * KiB:12 * KiB]
        assert queue.reap() == []
    finally:
        queue.close()
        queue.close()
        os.close(direct)
        os.close(read_only)
        del address
        memory.close()
    assert queue.eventfd == -1
    for start in (queue.submit, queue.post):
        with pytest.raises(ValueError, match="closed"):
            start(1, 0, True, -1, 0, 4 * KiB, 0)
    with pytest.raises(ValueError, match="closed"):
        queue.post_many(1, True, -1, [0], 4 * KiB, [0])


def test_a_completion_wakes_the_thread_reading_them(tmp_path):
    """The eventfd registered with the ring becomes readable for a completion, a refusal
    included, and a reap without waiting then returns it."""
    path = _file(tmp_path, 4 * KiB)
    queue = UringQueue(4)
    read_only = os.open(path, os.O_RDONLY)
    try:
        assert select.select([queue.eventfd], [], [], 0)[0] == []
        assert queue.submit(5, 1, False, read_only, 0, 4 * KiB, 0)
        assert select.select([queue.eventfd], [], [], 10)[0] == [queue.eventfd]
        deadline = time.monotonic() + 10
        done = []
        while not done and time.monotonic() < deadline:
            done = queue.reap()
        assert [fields(c)[:3] for c in done] == [(5, 1, errno.EBADF)]
        assert queue.in_flight == 0 and queue.reap() == []
        assert select.select([queue.eventfd], [], [], 0)[0] == []
    finally:
        queue.close()
        os.close(read_only)


def test_a_forked_child_drops_its_copy_of_the_ring(tmp_path):
    """Note [submitter] on a ring: one submitting thread, started by the first post and
    ended by close(). A forked child shares the parent's ring: it must neither wait on it
    (nor on a thread it does not have) nor take its completions; the parent reaps every
    one, with the right bytes."""
    path = _file(tmp_path, 256 * KiB)
    memory = mmap.mmap(-1, 256 * KiB)
    address = _address(memory)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    # Thread ids, not counts: another queue of the process may start its own meanwhile.
    before = submitter_ids()
    queue = UringQueue(64)
    try:
        for k in range(64):
            assert queue.post(k, 0, True, direct, address + k * 4 * KiB, 4 * KiB,
                              (63 - k) * 4 * KiB)
        started = submitter_ids() - before
        assert started      # ours, with the first post
        pid = os.fork()
        if pid == 0:
            queue.close()
            os._exit(0)
        deadline = time.monotonic() + 30
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the child still runs")
            time.sleep(0.01)
        assert sorted(c.op_id for c in queue.reap(wait_all=True)) == list(range(64))
        queue.close()
        assert len(submitter_ids() & started) < len(started)     # ours has ended
        data = Path(path).read_bytes()
        for k in range(64):
            offset = (63 - k) * 4 * KiB
            assert memory[k * 4 * KiB:(k + 1) * 4 * KiB] == data[offset:offset + 4 * KiB]
    finally:
        queue.close()
        os.close(direct)
        del address
        memory.close()


@pytest.mark.parametrize("engine", ["aio", "uring"])
def test_post_many_takes_what_fits_in_one_call(tmp_path, engine):
    """``post_many``: chunk = index, the requests the queue has room for (from the first
    on), one size for all or one each; a refused request among them comes back alone."""
    path = _file(tmp_path, MiB, seed=6)
    data = Path(path).read_bytes()
    memory = mmap.mmap(-1, 128 * KiB)
    address = _address(memory)
    queue = QUEUES[engine](16)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    read_only = os.open(path, os.O_RDONLY)
    offsets = [(7 * k % 32) * 8 * KiB for k in range(32)]
    addresses = [address + k * 4 * KiB for k in range(32)]
    try:
        with pytest.raises(ValueError, match="as many"):
            queue.post_many(1, True, direct, addresses, 4 * KiB, offsets[:3])
        assert queue.post_many(1, True, direct, addresses, 4 * KiB, offsets) == 16
        assert queue.in_flight == 16
        assert queue.post_many(1, True, direct, addresses, 4 * KiB, offsets) == 0
        done = sorted(fields(c) for c in queue.reap(wait_all=True))
        assert done == [(1, k, 0, offsets[k], 4 * KiB, 4 * KiB, False) for k in range(16)]
        for k in range(16):
            assert memory[k * 4 * KiB:(k + 1) * 4 * KiB] == data[offsets[k]:offsets[k] + 4 * KiB]
        sizes = [4 * KiB * (1 + k % 2) for k in range(8)]
        assert queue.post_many(2, True, direct, addresses[:8:2] + addresses[9:12:2],
                               sizes[:6], offsets[:6]) == 6
        assert queue.post_many(3, False, read_only, addresses[:1], 4 * KiB, [0]) == 1
        done = sorted(fields(c) for c in queue.reap(wait_all=True))
        assert done == [(2, k, 0, offsets[k], sizes[k], sizes[k], False) for k in range(6)] \
            + [(3, 0, errno.EBADF, 0, 4 * KiB, 0, True)]
        assert queue.post_many(4, True, direct, [], 4 * KiB, []) == 0
    finally:
        queue.close()
        os.close(direct)
        os.close(read_only)
        del address
        memory.close()


# -- one record ---------------------------------------------------------------------------
by_uring_engine = functools.partial(by_engine, engine_kind=UringEngine)
by_uring_worker = functools.partial(by_worker, engine_kind=UringEngine)
by_uring_queue = functools.partial(by_caller_queue, queue_kind=UringQueue)


@pytest.mark.parametrize("offset, got", [(4 * KiB, 8 * KiB), (60 * KiB, 4 * KiB)],
                         ids=["whole", "short-at-end-of-file"])
def test_every_road_of_both_engines_returns_the_same_record(tmp_path, offset, got):
    path = tmp_path / "f"
    data = random_bytes(64 * KiB, seed=9)
    path.write_bytes(data)
    memory = mmap.mmap(-1, 8 * KiB)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        records = {}
        roads = {"engine": by_engine, "worker": by_worker, "caller queue": by_caller_queue,
                 "caller": by_caller, "uring engine": by_uring_engine,
                 "uring worker": by_uring_worker, "uring queue": by_uring_queue}
        for name, road in roads.items():
            memory[:] = bytes(8 * KiB)
            done = road(fd, memory, 8 * KiB, offset)
            assert type(done) is nvmeswap._transfers.Completion
            records[name] = fields(done)
            assert memory[:got] == data[offset:offset + got], name
    finally:
        os.close(fd)
        memory.close()
    assert records == dict.fromkeys(records, (7, 3, 0, offset, 8 * KiB, got, got < 8 * KiB))


# -- the handle ---------------------------------------------------------------------------
def _rings_of(pid):
    """How many io_uring instances process ``pid`` holds open."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[io_uring]"
        except FileNotFoundError:
            pass
    return count


@needs_torch
@pytest.mark.parametrize("engine", ["aio", "uring", "auto"])
def test_a_handle_runs_on_the_engine_it_asks_for(handle_factory, tmp_path, engine):
    """Workers and caller queue on the engine chosen; large, unaligned and small queued
    operations move the right bytes on it."""
    import torch
    if engine == "uring" and uring_unusable():
        pytest.skip(uring_unusable())
    h = handle_factory(intra_op_parallelism=2, engine=engine)
    ring = engine == "uring" or engine == "auto" and engines.auto_choice()[0] == "uring"
    assert h.get_engine() == ("uring" if ring else "aio")
    path = str(tmp_path / "f")
    data = torch.frombuffer(bytearray(random_bytes(9 * MiB + 3, seed=2)), dtype=torch.uint8)
    assert h.sync_pwrite(data, path, 5) == 1
    back = torch.zeros_like(data)
    assert h.async_pread(back, path, 5) == 0 and h.wait() == 1
    assert torch.equal(back, data)
    small = h.new_cpu_locked_tensor(64 * 4 * KiB, torch.empty(0, dtype=torch.uint8))
    for k in range(64):
        h.async_pread(small[k * 4 * KiB:(k + 1) * 4 * KiB], path, (63 - k) * 4 * KiB)
    assert h.wait() == 64
    written = Path(path).read_bytes()
    for k in range(64):
        offset = (63 - k) * 4 * KiB
        assert bytes(small[k * 4 * KiB:(k + 1) * 4 * KiB].numpy()) == written[offset:offset + 4 * KiB]
    queue, expected = h._scheduler.workers.queue, (UringQueue if ring else CallerQueue)
    if ring and not may_lock(8 * MiB):
        # The kernel charges a ring's memory to its user's RLIMIT_MEMLOCK: under a 64 KiB
        # limit a user has room for two rings of 256 entries, across all its processes,
        # and a handle that finds none goes without a caller queue.
        assert queue is None or type(queue) is expected
    else:
        assert type(queue) is expected
    pids = [worker.process.pid for worker in h._scheduler.workers.pool.workers]
    # Each worker's own ring, and the parent's registry it inherits (Note [cloned buffers]).
    rings = (2 if h._scheduler.workers._registry else 1) if ring else 0
    assert [_rings_of(pid) for pid in pids] == [rings] * 2
    # Each region a worker maps is registered with its ring (UringEngine.register_buffers),
    # where RLIMIT_MEMLOCK lets it pin the 64 MiB staging region.
    if may_lock(64 * MiB):
        assert bool(sum(len(_registered(pid)) for pid in pids)) is ring
    assert h.free_cpu_locked_tensor(small)


@needs_torch
def test_a_worker_registers_a_region_moved_once_when_it_is_next_idle(handle_factory, tmp_path,
                                                                    monkeypatch):
    """Where the kernel clones no buffers (forced here), workers register regions
    themselves: a region's first transfer, of all of it, leaves it registered with the
    worker's ring as soon as the worker has nothing to do (not only at its second
    transfer); later transfers through it move the right bytes, and freeing the region
    unregisters it."""
    import torch

    import nvmeswap._uring

    if not may_lock(64 * MiB):
        pytest.skip("RLIMIT_MEMLOCK too small for the kernel to pin a region")
    monkeypatch.setattr(nvmeswap._uring, "clone_supported", lambda: False)
    h = handle_factory(engine="uring")
    worker = h._scheduler.workers.pool.workers[0].process.pid
    assert _registered(worker) == []
    tensor = h.new_cpu_locked_tensor(4 * MiB, torch.empty(0, dtype=torch.uint8))
    first, second = random_bytes(4 * MiB, seed=5), random_bytes(4 * MiB, seed=6)
    tensor.copy_(torch.frombuffer(bytearray(first), dtype=torch.uint8))
    path = str(tmp_path / "f")
    assert h.sync_pwrite(tensor, path) == 1
    deadline = time.monotonic() + 10
    while not _registered(worker) and time.monotonic() < deadline:
        time.sleep(0.01)
    [(_, length)] = _registered(worker)
    assert length >= 4 * MiB
    assert Path(path).read_bytes() == first
    tensor.copy_(torch.frombuffer(bytearray(second), dtype=torch.uint8))
    assert h.sync_pwrite(tensor, path) == 1 and Path(path).read_bytes() == second
    tensor.zero_()
    assert h.sync_pread(tensor, path) == 1 and bytes(tensor.numpy()) == second
    assert _registered(worker) == [(_, length)]
    # A region moved in part waits for its second transfer: registering pins (allocates)
    # every page of it. Registered in order, so once ``whole`` is, ``part`` was passed over.
    part, whole = (h.new_cpu_locked_tensor(4 * MiB, torch.empty(0, dtype=torch.uint8))
                   for _ in range(2))
    assert h.sync_pwrite(part[:MiB], path) == 1 and h.sync_pwrite(whole, path) == 1
    deadline = time.monotonic() + 10
    while len(_registered(worker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_registered(worker)) == 2
    assert h.sync_pwrite(part[MiB:2 * MiB], path) == 1
    assert len(_registered(worker)) == 3
    for t in (tensor, part, whole):
        assert h.free_cpu_locked_tensor(t)
    deadline = time.monotonic() + 10
    while _registered(worker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _registered(worker) == []


def _rss_kib(pid, size):
    """Resident KiB of each of the process's mappings of nvmeswap's memfds ``size`` long."""
    found, current = [], None
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                current = "memfd:nvmeswap" in line and end - start == size
            elif current and fields[0] == "Rss:":
                found.append(int(fields[1]))
    return found


@needs_torch
def test_workers_move_regions_the_parent_registered_without_touching_them(handle_factory,
                                                                           tmp_path):
    """Note [cloned buffers]: a locked tensor of an io_uring handle is registered by the
    parent; its worker's ring clones that, so the worker moves every byte (and slices at
    any address and offset) without faulting the pages into its own mapping, and drops the
    registration when the tensor is freed."""
    import torch

    from nvmeswap._uring import clone_supported

    if not clone_supported():
        pytest.skip("this kernel clones no registered buffers (Linux 6.13)")
    if not may_lock(64 * MiB):
        pytest.skip("RLIMIT_MEMLOCK too small for the kernel to pin a region")
    h = handle_factory(engine="uring", intra_op_parallelism=2)
    size = 16 * MiB
    tensor = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    data = random_bytes(size, seed=7)
    tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    path = str(tmp_path / "f")
    assert h.sync_pwrite(tensor, path) == 1 and Path(path).read_bytes() == data
    tensor.zero_()
    assert h.sync_pread(tensor, path) == 1 and bytes(tensor.numpy()) == data
    piece = tensor[4096 * 3 + 512:4096 * 3000 + 512]    # an unaligned head and tail
    piece.zero_()
    assert h.sync_pread(piece, path, 4096 * 3 + 512) == 1 and bytes(tensor.numpy()) == data
    workers = [worker.process.pid for worker in h._scheduler.workers.pool.workers]
    registry = h._scheduler.workers._registry.fd     # the workers inherit it, same number
    assert [len(_registered(pid, but=registry)) for pid in workers] == [1, 1]
    # The workers' mappings of it hold the pages of the head and tail at most (each a
    # huge page where shared memory comes in them).
    page_kib = 2048 if _shmem_in_huge_pages() else 4
    assert all(sum(_rss_kib(pid, size)) <= 2 * page_kib for pid in workers), \
        [_rss_kib(pid, size) for pid in workers]
    assert h.free_cpu_locked_tensor(tensor)
    wait_until(lambda: not any(_registered(pid, but=registry) for pid in workers),
               "clones dropped")
    assert _registered(but=None) == []      # nor does our registry hold it
    h.close()
    assert "io_uring" not in _link_or_none(f"/proc/self/fd/{registry}")  # closed with it


def _shmem_in_huge_pages():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read().split("[")[1].split("]")[0] not in ("never", "deny")
    except (OSError, IndexError):
        return False


def _link_or_none(path):
    try:
        return os.readlink(path)
    except FileNotFoundError:
        return "none"


def test_the_engine_argument_is_checked_before_anything_starts(monkeypatch):
    with pytest.raises(ValueError, match="engine must be one of aio, uring, auto"):
        nvmeswap.aio_handle(engine="io_uring")
    with pytest.raises(TypeError, match="engine must be a str"):
        nvmeswap.aio_handle(engine=1)
    monkeypatch.setenv("NVMESWAP_ENGINE", "fast")
    with pytest.raises(ValueError, match="NVMESWAP_ENGINE='fast'"):
        nvmeswap.aio_handle()
    assert engines.checked_engine("aio") == "aio"
    monkeypatch.setenv("NVMESWAP_ENGINE", "uring")
    assert engines.checked_engine(None) == "uring"
    monkeypatch.setenv("NVMESWAP_ENGINE", "")
    assert engines.checked_engine(None) == "aio"


def test_the_environment_sets_the_default_engine(handle_factory, monkeypatch):
    monkeypatch.setenv("NVMESWAP_ENGINE", "uring")
    assert handle_factory().get_engine() == "uring"
    assert handle_factory(engine="aio").get_engine() == "aio"
    monkeypatch.setenv("NVMESWAP_ENGINE", "aio")
    assert handle_factory().get_engine() == "aio"
    assert nvmeswap.aio_handle.from_config({"engine": "uring"}).get_engine() == "uring"


# -- where io_uring is refused ------------------------------------------------------------
AUTO_SCRIPT = textwrap.dedent("""
    import ctypes, errno, os, platform, resource, struct, sys, warnings
    if sys.argv[3] == "seccomp":
        # A seccomp filter that fails io_uring_setup (425) with ENOSYS, as a container's does.
        arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
        ld_arch, ld_nr, jeq, ret = (0x20, 4), (0x20, 0), 0x15, 0x06
        program = [(0x20, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, 0x7FFF0000),
                   (0x20, 0, 0, 0), (jeq, 0, 1, 425), (ret, 0, 0, 0x00050000 | errno.ENOSYS),
                   (ret, 0, 0, 0x7FFF0000)]
        code = b"".join(struct.pack("HBBI", *op) for op in program)
        buffer = ctypes.create_string_buffer(code)
        fprog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(buffer))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(38, 1, 0, 0, 0) == 0                      # PR_SET_NO_NEW_PRIVS
        assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # SECCOMP_MODE_FILTER
    else:   # "memlock": the usual 64 KiB
        _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, hard))
    sys.path.insert(0, sys.argv[1])
    import nvmeswap, numpy as np
    from nvmeswap._uring import probe
    if sys.argv[3] == "seccomp":
        print("probe:", probe())
        try:
            nvmeswap.aio_handle(engine="uring")
        except OSError as error:
            print("uring:", errno.errorcode[error.errno], error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for engine in ("auto", "auto", None):
            with nvmeswap.aio_handle(intra_op_parallelism=2, engine=engine) as h:
                data = np.frombuffer(os.urandom(3 << 20), dtype=np.uint8)
                h.sync_pwrite(data, sys.argv[2], 7)
                back = np.zeros_like(data)
                h.async_pread(back, sys.argv[2], 7)
                h.wait()
                print("moved:", h.get_engine(), np.array_equal(back, data))
    for w in caught:     # (a small ulimit -l adds a MemoryLockWarning: not this test's)
        if not issubclass(w.category, nvmeswap.MemoryLockWarning):
            print("warning:", w.category.__name__, w.message)
""")


def _auto_child(tmp_path, why, prefix=()):
    """AUTO_SCRIPT's output lines, in a child where ``why`` keeps io_uring out."""
    done = subprocess.run([*prefix, sys.executable, "-c", AUTO_SCRIPT, str(ROOT),
                           str(tmp_path / "f"), why],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "NVMESWAP_ENGINE": "auto"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_where_io_uring_is_refused_auto_falls_back_and_uring_says_why(tmp_path):
    """In a child whose seccomp filter fails io_uring_setup with ENOSYS (x86-64 and
    aarch64): probe() says so, engine="uring" raises OSError(ENOSYS) at the call, and
    engine="auto" (also from NVMESWAP_ENGINE) moves the right bytes on kernel AIO after
    one EngineFallbackWarning saying why."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the seccomp filter is written for x86-64 and aarch64")
    lines = _auto_child(tmp_path, "seccomp")
    reason = ("io_uring_setup is not available (ENOSYS: Function not implemented): the kernel "
              "was built without io_uring, or a seccomp profile (a container's) blocks it")
    assert lines[0] == f"probe: {reason}"
    assert lines[1] == (f"uring: ENOSYS [Errno 38] engine='uring': io_uring cannot be used "
                        f"here: {reason}; use engine='aio' or 'auto'")
    assert lines[2:5] == ["moved: aio True"] * 3
    assert lines[5:] == [(f"warning: EngineFallbackWarning engine='auto': io_uring cannot be "
                          f"used here ({reason}); using kernel AIO")]


def test_under_a_small_ulimit_l_auto_runs_on_kernel_aio_and_says_why(tmp_path):
    """Where io_uring works but ``ulimit -l`` is the usual 64 KiB without CAP_IPC_LOCK (the
    kernel may charge every ring to it: room for two), engine="auto" takes kernel AIO
    after one EngineFallbackWarning that names the limit; it used to take io_uring."""
    if probe():
        pytest.skip(f"io_uring: {probe()}")
    prefix = ()
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv is not installed")
        prefix = ("setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock")
    assert _auto_child(tmp_path, "memlock", prefix) == ["moved: aio True"] * 3 + [
        ("warning: EngineFallbackWarning engine='auto': ulimit -l is 64.0 KiB with no "
         "CAP_IPC_LOCK, and the kernel may charge io_uring's rings to it; using kernel AIO")]


# -- the command line ---------------------------------------------------------------------
def _nvmeswap(*args, env=None):
    return subprocess.run([sys.executable, "-m", "nvmeswap", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, **(env or {})})


def test_bench_runs_on_the_engine_asked_for_and_says_so(tmp_path):
    for engine, expected in (("uring", "uring"), ("auto", engines.auto_choice()[0]),
                             ("aio", "aio")):
        result = _nvmeswap("bench", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                           "--engine", engine, "--json", "-")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert [rank["settings"]["engine"] for rank in summary["ranks"]] == [expected]
        assert f"engine={expected}" in result.stderr      # the table's handle: line
    bad = _nvmeswap("bench", "--folder", tmp_path, env={"NVMESWAP_ENGINE": "fast"})
    assert bad.returncode == 2 and "NVMESWAP_ENGINE='fast'" in bad.stderr
    assert os.listdir(tmp_path) == []


@needs_torch
def test_tune_tries_both_engines_and_report_says_what_auto_chooses(tmp_path):
    if uring_unusable():
        pytest.skip(uring_unusable())
    out = tmp_path / "tune.json"
    result = _nvmeswap("tune", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                       "--budget-seconds", 1, "--json", out)
    assert result.returncode == 0, result.stderr
    tuned = json.loads(out.read_text())
    assert tuned["engines"] == ["aio", "uring"]
    assert {m["engine"] for m in tuned["measurements"]} == {"aio", "uring"}
    assert tuned["aio"]["engine"] in ("aio", "uring")
    with nvmeswap.aio_handle.from_config(tuned) as handle:
        assert handle.get_engine() == tuned["aio"]["engine"]
    result = _nvmeswap("tune", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                       "--budget-seconds", 1, "--engine", "uring", "--json", out)
    assert result.returncode == 0, result.stderr
    assert {m["engine"] for m in json.loads(out.read_text())["measurements"]} == {"uring"}
    report = tmp_path / "report.json"
    result = _nvmeswap("report", "--folder", tmp_path, "--json", report,
                       env={"NVMESWAP_ENGINE": "auto"})
    assert result.returncode == 0, result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    assert checks["io_uring"]["status"] == "ok"
    assert checks["engine"]["found"] == (
        "handles run on io_uring by default (NVMESWAP_ENGINE=auto); engine='auto' would "
        "choose uring (io_uring works here)")
    os.unlink(out)
    os.unlink(report)
