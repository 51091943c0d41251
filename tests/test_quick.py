"""Note [quick synchronous operations]: small aligned synchronous operations settled in one
call move the right bytes, and whatever that call declines still runs the ordinary way."""
import errno
import os
import random
import sys
import threading

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import open_descriptors, random_bytes, wait_until

import nvmeswap
from nvmeswap._transfers import quick_transfer

KiB, MiB = 1 << 10, 1 << 20


def aligned_plain(nbytes, fill=0):
    """A plain (not locked) uint8 tensor at a 4096-aligned address."""
    space = torch.full((nbytes + 4096,), fill, dtype=torch.uint8)
    skip = -space.data_ptr() % 4096
    return space[skip:skip + nbytes]


def staging_mapped(nbytes):
    """Whether this process maps a region of nvmeswap's shared memory ``nbytes`` long."""
    with open("/proc/self/maps") as maps:
        return any(int(b, 16) - int(a, 16) == nbytes
                   for a, b in (line.split()[0].split("-")
                                for line in maps if "memfd:nvmeswap" in line))


def test_quick_transfer_moves_bytes_or_declines_untouched(tmp_path):
    path = tmp_path / "f"
    data = random_bytes(64 * KiB)
    path.write_bytes(data)
    buffer = aligned_plain(16 * KiB)
    name = os.fsencode(path)
    assert quick_transfer(True, name, buffer.data_ptr(), 16 * KiB, 32 * KiB) is True
    assert bytes(buffer.numpy()) == data[32 * KiB:48 * KiB]
    buffer.fill_(7)
    assert quick_transfer(False, name, buffer.data_ptr(), 16 * KiB, 48 * KiB) is True
    assert path.read_bytes() == data[:48 * KiB] + b"\7" * 16 * KiB
    before = path.read_bytes()
    buffer.fill_(9)
    declined = [
        (True, name, 16 * KiB, 56 * KiB),                   # a read past the end
        (False, name, 16 * KiB, 56 * KiB),                  # a write that grows the file
        (True, os.fsencode(tmp_path / "missing"), 4 * KiB, 0),
        (False, os.fsencode(tmp_path / "missing"), 4 * KiB, 0),    # never created here
        (True, os.fsencode(tmp_path), 4 * KiB, 0),          # a directory
        (True, name, 4 * KiB, 100),                         # O_DIRECT refuses the offset
    ]
    for is_read, target, nbytes, offset in declined:
        assert quick_transfer(is_read, target, buffer.data_ptr(), nbytes, offset) is None
    assert path.read_bytes() == before and not (tmp_path / "missing").exists()
    assert int(buffer.min()) == int(buffer.max()) == 9


