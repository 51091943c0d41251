"""A handle under abuse of its lifecycle: Ctrl-C at any moment, dropped handles, exits,
close() with failures pending, wait() from two threads, signals and forks of the app.

Anything that could hang or crash runs in a child process with a deadline.
"""
import concurrent.futures
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import in_flight, random_bytes, stopped_workers, wait_until

import nvmeswap

MiB = 1 << 20
PACKAGE_ROOT = os.path.dirname(os.path.dirname(nvmeswap.__file__))


def run_child(script, *args, timeout=120):
    """Run ``script`` in a fresh interpreter; return its stdout lines (it must exit 0)."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), PACKAGE_ROOT,
                             *map(str, args)], capture_output=True, text=True, timeout=timeout,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split("\n")


INTERRUPTS = """
    import os, random, signal, sys, threading
    sys.path.insert(0, sys.argv[1])
    import numpy as np, psutil
    import nvmeswap
    folder, rounds, seed = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)

    def interrupt_soon():
        global interrupts
        timer = threading.Timer(rng.uniform(0, 0.02), os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
        except KeyboardInterrupt:       # it fired before start() returned
            interrupts += 1
        return timer

    def settle(timer):
        # The interrupt may land late; wait for it where it can only land here.
        global interrupts
        while timer.is_alive():
            try:
                timer.join()
            except KeyboardInterrupt:
                interrupts += 1

    def until_done(call):
        global interrupts
        while True:
            try:
                return call()
            except KeyboardInterrupt:
                interrupts += 1

    interrupts = submitted = counted = started = 0
    h = nvmeswap.aio_handle(block_size=65536, queue_depth=4, intra_op_parallelism=2)
    for r in range(rounds):
        data = [np.random.default_rng(seed * 1000 + r * 10 + i).integers(
                    0, 256, rng.randint(1, 3 << 20), dtype=np.uint8) for i in range(4)]
        paths = [os.path.join(folder, f"f{r}_{i}") for i in range(4)]
        timer = interrupt_soon()
        try:
            for d, p in zip(data, paths):
                h.async_pwrite(d, p)
                submitted += 1
            counted += h.wait()
        except KeyboardInterrupt:
            interrupts += 1
        settle(timer)
        counted += until_done(h.wait)
        # A synchronous read interrupted: the next ones still work.
        back = np.zeros_like(data[0])
        timer = interrupt_soon()
        try:
            h.sync_pread(back, paths[0])
        except KeyboardInterrupt:
            interrupts += 1
        except (FileNotFoundError, nvmeswap.ShortFileError):
            pass        # its write was interrupted before it started
        settle(timer)
        if os.path.exists(paths[0]) and os.path.getsize(paths[0]):
            back = np.zeros_like(data[0])
            until_done(lambda: h.sync_pread(back, paths[0]))
            assert np.array_equal(back, data[0]), "read back other bytes"
        for d, p in zip(data, paths):
            # An async call interrupted may or may not have started its write; one that
            # started is complete and counted once, one that did not left nothing.
            if os.path.exists(p) and os.path.getsize(p):
                assert np.array_equal(np.fromfile(p, dtype=np.uint8), d), p
                started += 1
    assert counted == started and started >= submitted, (counted, started, submitted)
    # Ctrl-C during close(): closed all the same, nothing left behind.
    data = np.random.default_rng(seed).integers(0, 256, 8 << 20, dtype=np.uint8)
    path = os.path.join(folder, "at_close")
    h.async_pwrite(data, path)
    timer = interrupt_soon()
    try:
        h.close()
    except KeyboardInterrupt:
        interrupts += 1
    settle(timer)
    until_done(h.close)
    size = os.path.getsize(path)
    assert size == 0 or (size == len(data) and np.array_equal(np.fromfile(path, np.uint8), data))
    assert not psutil.Process().children(), psutil.Process().children()
    try:
        h.wait()
    except ValueError:
        pass
    else:
        raise AssertionError("a closed handle answered wait()")
    print("interrupts", interrupts, "operations", submitted)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ctrl_c_at_any_moment_loses_and_double_counts_nothing(tmp_path, seed):
    lines = run_child(INTERRUPTS, tmp_path, 12, seed)
    interrupts = int(lines[0].split()[1])
    assert interrupts >= 12     # one a round at least: each landed somewhere


DROPPED = """
    import gc, os, sys, warnings
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import nvmeswap
    folder, how = sys.argv[2], sys.argv[3]
    warnings.simplefilter("always")
    data = [np.random.default_rng(i).integers(0, 256, (4 << 20) + 4097 * i, dtype=np.uint8)
            for i in range(6)]
    h = nvmeswap.aio_handle(intra_op_parallelism=2)
    for i, d in enumerate(data):
        h.async_pwrite(d, os.path.join(folder, f"f{i}"), 4096 * i)
    if how == "dropped":
        with warnings.catch_warnings(record=True) as caught:
            del h
            gc.collect()
        assert any(issubclass(w.category, ResourceWarning) for w in caught), caught
        for i, d in enumerate(data):
            assert np.array_equal(np.fromfile(os.path.join(folder, f"f{i}"), np.uint8)[4096 * i:],
                                  d), i
        print("checked")
    # how == "exit": the interpreter exits with the writes in flight
"""


@pytest.mark.parametrize("how", ["dropped", "exit"])
def test_pending_writes_finish_when_the_handle_is_dropped_or_the_program_exits(tmp_path, how):
    lines = run_child(DROPPED, tmp_path, how)
    if how == "dropped":
        assert lines[0] == "checked"
    for i in range(6):
        expected = np.random.default_rng(i).integers(0, 256, (4 << 20) + 4097 * i, dtype=np.uint8)
        written = np.fromfile(tmp_path / f"f{i}", np.uint8)
        assert len(written) == 4096 * i + len(expected)
        assert np.array_equal(written[4096 * i:], expected)


COLLECTED_UNDER_A_LOCK = """
    import faulthandler, gc, os, sys, time, warnings
    sys.path.insert(0, sys.argv[1])
    faulthandler.dump_traceback_later(60, exit=True)       # a deadlock: the stacks
    import numpy as np, psutil
    import nvmeswap
    from nvmeswap.deepspeed import pin_handle
    from nvmeswap.io.operation import writes
    from nvmeswap.io.regions import locked_memory
    warnings.simplefilter("ignore", ResourceWarning)
    folder = sys.argv[2]
    me = psutil.Process()

    class Cycle:
        pass

    for name in ("locked set", "table", "writes"):
        lock = {"locked set": locked_memory()._lock, "table": locked_memory().table._lock,
                "writes": writes()._lock}[name]
        data = np.random.default_rng(len(name)).integers(0, 256, 8 << 20, dtype=np.uint8)
        path = os.path.join(folder, name)
        cycle = Cycle()
        cycle.me, cycle.handle, cycle.pins = cycle, nvmeswap.aio_handle(), pin_handle()
        cycle.handle.async_pwrite(data, path)
        del cycle
        with lock:
            gc.collect()        # the finalizers run here, on a thread holding the lock
        deadline = time.monotonic() + 30
        while me.children() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not me.children(), (name, me.children())
        assert np.array_equal(np.fromfile(path, np.uint8), data), name
        assert locked_memory().users == 0, name
        print(name, "released")
"""


def test_a_handle_collected_while_its_thread_holds_a_lock_is_released(tmp_path):
    """Note [releasing dropped handles]: a handle and a pin-memory handle dropped in a
    reference cycle, collected while the collecting thread holds a lock that releasing
    them takes: no deadlock; they are released (workers gone, the write whole, the
    locked set left) once the lock is free."""
    lines = run_child(COLLECTED_UNDER_A_LOCK, tmp_path)
    assert lines[:3] == ["locked set released", "table released", "writes released"]


CTRL_C_DURING_COLLECTIONS = """
    import gc, os, signal, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import nvmeswap     # its garbage collection callback comes with it

    def ctrl_c_again_and_again():
        for _ in range(50):
            time.sleep(0.003)
            os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=ctrl_c_again_and_again)
    sender.start()
    caught = 0
    while sender.is_alive():
        try:
            while sender.is_alive():
                gc.collect(0)
        except KeyboardInterrupt:
            caught += 1
    print("caught", caught > 0)
"""


def test_a_ctrl_c_during_a_collection_reaches_the_program():
    """Note [releasing dropped handles]: nvmeswap marks garbage collections with a
    callback in C, so a Ctrl-C never lands in it (a Python callback loses it, "Exception
    ignored in garbage collector", and the program runs on)."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CTRL_C_DURING_COLLECTIONS),
                             PACKAGE_ROOT], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["caught", "True"]
    assert "Exception ignored" not in result.stderr, result.stderr


def test_close_waits_and_raises_the_first_failure(handle, tmp_path):
    (tmp_path / "shrinks").write_bytes(random_bytes(16 * MiB))
    good = bytearray(random_bytes(MiB))
    target = handle.new_cpu_locked_tensor(16 * MiB, torch.empty(0, dtype=torch.uint8))
    with stopped_workers(handle):           # the read cannot end before the truncation
        handle.async_pwrite(good, tmp_path / "good")
        handle.async_pread(target, tmp_path / "shrinks")
        wait_until(lambda: in_flight(handle), "the operations reach the workers")
        os.truncate(tmp_path / "shrinks", 4096)
    with pytest.raises(nvmeswap.ShortFileError) as info:
        handle.close()
    assert info.value.filename == str(tmp_path / "shrinks")
    assert (tmp_path / "good").read_bytes() == good
    handle.close()       # closed: a second close() is quiet
    with pytest.raises(ValueError, match="closed"):
        handle.wait()


def test_wait_from_two_threads_counts_each_operation_once(handle_factory, tmp_path):
    h = handle_factory(intra_op_parallelism=2)
    counts, errors = [], []
    submitted = 0
    stop = threading.Event()

    def waiter():
        try:
            while not stop.is_set():
                counts.append(h.wait())
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in threads:
        thread.start()
    data = bytearray(random_bytes(300_000))
    for i in range(200):
        h.async_pwrite(data, tmp_path / f"f{i % 7}", (i // 7) * len(data))
        submitted += 1
    stop.set()
    for thread in threads:
        thread.join(60)
    counts.append(h.wait())
    assert not errors and sum(counts) == submitted


def test_a_storage_given_up_before_wait_is_never_written(handle_factory, tmp_path):
    h = handle_factory()
    data = random_bytes(8 * MiB)
    (tmp_path / "f").write_bytes(data)
    # set_(): the tensor lets go of its storage; the handle holds it until the read is done.
    t = torch.zeros(8 * MiB, dtype=torch.uint8)
    storage = t.untyped_storage()
    h.async_pread(t, tmp_path / "f")
    t.set_()
    del t
    assert h.wait() == 1
    assert torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes() == data
    # resize_ of the storage: the read fails clearly instead of writing into freed memory.
    t = torch.zeros(8 * MiB, dtype=torch.uint8)
    h.async_pread(t, tmp_path / "f")
    t.untyped_storage().resize_(16)
    with pytest.raises(RuntimeError, match="storage was resized or freed"):
        h.wait()
    # Plain buffers cannot be resized while the handle holds them.
    b = bytearray(8 * MiB)
    h.async_pread(b, tmp_path / "f")
    with pytest.raises(BufferError):
        b.extend(b"x")
    assert h.wait() == 1 and b == data


APP_SIGNALS = """
    import os, signal, subprocess, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np, psutil
    import nvmeswap
    folder = sys.argv[2]
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    h = nvmeswap.aio_handle(intra_op_parallelism=2)
    data = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8)
    path = os.path.join(folder, "f")
    for round in range(3):
        pid = os.fork()
        if pid == 0:        # a child that exits normally, with the handle in its memory
            os._exit(0)
        subprocess.run(["true"], check=False)           # a child that execs and exits
        sleeper = subprocess.Popen(["sleep", "10"])     # one that is terminated
        sleeper.terminate()
        h.async_pwrite(data, path)
        assert h.wait() == 1
        back = np.zeros_like(data)
        h.sync_pread(back, path)
        assert np.array_equal(back, data)
    h.close()
    assert not [p for p in psutil.Process().children() if "nvmeswap" in " ".join(p.cmdline())]
    print("ok")
