"""Note [batches]: many requests of one file in one call, and futures for single ones."""
import errno
import gc
import os
import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes

import nvmeswap
from nvmeswap.io import scheduler as scheduler_module
from nvmeswap.io.batch import SLICE
from nvmeswap.io.limits import Limits
from nvmeswap.io.roads import ALWAYS_OPEN, Road, route

KiB, MiB = 1 << 10, 1 << 20
EXAMPLE = torch.empty(0, dtype=torch.uint8)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "source"
    data = random_bytes(8 * MiB, seed=5)
    path.write_bytes(data)
    return str(path), data


@pytest.fixture
def roads_taken(monkeypatch):
    taken = []

    def spy(facts, roads):
        taken.append(route(facts, roads))
        return taken[-1]

    monkeypatch.setattr(scheduler_module, "route", spy)
    return taken


def _offsets(count, size, file_size, seed, step=4 * KiB):
    rng = np.random.default_rng(seed)
    return [int(x) * step for x in rng.integers(0, (file_size - size) // step, count)]


def test_a_batch_into_locked_memory_is_read_whole_and_counted_per_request(
        handle, source, roads_taken):
    path, data = source
    count = 3 * SLICE + 5       # several slices, the last one short
    offsets = _offsets(count, 4 * KiB, len(data), seed=1)
    locked = handle.new_cpu_locked_tensor(count * 4 * KiB, EXAMPLE)
    assert handle.async_pread_many(locked, path, offsets, lengths=[4 * KiB] * count) == 0
    assert handle.wait() == count
    got = locked.numpy()
    for k, offset in enumerate(offsets):
        assert got[k * 4 * KiB:(k + 1) * 4 * KiB].tobytes() == data[offset:offset + 4 * KiB]
    assert roads_taken.count(Road.BATCH) == 4 and Road.EACH not in roads_taken
    assert handle.free_cpu_locked_tensor(locked)


@pytest.mark.parametrize("kind", ["views", "plain", "unaligned", "large", "mixed"])
def test_every_kind_of_batch_reads_the_right_bytes(handle, source, kind):
    """Locked views go whole; plain memory, unaligned offsets, large requests and a mix
    of them take each request's own road; all give the file's bytes."""
    path, data = source
    locked = handle.new_cpu_locked_tensor(2 * MiB, EXAMPLE)
    sizes = {"views": [4 * KiB, 64 * KiB, 256 * KiB] * 3, "plain": [4 * KiB, 5000, 1] * 3,
             "unaligned": [4 * KiB] * 9, "large": [MiB, 4 * KiB, 512 * KiB],
             "mixed": [4 * KiB, 3, 64 * KiB, 777, MiB]}[kind]
    buffers, start = [], 0
    for k, size in enumerate(sizes):
        if kind == "plain" or (kind == "mixed" and k % 2):
            buffers.append(torch.zeros(size, dtype=torch.uint8))
        else:
            buffers.append(locked[start:start + size])
            start += size
    step = 1 if kind == "unaligned" else 4 * KiB
    offsets = [o + (7 if kind == "unaligned" else 0)
               for o in _offsets(len(sizes), MiB, len(data), seed=2, step=step)]
    handle.async_pread_many(buffers, path, offsets)
    assert handle.wait() == len(sizes)
    for buffer, offset in zip(buffers, offsets):
        assert bytes(buffer.numpy()) == data[offset:offset + buffer.numel()]
    del buffers
    assert handle.free_cpu_locked_tensor(locked)


@pytest.mark.parametrize("locked", [True, False])
def test_a_batch_of_writes_lands_where_asked(handle, tmp_path, locked):
    path = str(tmp_path / "new")        # created by the batch
    count = SLICE + 10
    offsets = [k * 12 * KiB for k in range(count)]
    np.random.default_rng(3).shuffle(offsets)
    data = random_bytes(count * 4 * KiB, seed=6)
    if locked:
        buffer = handle.new_cpu_locked_tensor(len(data), EXAMPLE)
    else:
        buffer = torch.empty(len(data), dtype=torch.uint8)
    buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    handle.async_pwrite_many(buffer, path, offsets, lengths=[4 * KiB] * count)
    assert handle.wait() == count
    with open(path, "rb") as f:
        written = f.read()
    assert len(written) == max(offsets) + 4 * KiB
    for k, offset in enumerate(offsets):
        assert written[offset:offset + 4 * KiB] == data[k * 4 * KiB:(k + 1) * 4 * KiB]


def test_bad_batches_are_refused_before_any_io(handle, source, tmp_path):
    path, data = source
    locked = handle.new_cpu_locked_tensor(64 * KiB, EXAMPLE)
    views = [locked[:4 * KiB], locked[4 * KiB:8 * KiB]]
    with pytest.raises(ValueError, match="2 buffers but 3 offsets"):
        handle.async_pread_many(views, path, [0, 4096, 8192])
    with pytest.raises(ValueError, match="offsets\\[1\\] must be between"):
        handle.async_pread_many(views, path, [0, -4096])
    with pytest.raises(TypeError, match="offsets must be a sequence"):
        handle.async_pread_many(views, path, 0)
    with pytest.raises(ValueError, match="is empty"):
        handle.async_pread_many([], path, [])
    with pytest.raises(ValueError, match="more than the buffer's"):
        handle.async_pread_many(locked, path, [0, 4096], lengths=[32 * KiB, 33 * KiB])
    with pytest.raises(TypeError, match="read-only"):
        handle.async_pread_many([bytes(4096)], path, [0])
    with pytest.raises(nvmeswap.ShortFileError, match=f"the file is {len(data)} bytes long"):
        handle.async_pread_many(views, path, [0, len(data) - 4096 + 512])
    with pytest.raises(FileNotFoundError) as info:
        handle.async_pread_many(views, str(tmp_path / "missing"), [0, 4096])
    assert info.value.filename == str(tmp_path / "missing")
    with pytest.raises(ValueError, match="requests 0 and 2 of the batch write overlapping "
                                         "bytes \\(from offset 8192\\)"):
        handle.async_pwrite_many(locked, str(tmp_path / "missing"), [4096, 0, 8192],
                                 lengths=[8 * KiB, 4 * KiB, 4 * KiB])
    handle.async_pread_many(views, path, [0, 0])     # reads may overlap
    assert handle.wait() == 2
    assert bytes(views[0].numpy()) == bytes(views[1].numpy()) == data[:4 * KiB]
    locked.zero_()
    assert bytes(locked.numpy()) == bytes(64 * KiB)
    assert not os.path.exists(tmp_path / "missing")


def test_a_partly_failed_batch_names_the_file_and_offset(handle, source, monkeypatch):
    """The file shrinks after the batch is checked: the requests past its new end come
    back short, each counted; the others bring their bytes."""
    path, data = source
    start_batch = scheduler_module.Scheduler._start_batch

    def shrink_first(self, op, target):
        os.truncate(path, 4 * MiB)
        return start_batch(self, op, target)

    monkeypatch.setattr(scheduler_module.Scheduler, "_start_batch", shrink_first)
    offsets = [0, 5 * MiB, 4 * KiB, 6 * MiB, 8 * KiB]
    locked = handle.new_cpu_locked_tensor(len(offsets) * 4 * KiB, EXAMPLE)
    handle.async_pread_many(locked, path, offsets, lengths=[4 * KiB] * len(offsets))
    with pytest.raises(nvmeswap.ShortFileError) as info:
        handle.wait()
    assert info.value.filename == path
    assert "at offset 5242880" in str(info.value) or "at offset 6291456" in str(info.value)
    assert info.value.failed_operations == 2
    got = locked.numpy()
    for k in (0, 2, 4):
        assert got[k * 4 * KiB:(k + 1) * 4 * KiB].tobytes() == \
            data[offsets[k]:offsets[k] + 4 * KiB]
    assert handle.free_cpu_locked_tensor(locked)


def test_batches_forced_request_by_request_still_move_the_right_bytes(
        handle_factory, source, roads_taken):
    path, data = source
    h = handle_factory(_limits=Limits(roads=ALWAYS_OPEN))
    offsets = _offsets(20, 4 * KiB, len(data), seed=7)
    locked = h.new_cpu_locked_tensor(20 * 4 * KiB, EXAMPLE)
    h.async_pread_many(locked, path, offsets, lengths=[4 * KiB] * 20)
    assert h.wait() == 20
    for k, offset in enumerate(offsets):
        assert locked.numpy()[k * 4 * KiB:(k + 1) * 4 * KiB].tobytes() == \
            data[offset:offset + 4 * KiB]
    assert Road.BATCH not in roads_taken and Road.EACH in roads_taken
    assert h.free_cpu_locked_tensor(locked)


def test_wait_from_several_threads_counts_every_request_once(handle, source):
    path, data = source
    locked = handle.new_cpu_locked_tensor(4 * 200 * 4 * KiB, EXAMPLE)
    counts, errors = [], []

    def reader(part):
        try:
            for round_number in range(5):
                view = locked[part * 200 * 4 * KiB:(part + 1) * 200 * 4 * KiB]
                offsets = _offsets(200, 4 * KiB, len(data), seed=part * 10 + round_number)
                handle.async_pread_many(view, path, offsets, lengths=[4 * KiB] * 200)
                counts.append(handle.wait())
                for k, offset in enumerate(offsets):
                    assert view.numpy()[k * 4 * KiB:(k + 1) * 4 * KiB].tobytes() == \
                        data[offset:offset + 4 * KiB]
        except BaseException as error:      # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=reader, args=(part,)) for part in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    # Each wait() returns what it took; a request is counted by exactly one of them.
    assert sum(counts) + handle.wait() == 4 * 5 * 200
    assert handle.free_cpu_locked_tensor(locked)


def test_close_with_batches_in_flight_finishes_them(handle_factory, source, tmp_path):
    path, data = source
    h = handle_factory()
    locked = h.new_cpu_locked_tensor(500 * 4 * KiB, EXAMPLE)
    offsets = _offsets(500, 4 * KiB, len(data), seed=8)
    h.async_pread_many(locked, path, offsets, lengths=[4 * KiB] * 500)
    h.async_pwrite_many(locked, str(tmp_path / "copy"), [k * 4 * KiB for k in range(10)],
                        lengths=[4 * KiB] * 10)
    h.close()
    for k, offset in enumerate(offsets):
        assert locked.numpy()[k * 4 * KiB:(k + 1) * 4 * KiB].tobytes() == \
            data[offset:offset + 4 * KiB]
    assert os.path.getsize(tmp_path / "copy") == 40 * KiB
    with pytest.raises(ValueError, match="closed"):
        h.async_pread_many(locked, path, [0], lengths=[4096])


def test_futures_complete_on_their_own(handle, source, tmp_path):
    path, data = source
    locked = handle.new_cpu_locked_tensor(64 * 4 * KiB, EXAMPLE)
    futures = [handle.submit_pread(locked[k * 4 * KiB:(k + 1) * 4 * KiB], path, k * 8 * KiB)
               for k in range(64)]
    plain = torch.zeros(5000, dtype=torch.uint8)
    futures.append(handle.submit_pread(plain, path, 3))
    while not all(future.done() for future in futures):   # never blocks
        pass
    assert [future.result() for future in futures] == [4 * KiB] * 64 + [5000]
    assert handle.wait() == 0       # futures are not wait()'s
    for k in range(64):
        assert locked.numpy()[k * 4 * KiB:(k + 1) * 4 * KiB].tobytes() == \
            data[k * 8 * KiB:k * 8 * KiB + 4 * KiB]
    assert bytes(plain.numpy()) == data[3:5003]
    written = handle.submit_pwrite(locked[:8 * KiB], str(tmp_path / "w"), 4 * KiB)
    assert written.result() == 8 * KiB
    with open(tmp_path / "w", "rb") as f:
        assert f.read() == bytes(4 * KiB) + data[:4 * KiB] + data[8 * KiB:12 * KiB]
    assert handle.free_cpu_locked_tensor(locked)


def test_a_failed_future_raises_from_result_and_warns_if_nobody_asks(handle, tmp_path,
                                                                     monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(bytes(64 * KiB))
    start = scheduler_module.Scheduler._start

    def shrink_first(self, op, is_async, for_wait=True):
        os.truncate(path, 0)
        return start(self, op, is_async, for_wait)

    monkeypatch.setattr(scheduler_module.Scheduler, "_start", shrink_first)
    future = handle.submit_pread(torch.zeros(8 * KiB, dtype=torch.uint8), str(path))
    with pytest.raises(nvmeswap.ShortFileError) as info:
        future.result()
    assert info.value.filename == str(path)
    path.write_bytes(bytes(64 * KiB))
    forgotten = handle.submit_pread(torch.zeros(8 * KiB, dtype=torch.uint8), str(path))
    while not forgotten.done():
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del forgotten
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) and "failed" in str(w.message)
               for w in caught)


def test_batch_errors_name_the_cause_on_a_file_refusing_aio(handle, tmp_path):
    """A batch to a file kernel AIO refuses (procfs) fails at wait(), naming the file."""
    warnings.simplefilter("ignore", nvmeswap.BufferedIOWarning)
    locked = handle.new_cpu_locked_tensor(8 * KiB, EXAMPLE)
    handle.async_pwrite_many(locked, "/proc/self/mem", [0, 4096], lengths=[4096, 4096])
    with pytest.raises(OSError) as info:
        handle.wait()
    assert info.value.filename == "/proc/self/mem"
    assert info.value.errno in (errno.EINVAL, errno.EIO)
    assert handle.free_cpu_locked_tensor(locked)


@pytest.mark.parametrize("where", ["open_target", "BatchOperation"])
@pytest.mark.parametrize("is_read", [True, False], ids=["read", "write"])
def test_a_ctrl_c_as_a_batch_opens_its_file_leaves_nothing_open(handle, source, monkeypatch,
                                                                where, is_read):
    """A Ctrl-C held back while a batch opens its file (or books a slice) comes at the
    end of that step: the file's descriptors are closed, no write is left registered as
    in flight, and nothing is counted."""
    import signal

    from nvmeswap.io.operation import writes

    path, _ = source
    real = getattr(scheduler_module, where)

    def then_ctrl_c(*args, **kwargs):
        made = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)     # held back to the step's end
        return made

    monkeypatch.setattr(scheduler_module, where, then_ctrl_c)
    locked = handle.new_cpu_locked_tensor(8 * 4 * KiB, EXAMPLE)
    move = handle.async_pread_many if is_read else handle.async_pwrite_many
    with pytest.raises(KeyboardInterrupt):
        move(locked, path, [k * 4 * KiB for k in range(8)], lengths=[4 * KiB] * 8)
    monkeypatch.undo()
    assert handle.wait() == 0
    assert not [fd for fd in os.listdir("/proc/self/fd")
                if os.path.realpath(f"/proc/self/fd/{fd}") == path]
    assert not any(writes()._by_file.values())