def test_quick_transfer_declines_a_fifo_without_waiting_for_a_peer(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    buffer = aligned_plain(4 * KiB)
    done = []
    thread = threading.Thread(target=lambda: done.append(
        quick_transfer(True, os.fsencode(tmp_path / "fifo"), buffer.data_ptr(), 4 * KiB, 0)),
        daemon=True)     # were it to wait for a writer, the test fails rather than hangs
    thread.start()
    thread.join(10)
    assert done == [None]


@pytest.mark.parametrize("locked", [False, True], ids=["plain", "locked"])
def test_small_aligned_sync_operations_bypass_staging(handle_factory, tmp_path, locked):
    h = handle_factory(staging_bytes=12 * MiB)     # a size no locked tensor here has
    path = tmp_path / "f"
    data = bytearray(random_bytes(4 * MiB))
    path.write_bytes(data)

    def tensor(nbytes):
        if locked:
            return h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        return aligned_plain(nbytes)

    rng = random.Random(1)
    for step in range(300):
        nbytes = rng.choice([4 * KiB, 64 * KiB, 256 * KiB])
        offset = rng.randrange(0, (len(data) - nbytes) // 4096) * 4096
        buffer = tensor(nbytes)
        if step % 2:
            h.sync_pread(buffer, path, offset)
            assert bytes(buffer.numpy()) == data[offset:offset + nbytes]
        else:
            fresh = random_bytes(nbytes, seed=step)
            buffer.copy_(torch.frombuffer(bytearray(fresh), dtype=torch.uint8))
            h.sync_pwrite(buffer, path, offset)
            data[offset:offset + nbytes] = fresh
    assert path.read_bytes() == bytes(data)
    # No byte went through the staging space: it was never even made.
    assert not staging_mapped(12 * MiB)
    unaligned = torch.empty(4 * KiB + 1, dtype=torch.uint8)
    h.sync_pread(unaligned, path, 4096)
    assert bytes(unaligned.numpy()) == data[4096:8193] and staging_mapped(12 * MiB)


def test_what_the_quick_road_declines_runs_the_ordinary_way(handle, tmp_path):
    buffer = aligned_plain(8 * KiB, fill=5)
    handle.sync_pwrite(buffer, tmp_path / "new")                    # created
    handle.sync_pwrite(buffer, tmp_path / "new", 8 * KiB)           # grown
    assert (tmp_path / "new").read_bytes() == b"\5" * 16 * KiB
    with pytest.raises(nvmeswap.ShortFileError, match="16384 bytes long") as info:
        handle.sync_pread(buffer, tmp_path / "new", 12 * KiB)
    assert info.value.filename == str(tmp_path / "new")
    with pytest.raises(OSError) as info:
        handle.sync_pread(buffer, tmp_path)
    assert info.value.errno == errno.EISDIR and info.value.filename == str(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="a FIFO"):
        handle.sync_pread(buffer, str(tmp_path / "fifo"))
    with pytest.raises(ValueError, match="null"):
        handle.sync_pread(buffer, str(tmp_path / "new") + "\0tail")
    with pytest.raises(FileNotFoundError):
        handle.sync_pread(buffer, str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()


def test_a_sync_read_follows_a_small_async_write_of_the_same_bytes(handle_factory, tmp_path):
    h = handle_factory()
    path = tmp_path / "f"
    path.write_bytes(b"\0" * MiB)
    for round_number in range(50):
        written = aligned_plain(4 * KiB, fill=round_number + 1)
        h.async_pwrite(written, path, 64 * KiB)     # in flight: no quick road for the read
        back = aligned_plain(4 * KiB)
        h.sync_pread(back, path, 64 * KiB)
        assert int(back.min()) == int(back.max()) == round_number + 1
        assert h.wait() == 1


@pytest.mark.parametrize("slowed", ["quick write", "inline write", "quick read"])
def test_an_operation_in_its_callers_thread_is_ordered_with_those_started_meanwhile(
        handle_factory, tmp_path, monkeypatch, slowed):
    """Note [ordering] for operations that run in their caller's thread (quick and inline
    ones): while one runs (slowed here, after it was routed), another thread's operation of
    the same bytes started meanwhile runs after it: a read sees the write's bytes, a write
    does not change what the read returns."""
    from nvmeswap.io import scheduler

    h = handle_factory()
    path = tmp_path / "f"
    old, new = 1, 2
    path.write_bytes(bytes([old]) * 64 * KiB)
    nbytes = 4 * KiB if slowed != "inline write" else 4 * KiB - 512     # inline: not aligned
    slowed_is_read = slowed == "quick read"
    name = "transfer_in_caller" if slowed == "inline write" else "quick_transfer"
    real, started = getattr(scheduler, name), threading.Event()

    def slow(*args):
        is_read = args[2] if name == "transfer_in_caller" else args[3]
        if bool(is_read) == slowed_is_read and not started.is_set():
            started.set()
            threading.Event().wait(0.3)     # the other operation starts meanwhile
        return real(*args)

    monkeypatch.setattr(scheduler, name, slow)
    written = aligned_plain(nbytes, fill=new)
    back = aligned_plain(nbytes)
    first = (lambda: h.sync_pread(back, path, 0)) if slowed_is_read \
        else (lambda: h.sync_pwrite(written, path, 0))
    results = []
    thread = threading.Thread(target=lambda: results.append(first()))
    thread.start()
    wait_until(started.is_set, "the slowed operation started")
    if slowed_is_read:
        assert h.sync_pwrite(written, path, 0) == 1
    else:
        assert h.sync_pread(back, path, 0) == 1
    thread.join()
    assert results == [1]
    expected = old if slowed_is_read else new
    assert int(back.min()) == int(back.max()) == expected
    assert path.read_bytes()[:nbytes] == bytes([new]) * nbytes


def test_a_quick_write_survives_a_failed_write_that_grew_the_file(handle_factory, tmp_path):
    """Note [shared growth]: the quick write lands inside what another handle's write
    preallocated; when that write fails, the file is not cut back under it."""
    path = tmp_path / "f"
    path.write_bytes(b"\1" * 64 * KiB)
    growing, quick_one = handle_factory(staging_bytes=MiB), handle_factory()
    big = torch.full((64 * MiB,), 3, dtype=torch.uint8)
    growing.async_pwrite(big, path, MiB)        # preallocated at once: 65 MiB
    assert quick_one.sync_pwrite(aligned_plain(4 * KiB, fill=7), path, 128 * KiB) == 1
    big.untyped_storage().resize_(0)            # the next staged copy of it fails
    with pytest.raises(RuntimeError, match="resized or freed"):
        growing.wait()
    with open(path, "rb") as f:
        f.seek(128 * KiB)
        assert f.read(4 * KiB) == b"\7" * 4 * KiB


def test_close_from_another_thread_waits_for_a_quick_operation(handle_factory, tmp_path,
                                                               monkeypatch):
    """close() from another thread while a quick write is with a slow device (one that
    holds it until told): close() returns after the write, and the bytes are written."""
    import nvmeswap.io.scheduler as scheduler_module
    started, go_on, events = threading.Event(), threading.Event(), []
    real = scheduler_module.quick_transfer

    def slow_device(*args):
        started.set()
        go_on.wait()
        done = real(*args)
        events.append("written")
        return done

    monkeypatch.setattr(scheduler_module, "quick_transfer", slow_device)
    h = handle_factory()
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 8 * KiB)
    results = []
    writer = threading.Thread(target=lambda: results.append(
        h.sync_pwrite(aligned_plain(4 * KiB, fill=9), path, 0)))
    writer.start()
    wait_until(started.is_set, "the write reaches the device")
    closer = threading.Thread(target=lambda: (h.close(), events.append("closed")))
    closer.start()
    wait_until(lambda: _inside(closer, h.close) or not closer.is_alive(), "close() starts")
    go_on.set()
    closer.join(60)
    writer.join(60)
    assert events == ["written", "closed"] and results == [1]
    assert path.read_bytes() == b"\x09" * 4 * KiB + b"\0" * 4 * KiB
    with pytest.raises(ValueError, match="closed"):
        h.sync_pread(aligned_plain(4 * KiB), path, 0)


def _inside(thread, method):
    """Whether ``thread`` is running ``method`` now (somewhere on its stack)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None and frame.f_code is not method.__code__:
        frame = frame.f_back
    return frame is not None


def test_unusual_names_and_offsets_behave_as_on_the_ordinary_road(handle, tmp_path):
    import numpy as np

    path = tmp_path / "f"
    data = random_bytes(16 * KiB)
    path.write_bytes(data)
    back = aligned_plain(4 * KiB)
    assert handle.sync_pread(back, np.bytes_(os.fsencode(path)), 4 * KiB) == 1
    assert bytes(back.numpy()) == data[4 * KiB:8 * KiB]
    for offset in (1 << 63, 1 << 64, (1 << 63) - 4096):
        with pytest.raises(ValueError, match="file_offset must be between"):
            handle.sync_pread(back, path, offset)


def test_small_async_reads_into_locked_memory_take_the_quick_road(handle_factory, tmp_path,
                                                                  monkeypatch):
    """Note [quick asynchronous reads]: 4/64/256 KiB async reads at random aligned offsets
    into locked memory never take the ordinary road, many are in flight at once, and each
    gets its own bytes; plain buffers and unaligned offsets still go the ordinary way."""
    import numpy as np

    from nvmeswap.io.scheduler import Scheduler

    h = handle_factory()
    path = tmp_path / "f"
    data = random_bytes(16 * MiB, seed=21)
    path.write_bytes(data)
    assert h.sync_pread(torch.empty(MiB, dtype=torch.uint8), path) == 1     # queue made
    ordinary = []
    begin = Scheduler._begin
    monkeypatch.setattr(Scheduler, "_begin",
                        lambda self, *args, **kwargs: ordinary.append(args[2]) or
                        begin(self, *args, **kwargs))
    rng = np.random.default_rng(4)
    locked = h.new_cpu_locked_tensor(64 * 256 * KiB, torch.empty(0, dtype=torch.uint8))
    queue, most = h._scheduler.workers.queue, 0
    for batch in range(5):
        expected = []
        for k in range(64):
            size = int(rng.choice([4 * KiB, 64 * KiB, 256 * KiB]))
            offset = int(rng.integers(0, (16 * MiB - size) // (4 * KiB))) * 4 * KiB
            view = locked[k * 256 * KiB:k * 256 * KiB + size]
            assert h.async_pread(view, str(path), offset) == 0
            most = max(most, queue.in_flight)
            expected.append((view, data[offset:offset + size]))
        assert h.wait() == 64
        assert all(bytes(view.numpy()) == want for view, want in expected)
    assert ordinary == [] and most > 1
    plain = aligned_plain(4 * KiB)
    h.async_pread(plain, str(path), 8 * KiB)
    h.async_pread(locked[:4 * KiB], str(path), 512)
    assert h.wait() == 2 and ordinary == [8 * KiB, 512]
    assert bytes(plain.numpy()) == data[8 * KiB:12 * KiB]
    assert bytes(locked[:4 * KiB].numpy()) == data[512:512 + 4 * KiB]
    assert h.free_cpu_locked_tensor(locked)


def test_what_the_quick_async_road_declines_names_its_cause(handle, tmp_path):
    """Async reads the quick road cannot take raise the ordinary road's errors when they
    are started (a FIFO without waiting), and a read after a small async write of the same
    bytes waits for it."""
    path = tmp_path / "f"
    path.write_bytes(random_bytes(16 * KiB))
    locked = handle.new_cpu_locked_tensor(8 * KiB, torch.empty(0, dtype=torch.uint8))
    handle.sync_pread(locked, path)     # the caller queue is made
    with pytest.raises(FileNotFoundError) as info:
        handle.async_pread(locked, str(tmp_path / "missing"))
    assert info.value.filename == str(tmp_path / "missing")
    with pytest.raises(nvmeswap.ShortFileError, match="16384 bytes long"):
        handle.async_pread(locked, str(path), 12 * KiB)
    with pytest.raises(OSError) as info:
        handle.async_pread(locked, str(tmp_path))
    assert info.value.errno == errno.EISDIR
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="a FIFO"):
        handle.async_pread(locked, str(tmp_path / "fifo"))
    assert handle.wait() == 0
    for round_number in range(20):
        locked[:4 * KiB].fill_(round_number)
        handle.async_pwrite(locked[:4 * KiB], str(path), 4 * KiB)
        handle.async_pread(locked[4 * KiB:], str(path), 4 * KiB)
        assert handle.wait() == 2
        assert set(locked[4 * KiB:].tolist()) == {round_number}
    assert handle.free_cpu_locked_tensor(locked)


def test_quick_reads_in_flight_share_a_descriptor_of_the_file_the_path_names(handle_factory,
                                                                           tmp_path):
    """Note [shared read descriptors]: quick reads of one path in flight hold one
    descriptor, closed by the last to end; a name replaced, renamed away or truncated
    between two reads is looked up again, so each read gets the bytes its path named
    when it was started (or the error the ordinary road gives)."""
    h = handle_factory()
    path, other = tmp_path / "f", tmp_path / "g"
    old, new = random_bytes(MiB, seed=5), random_bytes(MiB, seed=6)
    path.write_bytes(old)
    other.write_bytes(new)
    locked = h.new_cpu_locked_tensor(64 * 4 * KiB, torch.empty(0, dtype=torch.uint8))
    h.sync_pread(locked[:4 * KiB], str(path))        # the caller queue is made
    views = [locked[k * 4 * KiB:(k + 1) * 4 * KiB] for k in range(64)]

    def descriptors_of(name):
        # A replaced or removed file's link reads "<name> (deleted)": counted too.
        return sum(link in (str(name), f"{name} (deleted)")
                   for link in open_descriptors().values())

    for k in range(32):
        h.async_pread(views[k], str(path), k * 4 * KiB)
    assert descriptors_of(path) == 1
    os.replace(other, path)     # the name now names the new file: the reads after, read it
    for k in range(32, 64):
        h.async_pread(views[k], str(path), k * 4 * KiB)
    assert descriptors_of(path) == 2        # the replaced file's, and the new one's
    assert h.wait() == 64
    assert descriptors_of(path) == 0
    for k, view in enumerate(views):
        want = (old if k < 32 else new)[k * 4 * KiB:(k + 1) * 4 * KiB]
        assert bytes(view.numpy()) == want, k
    h.async_pread(views[0], str(path), 0)
    os.truncate(path, 8 * KiB)
    with pytest.raises(nvmeswap.ShortFileError, match="8192 bytes long"):
        h.async_pread(views[1], str(path), 8 * KiB)
    os.rename(path, tmp_path / "moved")
    with pytest.raises(FileNotFoundError):
        h.async_pread(views[2], str(path), 0)
    assert h.wait() == 1 and bytes(views[0].numpy()) == new[:4 * KiB]
    assert h.free_cpu_locked_tensor(locked)


def _runs(h):
    """The quick read runs in flight (Note [quick read runs])."""
    from nvmeswap.io.quick import QuickReadRun

    return [op for op in h._scheduler.books.ops.values() if isinstance(op, QuickReadRun)]


def _file_and_views(h, tmp_path, nbytes, count, seed):
    """A file of ``nbytes`` random bytes, and ``count`` locked 4 KiB views to read it
    into (the caller queue made): (path, data, locked, views)."""
    path = tmp_path / "f"
    data = random_bytes(nbytes, seed=seed)
    path.write_bytes(data)
    locked = h.new_cpu_locked_tensor(count * 4 * KiB, torch.empty(0, dtype=torch.uint8))
    h.sync_pread(locked[:4 * KiB], str(path))
    return path, data, locked, [locked[k * 4 * KiB:(k + 1) * 4 * KiB] for k in range(count)]


def test_a_threads_quick_reads_of_one_file_are_one_operation(handle_factory, tmp_path):
    """Note [quick read runs]: a thread's quick reads of one file join one operation in
    the books until its wait(), which counts each read; another thread's reads are
    another run, counted by that thread; every read gets its own bytes."""
    import numpy as np

    h = handle_factory()
    path, data, locked, views = _file_and_views(h, tmp_path, 4 * MiB, 128, seed=8)
    rng = np.random.default_rng(2)

    def read(first, count):
        offsets = [int(o) * 4 * KiB for o in rng.integers(0, MiB // KiB, count)]
        for k, offset in enumerate(offsets):
            assert h.async_pread(views[first + k], str(path), offset) == 0
        return offsets

    offsets = read(0, 64)
    runs = _runs(h)
    assert len(runs) == 1 and runs[0].count == 64 and len(h._scheduler.books.ops) == 1
    other = {}

    def other_thread():
        other["offsets"] = read(64, 64)
        other["runs"] = len(_runs(h))
        other["waited"] = h.wait()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert other["runs"] == 2 and other["waited"] == 64
    assert h.wait() == 64 and not h._scheduler.books.ops
    assert not h._scheduler.books.open_runs
    for k, offset in enumerate(offsets + other["offsets"]):
        assert bytes(views[k].numpy()) == data[offset:offset + 4 * KiB], k
    read(0, 8)                              # after wait(): a new run
    assert len(_runs(h)) == 1 and _runs(h)[0].count == 8
    assert h.wait() == 8
    assert h.free_cpu_locked_tensor(locked)


def test_a_write_after_a_run_follows_all_of_its_reads(handle_factory, tmp_path):
    """Note [ordering] with runs: a write of bytes a run reads waits for the run, so the
    run's reads return the old bytes; reads started after the write return the new ones,
    and do not join the run."""
    h = handle_factory()
    path, old, locked, views = _file_and_views(h, tmp_path, MiB, 20, seed=9)
    for k in range(16):
        h.async_pread(views[k], str(path), k * 4 * KiB)
    (run,) = _runs(h)
    new = random_bytes(8 * KiB, seed=10)
    views[16].copy_(torch.frombuffer(bytearray(new[:4 * KiB]), dtype=torch.uint8))
    views[17].copy_(torch.frombuffer(bytearray(new[4 * KiB:]), dtype=torch.uint8))
    h.async_pwrite(locked[16 * 4 * KiB:18 * 4 * KiB], str(path), 4 * KiB)
    assert any(op.waits_for == {run} for op in h._scheduler.books.held)
    h.async_pread(views[18], str(path), 4 * KiB)      # after the write: its bytes
    h.async_pread(views[19], str(path), 32 * KiB)     # not the write's: still not the run
    assert run.count == 16
    assert h.wait() == 19
    for k in range(16):
        assert bytes(views[k].numpy()) == old[k * 4 * KiB:(k + 1) * 4 * KiB], k
    assert bytes(views[18].numpy()) == new[:4 * KiB]
    assert bytes(views[19].numpy()) == old[32 * KiB:36 * KiB]
    assert path.read_bytes() == old[:4 * KiB] + new + old[12 * KiB:]
    assert h.free_cpu_locked_tensor(locked)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_ctrl_c_among_quick_reads_leaves_every_started_read_counted(handle_factory,
                                                                    tmp_path):
    """Note [pumping claims]: Ctrl-C at any point of starting reads (SIGINT every ~30 us,
    longer where a call takes longer here: the period doubles after a round in which no
    read returned, halves after one without an interruption) loses no read the books
    hold: wait() ends, counting each read that returned and at most each interrupted
    one, and each returned read has its bytes."""
    import signal

    h = handle_factory()
    path, data, locked, views = _file_and_views(h, tmp_path, MiB, 256, seed=11)
    started = interrupted = 0
    period = 0.00003
    rng = random.Random(3)
    armed = [False]

    def ctrl_c(signum, frame):
        # Raised inside async_pread only (once per call), so the test's own code is
        # never interrupted.
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, ctrl_c)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        for _ in range(40):
            returned = []
            interrupted_before = interrupted
            signal.setitimer(signal.ITIMER_REAL, period, period)
            for k in range(256):
                offset = rng.randrange(0, 256) * 4 * KiB
                try:
                    armed[0] = True
                    h.async_pread(views[k], str(path), offset)
                    armed[0] = False
                    returned.append((k, offset))
                except KeyboardInterrupt:
                    interrupted += 1
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            waited = h.wait()
            started += len(returned)
            assert len(returned) <= waited <= len(returned) + interrupted
            for k, offset in returned:
                assert bytes(views[k].numpy()) == data[offset:offset + 4 * KiB], k
            assert not h._scheduler.books.ops
            if not returned:
                period *= 2
            elif interrupted == interrupted_before:
                period /= 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, previous)
    assert interrupted > 0 and started > 0
    assert h.free_cpu_locked_tensor(locked)


def test_a_failed_read_of_a_run_names_its_file_and_offset(handle_factory, tmp_path,
                                                          monkeypatch):
    """Note [quick read runs]: the file shrinks between a read's check and its post: that
    read comes back short and wait() raises for it, naming the file and its offset,
    counting one failure; the run's other reads bring their bytes."""
    from nvmeswap.io import scheduler as scheduler_module

    h = handle_factory()
    path, data, locked, views = _file_and_views(h, tmp_path, 8 * MiB, 4, seed=12)
    checked = scheduler_module.names_the_runs_file
    shrunk = []

    def shrink_once(run, name, end):
        names = checked(run, name, end)
        if names and not shrunk:
            os.truncate(path, 4 * MiB)
            shrunk.append(end)
        return names

    monkeypatch.setattr(scheduler_module, "names_the_runs_file", shrink_once)
    offsets = [0, 5 * MiB, 4 * KiB, 8 * KiB]
    for view, offset in zip(views, offsets):
        h.async_pread(view, str(path), offset)
    assert len(_runs(h)) == 1 and _runs(h)[0].count == 4
    with pytest.raises(nvmeswap.ShortFileError) as info:
        h.wait()
    assert info.value.filename == str(path)
    assert "at offset 5242880" in str(info.value)
    assert info.value.failed_operations == 1
    for k in (0, 2, 3):
        assert bytes(views[k].numpy()) == data[offsets[k]:offsets[k] + 4 * KiB], k
    assert not h._scheduler.books.ops
    assert h.free_cpu_locked_tensor(locked)


def test_the_claim_to_read_responses_is_given_back_where_no_ctrl_c_can_land(
        handle_factory, tmp_path, monkeypatch):
    """Note [pumping claims]: a wait() gives its claim back inside the section that
    completes what it read; the give-back outside a section (here raising, as a Ctrl-C
    landing at its call would) runs only after an interrupted poll. So another thread's
    wait() afterwards is never left waiting for a reader that is gone."""
    from nvmeswap.io.books import Books

    h = handle_factory()
    path, data, locked, views = _file_and_views(h, tmp_path, MiB, 8, seed=13)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Books, "_release_pumping", interrupted)
    for k, view in enumerate(views):
        h.async_pread(view, str(path), k * 4 * KiB)
    assert h.wait() == 8
    assert h._scheduler.books.pumping_thread is None
    h.async_pread(views[0], str(path), 64 * KiB)
    other = {}
    thread = threading.Thread(target=lambda: other.setdefault("waited", h.wait()))
    thread.start()
    thread.join(30)
    assert other == {"waited": 1}
    assert bytes(views[0].numpy()) == data[64 * KiB:68 * KiB]
    assert h.free_cpu_locked_tensor(locked)