"""


def test_sigchld_ignored_forks_and_execs_do_not_touch_the_handle(tmp_path):
    assert run_child(APP_SIGNALS, tmp_path)[0] == "ok"


def test_pickling_a_handle_is_refused(handle):
    with pytest.raises(TypeError, match="aio_handle"):
        pickle.dumps(handle)


def test_fifty_handles_at_once(tmp_path):
    # Made and closed from 10 threads: each waits for its worker to start or to exit.
    with concurrent.futures.ThreadPoolExecutor(10) as threads:
        handles = list(threads.map(lambda _: nvmeswap.aio_handle(), range(50)))
        try:
            for i, h in enumerate(handles):
                h.async_pwrite(bytearray(random_bytes(300_000, seed=i)), tmp_path / f"f{i}")
            assert [h.wait() for h in handles] == [1] * 50
            for i in range(50):
                assert (tmp_path / f"f{i}").read_bytes() == random_bytes(300_000, seed=i)
        finally:
            list(threads.map(lambda h: h.close(), handles))


STOPPED_WORKER = """
    import os, signal, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import numpy as np, psutil
    import nvmeswap
    path = sys.argv[2]
    data = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
    data.tofile(path)
    h = nvmeswap.aio_handle()
    worker = psutil.Process().children()[0]
    os.kill(worker.pid, signal.SIGSTOP)
    back = np.zeros_like(data)
    h.async_pread(back, path)

    def in_wait(thread=threading.main_thread()):
        frame = sys._current_frames().get(thread.ident)
        while frame is not None and (frame.f_code.co_name, frame.f_code.co_filename) != (
                "wait", h.wait.__code__.co_filename):
            frame = frame.f_back
        return frame is not None

    def interrupt_the_wait():     # the read cannot end: its worker is stopped
        while not in_wait():
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_the_wait).start()
    try:
        h.wait()
    except KeyboardInterrupt:
        print("interrupted")
    os.kill(worker.pid, signal.SIGCONT)
    print("then", h.wait(), np.array_equal(back, data))
    h.close()
