"""Faults from outside: a full disk, a file changed under a read, Ctrl-C, exhausted limits."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import in_flight, random_bytes, stopped_workers, system_setting, wait_until

import nvmeswap
from nvmeswap.checkpoint.own_queue import release_idle_queues

MiB = 1 << 20
PACKAGE_ROOT = os.path.dirname(os.path.dirname(nvmeswap.__file__))


def test_disk_full_is_enospc_and_leaves_no_complete_looking_file(handle_factory,
                                                                 small_filesystem):
    h = handle_factory(intra_op_parallelism=2)
    warnings.simplefilter("ignore", nvmeswap.BufferedIOWarning)   # tmpfs before Linux 6.6
    big = small_filesystem / "big"
    with pytest.raises(OSError) as info:
        h.sync_pwrite(bytearray(random_bytes(6 * MiB)), big)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(big)
    assert not big.exists() or os.path.getsize(big) == 0
    # Fill it up piece by piece: the piece that does not fit fails, the others stay intact.
    piece = random_bytes(512 << 10 | 123)
    path, written = small_filesystem / "pieces", 0
    with pytest.raises(OSError) as info:
        for _ in range(20):
            h.sync_pwrite(bytearray(piece), path, written)
            written += len(piece)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert os.path.getsize(path) == written
    assert path.read_bytes() == piece * (written // len(piece))


def test_file_deleted_during_a_read_still_reads_it(handle, tmp_path):
    data = random_bytes(16 * MiB)
    (tmp_path / "doomed").write_bytes(data)
    target = handle.new_cpu_locked_tensor(len(data), torch.empty(0, dtype=torch.uint8))
    with stopped_workers(handle):           # the read cannot end before the unlink
        handle.async_pread(target, tmp_path / "doomed")
        wait_until(lambda: in_flight(handle), "the read reaches the workers")
        os.unlink(tmp_path / "doomed")      # the open file lives on until we close it
    assert handle.wait() == 1
    assert bytes(target.numpy()) == data


def test_file_truncated_during_a_read_is_a_short_read(handle, tmp_path):
    (tmp_path / "shrinks").write_bytes(random_bytes(16 * MiB))
    target = handle.new_cpu_locked_tensor(16 * MiB, torch.empty(0, dtype=torch.uint8))
    with stopped_workers(handle):           # the read cannot end before the truncation
        handle.async_pread(target, tmp_path / "shrinks")
        wait_until(lambda: in_flight(handle), "the read reaches the workers")
        os.truncate(tmp_path / "shrinks", 4096)
    with pytest.raises(nvmeswap.ShortFileError) as info:
        handle.wait()
    assert info.value.filename == str(tmp_path / "shrinks") and "short read" in str(info.value)


CTRL_C_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    sys.path.insert(0, sys.argv[2])
    import nvmeswap, torch
    with nvmeswap.aio_handle() as h:
        t = h.new_cpu_locked_tensor(16 << 20, torch.empty(0, dtype=torch.uint8))
        workers = [w.process for w in h._scheduler.workers.pool.workers]
        for worker in workers:      # the read cannot end until they are let go on
            worker.send_signal(signal.SIGSTOP)

        def say_when_in_flight():
            while h._scheduler.workers.chunks_in_flight == 0:
                time.sleep(0.001)
            print("reading", flush=True)

        threading.Thread(target=say_when_in_flight).start()
        try:
            h.sync_pread(t, sys.argv[1])
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        else:
            print("finished with its workers stopped", flush=True)
        for worker in workers:
            worker.send_signal(signal.SIGCONT)
        data = bytearray(os.urandom(3 << 20))
        h.sync_pwrite(data, sys.argv[1] + ".after")
        back = bytearray(len(data))
        h.sync_pread(back, sys.argv[1] + ".after")
        print("usable" if back == data else "corrupt", flush=True)
""")


def test_ctrl_c_during_a_long_sync_pread(tmp_path):
    """Ctrl-C while a synchronous read is with the workers (stopped, so it cannot end by
    itself): KeyboardInterrupt, and the handle goes on working."""
    path = tmp_path / "long"
    path.write_bytes(random_bytes(16 * MiB))
    child = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, str(path), PACKAGE_ROOT],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "reading"
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
    assert out.split("\n")[:2] == ["interrupted", "usable"] and child.returncode == 0, out