"""


def test_ctrl_c_while_a_worker_is_stopped_then_continued(tmp_path):
    lines = run_child(STOPPED_WORKER, tmp_path / "f")
    assert lines[:2] == ["interrupted", "then 1 True"]


def test_out_of_space_in_a_batch_names_the_file_and_keeps_what_others_wrote(
        handle_factory, small_filesystem):
    warnings.simplefilter("ignore", nvmeswap.BufferedIOWarning)   # tmpfs before Linux 6.6
    h = handle_factory(intra_op_parallelism=2)
    pieces = {f"p{i}": bytearray(random_bytes(700_000 + i, seed=i)) for i in range(8)}
    for name, data in pieces.items():       # 5.6 MB into 4 MiB: some must fail
        h.async_pwrite(data, small_filesystem / name)
    with pytest.raises(OSError) as info:
        h.wait()
    failed = info.value.failed_operations
    assert info.value.errno == 28 and 1 <= failed < 8
    assert os.path.basename(info.value.filename) in pieces
    complete = [name for name, data in pieces.items()
                if (small_filesystem / name).read_bytes() == data]
    empty = [name for name in pieces if os.path.getsize(small_filesystem / name) == 0]
    assert len(complete) + len(empty) == 8 and len(empty) == failed
    assert os.path.basename(info.value.filename) in empty
    # Two writes of one file, one of them failing: the other's bytes stay.
    for name in pieces:
        os.unlink(small_filesystem / name)
    filler = small_filesystem / "filler"
    h.sync_pwrite(bytearray(random_bytes(3 * MiB + 500_000)), filler)
    shared = small_filesystem / "shared"
    small = bytearray(random_bytes(4096, seed=9))
    # The small write takes its space first (its road, the caller queue, runs while the
    # workers are stopped): were the large one's pieces written first, the small one
    # would find the disk full too (seen once in ~4 runs before this).
    workers = [w.process.pid for w in h._scheduler.workers.pool.workers]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        h.async_pwrite(small, shared)                                           # fits
        h.async_pwrite(bytearray(random_bytes(900_000, seed=8)), shared, 8192)   # does not
        deadline = time.monotonic() + 30
        while shared.stat().st_size < 4096 and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    with pytest.raises(OSError) as info:
        h.wait()
    assert info.value.errno == 28 and info.value.filename == str(shared)
    assert info.value.failed_operations == 1
    assert shared.read_bytes()[:4096] == small


def test_a_write_that_ends_while_a_failing_one_opens_is_never_cut_away(
        handle_factory, small_filesystem, monkeypatch):
    """Another write of the file starts and ends between a write's opening and its
    registration (Note [shared growth]); the later write fails for want of space: the
    file keeps the other write's bytes. (The race lost them once in a full run.)"""
    from nvmeswap.io import operation
    warnings.simplefilter("ignore", nvmeswap.BufferedIOWarning)
    h, other = handle_factory(), handle_factory()
    h.sync_pwrite(bytearray(random_bytes(3 * MiB + 500_000)), small_filesystem / "filler")
    shared = small_filesystem / "shared"
    small = bytearray(random_bytes(4096, seed=9))
    real_open = operation.open_target

    def open_then_another_write(target, **kwargs):
        opened = real_open(target, **kwargs)
        if kwargs["nbytes"] > 4096:
            assert other.sync_pwrite(small, shared) == 1
        return opened

    monkeypatch.setattr(operation, "open_target", open_then_another_write)
    h.async_pwrite(bytearray(random_bytes(900_000, seed=8)), shared, 8192)
    with pytest.raises(OSError) as info:
        h.wait()
    assert info.value.errno == 28 and info.value.filename == str(shared)     # ENOSPC
    assert shared.read_bytes()[:4096] == small


def test_a_reservation_that_fails_half_way_beside_another_write_is_cut_back(
        handle_factory, tmp_path, monkeypatch):
    """A write's space reservation fails half way (ext4's fallocate on a full disk moves
    the file's size over the blocks it got, then fails) while another write of the file
    is in flight: the failed write cuts the file back to where the other one ends, not
    leaving zeros past it (Note [shared growth]); the other write's bytes stay."""
    from nvmeswap.io import files

    path = tmp_path / "f"
    path.write_bytes(random_bytes(300_000, seed=3))
    real = files.preallocate

    def half_way_then_full(fd, offset, length):
        if length < 4 * MiB:
            return real(fd, offset, length)
        os.ftruncate(fd, offset + length // 3)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "preallocate", half_way_then_full)
    h = handle_factory(intra_op_parallelism=2)
    h.sync_pread(bytearray(4096), path)             # the workers are up
    first = bytearray(random_bytes(700_000, seed=4))
    with stopped_workers(h):
        h.async_pwrite(first, path, 300_000)        # in flight: ends at 1,000,000
        wait_until(lambda: in_flight(h), "the first write reaches the workers")
        h.async_pwrite(bytearray(6 * MiB), path, 1_100_000)
    with pytest.raises(OSError) as info:
        h.wait()
    assert info.value.errno == 28 and info.value.filename == str(path)
    data = path.read_bytes()
    assert len(data) == 1_000_000 and data[300_000:] == first


def test_a_failed_write_never_cuts_away_another_handles_finished_write(tmp_path):
    """Two handles write one file (DeepSpeed's swappers read and write with two); one
    write fails while the other's has completed: the completed bytes stay."""
    path = tmp_path / "shared"
    a, b = nvmeswap.aio_handle(), nvmeswap.aio_handle()
    try:
        a.async_pwrite(bytearray(random_bytes(64 * MiB)), path, MiB)
        workers = [w.process for w in a._scheduler.workers.pool.workers]
        for worker in workers:
            worker.send_signal(19)          # SIGSTOP: keep A's write in flight
        head = bytearray(random_bytes(MiB, seed=5))
        assert b.sync_pwrite(head, path, 0) == 1
        for worker in workers:
            worker.kill()
        with pytest.raises(nvmeswap.WorkerDied):
            a.wait()
        assert path.read_bytes()[:MiB] == head
    finally:
        a.close()
        b.close()


CLOSE_DURING_INLINE = """
    import sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import nvmeswap, nvmeswap.io.scheduler as scheduler
    path = sys.argv[2]
    data = bytes(range(256)) * 1000
    open(path, "wb").write(data)
    real = scheduler.transfer_in_caller
    started, go_on = threading.Event(), threading.Event()

    events = []

    def slow(*args):
        started.set()       # a device that holds the request until told
        go_on.wait()
        done = real(*args)
        events.append("read")
        return done

    scheduler.transfer_in_caller = slow
    h = nvmeswap.aio_handle()
    back = bytearray(200_000)
    reader = threading.Thread(target=h.sync_pread, args=(back, path, 5))
    reader.start()
    started.wait()
    closer = threading.Thread(target=lambda: (h.close(), events.append("closed")))
    closer.start()          # close() comes while the request is out

    def in_close(thread=closer):
        frame = sys._current_frames().get(thread.ident)
        while frame is not None and (frame.f_code.co_name, frame.f_code.co_filename) != (
                "close", h.close.__code__.co_filename):
            frame = frame.f_back
        return frame is not None

    while closer.is_alive() and not in_close():
        time.sleep(0.001)
    go_on.set()
    closer.join()
    reader.join()
    print(*events, bytes(back) == data[5:5 + len(back)])
"""


def test_close_from_another_thread_waits_for_a_small_synchronous_operation(tmp_path):
    assert run_child(CLOSE_DURING_INLINE, tmp_path / "f")[0] == "read closed True"


REFUSED_SENDS = """
    import os, resource, signal, sys
    sys.path.insert(0, sys.argv[1])
    import torch, nvmeswap
    from nvmeswap.io.limits import Limits
    from nvmeswap.io.roads import ALWAYS_OPEN
    workers_only = Limits(roads=ALWAYS_OPEN)    # every operation through the workers' sockets
    folder = sys.argv[2]
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    handles = [nvmeswap.aio_handle(_limits=workers_only) for _ in range(3)]
    t = handles[0].new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    t.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    workers = [w.process.pid for h in handles for w in h._scheduler.workers.pool.workers]
    for pid in workers:     # requests and their descriptors pile up in the sockets
        os.kill(pid, signal.SIGSTOP)
    for k, h in enumerate(handles):
        for i in range(15):     # zero-copy at an unaligned offset: two descriptors each
            h.async_pwrite(t[100:100 + 8192], os.path.join(folder, f"f{k}"), 100 + i * 16384)
    for pid in workers:
        os.kill(pid, signal.SIGCONT)
    for h in handles:
        try:
            print("waited", h.wait())
        except OSError as error:
            print("failed", error.errno, "RLIMIT_NOFILE" in str(error), error.filename)
        h.close()
"""


def test_descriptors_the_kernel_refuses_to_pass_fail_their_chunks_instead_of_hanging(tmp_path):
    """Without CAP_SYS_RESOURCE the kernel refuses (ETOOMANYREFS) to pass more descriptors
    than RLIMIT_NOFILE in flight, per user: a live worker's refusal fails that chunk."""
    script = textwrap.dedent(REFUSED_SENDS)
    command = [sys.executable, "-c", script, PACKAGE_ROOT, str(tmp_path)]
    if os.geteuid() == 0:       # root has CAP_SYS_RESOURCE (an ordinary user has none)
        if shutil.which("capsh", path=os.pathsep.join([os.environ.get("PATH", ""),
                                                       "/usr/sbin", "/sbin"])) is None:
            pytest.skip("running as root and capsh (libcap2-bin) is not installed")
        command = ["capsh", "--drop=cap_sys_resource,cap_sys_admin", "--",
                   "-c", 'exec "$0" "$@"', *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")[:3]
    for k, line in enumerate(lines):
        assert line == "waited 15" or line == (f"failed 109 True {tmp_path}/f{k}"), lines