@pytest.fixture
def low_aio_limit():
    """fs.aio-max-nr lowered to just above what is in use now (root only), then restored."""
    used = int(Path("/proc/sys/fs/aio-nr").read_text())
    with system_setting("/proc/sys/fs/aio-max-nr", str(used + 300),
                        "lowers a system-wide limit, which other handles would meet"):
        yield


def test_aio_max_nr_exhausted_is_a_clear_error(low_aio_limit):
    # Kernel AIO's limit: io_uring (Note [engines]) has none of the kind.
    first = nvmeswap.aio_handle(queue_depth=128, engine="aio")  # fits in the 300 events left
    try:
        with pytest.raises(OSError) as info:
            nvmeswap.aio_handle(queue_depth=128, intra_op_parallelism=2, engine="aio")
        assert info.value.errno == errno.EAGAIN
        assert "aio-max-nr" in str(info.value) and "sysctl" in str(info.value)
    finally:
        first.close()


def test_aio_max_nr_exhausted_at_a_call_without_a_handle(tmp_path, monkeypatch):
    """The checkpoint calls made without a handle use the process's own AIO context (Note
    [saves without a handle]) of 64 requests: refused, it is the same clear error, naming
    the file."""
    monkeypatch.setenv("NVMESWAP_ENGINE", "aio")
    path = tmp_path / "s.pt"
    torch.save({"w": torch.arange(1000)}, path)
    release_idle_queues()       # none kept from earlier calls (Note [kept kernel queues])
    used = int(Path("/proc/sys/fs/aio-nr").read_text())
    with system_setting("/proc/sys/fs/aio-max-nr", str(used + 32),
                        "lowers a system-wide limit, which other handles would meet"):
        for call in (lambda: nvmeswap.load(path), lambda: nvmeswap.save({"w": 1}, path)):
            with pytest.raises(OSError) as info:
                call()
            assert info.value.errno == errno.EAGAIN
            assert "aio-max-nr" in str(info.value) and str(path) in str(info.value)
    assert torch.equal(nvmeswap.load(path)["w"], torch.arange(1000))


MEMLOCK_SCRIPT = textwrap.dedent("""
    import sys, warnings
    sys.path.insert(0, sys.argv[2])
    import nvmeswap, torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nvmeswap.aio_handle() as h:
            tensors = [h.new_cpu_locked_tensor(8 << 20, torch.empty(0, dtype=torch.uint8))
                       for _ in range(2)]
            for i, t in enumerate(tensors):
                t.fill_(i + 7)
                h.sync_pwrite(t, f"{sys.argv[1]}.{i}")
                t.zero_()
                h.sync_pread(t, f"{sys.argv[1]}.{i}")
                assert int(t.min()) == int(t.max()) == i + 7
    lock_warnings = [w for w in caught if issubclass(w.category, nvmeswap.MemoryLockWarning)]
    print(len(lock_warnings), str(lock_warnings[0].message) if lock_warnings else "")
""")


def test_small_memlock_limit_warns_once_and_works(tmp_path):
    import resource
    import shutil
    command = [sys.executable, "-c", MEMLOCK_SCRIPT, str(tmp_path / "m"), PACKAGE_ROOT]
    if os.geteuid() == 0:
        # Root ignores RLIMIT_MEMLOCK through CAP_IPC_LOCK; drop it.
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv is not installed")
        command = ["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock"] + command

    def small_limit():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))

    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            preexec_fn=small_limit, check=False)
    assert result.returncode == 0, result.stderr
    count, message = result.stdout.split(" ", 1)
    assert count == "1" and "ulimit -l" in message


def test_symlink_loop_and_long_names(handle, tmp_path):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(OSError) as info:
        handle.sync_pread(bytearray(10), tmp_path / "a")
    assert info.value.errno == errno.ELOOP and info.value.filename == str(tmp_path / "a")
    long_name = str(tmp_path / ("x" * 300))
    with pytest.raises(OSError) as info:
        handle.sync_pwrite(bytearray(10), long_name)
    assert info.value.errno == errno.ENAMETOOLONG and info.value.filename == long_name


def test_huge_offsets(handle, tmp_path):
    (tmp_path / "f").write_bytes(b"q" * 100)
    with pytest.raises(nvmeswap.ShortFileError):
        handle.sync_pread(bytearray(10), tmp_path / "f", 1 << 50)
    with pytest.raises(OSError) as info:
        handle.sync_pwrite(bytearray(4 << 20), tmp_path / "f", (1 << 62))
    assert info.value.errno in (errno.EFBIG, errno.EINVAL, errno.ENOSPC)
    assert os.path.getsize(tmp_path / "f") == 100
    with pytest.raises(ValueError, match="file_offset"):
        handle.sync_pwrite(bytearray(10), tmp_path / "f", 1 << 63)
    assert (tmp_path / "f").read_bytes() == b"q" * 100


def _largest_file(path):
    """The largest size the filesystem of ``path`` lets a file have (ftruncate past it is
    EFBIG), found by bisection on a scratch file."""
    fits, too_far = 0, 1 << 63
    with open(path, "wb") as f:
        while too_far - fits > 1:
            middle = (fits + too_far) // 2
            try:
                os.truncate(f.fileno(), middle)
                fits = middle
            except OSError as error:
                assert error.errno in (errno.EFBIG, errno.EINVAL), error
                too_far = middle
    os.unlink(path)
    return fits


@pytest.mark.parametrize("engine", ["aio", "uring"])
def test_an_async_write_across_the_largest_file_says_efbig(handle_factory, tmp_path, engine):
    """Note [short writes] in pyx/_transfer_steps.pxd: the kernel cuts an aligned request
    that crosses the filesystem's largest file short; what fails is the rest, with EFBIG
    (not a guessed "no space" on a disk with room), as a synchronous write says; the file
    keeps the size it had."""
    largest = _largest_file(tmp_path / "probe")
    if largest % 4096 or largest > 1 << 62:
        pytest.skip(f"this filesystem's largest file ({largest} bytes) is not a whole "
                    "number of 4 KiB blocks below 2**62, as on ext4 and xfs")
    h = handle_factory(engine=engine, intra_op_parallelism=2)
    locked = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    path = tmp_path / "edge"
    for buffer in (torch.ones(16384, dtype=torch.uint8), locked[:16384], locked[:256 << 10]):
        for asynchronous in (False, True):
            with pytest.raises(OSError) as info:
                if asynchronous:
                    h.async_pwrite(buffer, path, largest - 8192)
                    h.wait()
                else:
                    h.sync_pwrite(buffer, path, largest - 8192)
            assert info.value.errno == errno.EFBIG and info.value.filename == str(path)
            assert "largest file" in str(info.value)
            assert os.path.getsize(path) == 0


@pytest.mark.parametrize("engine", ["aio", "uring"])
def test_a_batch_that_fails_part_way_keeps_the_requests_that_went(handle_factory, tmp_path,
                                                                   engine):
    """Note [shared growth]: each request of a batch is an operation to wait(); those that
    succeeded stay on disk when a later one fails (at the filesystem's largest file here),
    and the file is cut back to where they end, not to its size before the batch."""
    largest = _largest_file(tmp_path / "probe")
    if largest % 4096 or largest > 1 << 62:
        pytest.skip(f"this filesystem's largest file ({largest} bytes) is not a whole "
                    "number of 4 KiB blocks below 2**62, as on ext4 and xfs")
    h = handle_factory(engine=engine)
    size, count = 64 << 10, 16
    base = largest - 5 * size - (32 << 10)      # requests 0-4 fit, 5 crosses, 6-15 beyond
    path = tmp_path / "batch"
    for kind in ("locked", "plain"):
        with open(path, "wb") as f:
            f.truncate(base)
        data = (h.new_cpu_locked_tensor(count * size, torch.empty(0, dtype=torch.uint8))
                if kind == "locked" else torch.empty(count * size, dtype=torch.uint8))
        for k in range(count):
            data[k * size:(k + 1) * size] = k + 1
        h.async_pwrite_many(data, path, [base + k * size for k in range(count)],
                            lengths=[size] * count)
        with pytest.raises(OSError) as info:
            h.wait()
        assert info.value.errno == errno.EFBIG and info.value.failed_operations == 11
        assert os.path.getsize(path) == base + 5 * size, kind
        with open(path, "rb") as f:
            f.seek(base)
            assert f.read() == b"".join(bytes([k + 1]) * size for k in range(5)), kind
        os.unlink(path)


def test_writes_that_all_fail_leave_the_file_as_before(handle_factory, small_filesystem):
    """Two writes of one file in flight together, both failing on a full disk: neither
    may keep the other's growth as if it had succeeded (Note [shared growth]); the file
    is cut back to its size before, and the disk's room comes back."""
    warnings.simplefilter("ignore", nvmeswap.BufferedIOWarning)   # tmpfs before Linux 6.6
    for engine in ("aio", "uring"):
        h = handle_factory(engine=engine)
        for kind in ("locked", "plain"):
            for name in os.listdir(small_filesystem):
                os.unlink(small_filesystem / name)
            room = os.statvfs(small_filesystem)
            (small_filesystem / "filler").write_bytes(
                b"\0" * (room.f_bavail * room.f_frsize - (96 << 10)))
            size = 256 << 10
            first, second = (
                (h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8)).fill_(9)
                 if kind == "locked" else torch.full((size,), 9, dtype=torch.uint8))
                for _ in range(2))
            target = small_filesystem / "target"
            target.write_bytes(b"kept" * 1024)
            free_before = os.statvfs(small_filesystem).f_bavail
            h.async_pwrite(first, target, 4096)
            h.async_pwrite(second, target, 4096 + size)
            with pytest.raises(OSError) as info:
                h.wait()
            assert info.value.errno == errno.ENOSPC and info.value.failed_operations == 2
            assert target.read_bytes() == b"kept" * 1024, (engine, kind)
            assert os.statvfs(small_filesystem).f_bavail == free_before, (engine, kind)
            del first, second


def test_wait_from_another_thread_while_submitting(handle_factory, tmp_path):
    h = handle_factory(intra_op_parallelism=2)
    pieces = [random_bytes(4096 + i, seed=i) for i in range(300)]
    offsets = [i * 8192 for i in range(300)]
    counted, done = [], threading.Event()

    def waiter():
        while not done.is_set():
            counted.append(h.wait())
        counted.append(h.wait())

    thread = threading.Thread(target=waiter)
    thread.start()
    for piece, offset in zip(pieces, offsets):
        h.async_pwrite(bytearray(piece), tmp_path / "shared", offset)
    done.set()
    thread.join(30)
    assert not thread.is_alive() and sum(counted) == len(pieces)
    content = (tmp_path / "shared").read_bytes()
    assert all(content[o:o + len(p)] == p for p, o in zip(pieces, offsets))


@pytest.mark.parametrize("overlap_events", [False, True])
def test_engine_reports_a_failed_request(tmp_path, overlap_events):
    """A request the kernel fails (here EFAULT: the memory is not accessible, a stand-in for
    a device's EIO, which needs a device-mapper target this test cannot make) comes back as
    its errno and offset, after every other request in flight has been reaped."""
    import mmap

    from nvmeswap._memory import buffer_address
    from nvmeswap._queues import AioEngine
    path = tmp_path / "f"
    path.write_bytes(random_bytes(8 << 20))
    engine = AioEngine(1 << 20, 8, False, overlap_events)
    inaccessible = mmap.mmap(-1, 8 << 20, prot=0)     # PROT_NONE
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        address = buffer_address(inaccessible, False)[0]
        done = engine.transfer(7, 3, True, fd, -1, address, 8 << 20, 0, 4096)
    finally:
        os.close(fd)
        inaccessible.close()
    assert (done.op_id, done.chunk, done.err, done.at_offset, done.requested, done.got) == (
        7, 3, errno.EFAULT, 0, 1 << 20, 0) and done.failed


def test_an_io_error_from_the_kernel_is_oserror_eio(handle, handle_factory):
    """A real EIO at the system-call boundary without a device-mapper target: writing to
    page 0 of /proc/self/mem, which is never mapped (vm.mmap_min_addr >= 4096), fails
    with EIO in the kernel. (procfs has no AIO, so a worker's AIO loop is refused: EINVAL;
    io_uring writes it, and gets the EIO. Small async operations would otherwise run
    inline, as the synchronous one does.)"""
    from nvmeswap.io.limits import Limits
    from nvmeswap.io.roads import ALWAYS_OPEN
    warnings.simplefilter("ignore", nvmeswap.BufferedIOWarning)
    with pytest.raises(OSError) as info:
        handle.sync_pwrite(bytearray(4096), "/proc/self/mem", 0)
    assert info.value.errno == errno.EIO and info.value.filename == "/proc/self/mem"
    assert "write of 4096 bytes at offset 0" in str(info.value)
    workers_only = handle_factory(_limits=Limits(roads=ALWAYS_OPEN))
    workers_only.async_pwrite(bytearray(4096), "/proc/self/mem", 0)
    with pytest.raises(OSError) as info:
        workers_only.wait()
    expected = {"aio": errno.EINVAL, "uring": errno.EIO}[workers_only.get_engine()]
    assert info.value.errno == expected and info.value.filename == "/proc/self/mem"
