"""Bytes written come back unchanged: sizes x offsets x parallelism x submit modes."""
import itertools
import mmap
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes, worker_processes

import nvmeswap

MiB = 1 << 20
SIZES = [1, 511, 4095, 4096, 4097, MiB + 3]
OFFSETS = [0, 512, 4096, 12345]
BIG = 64 * MiB + 4097
MODES = list(itertools.product([False, True], [False, True]))   # single_submit, overlap_events


def _write_read(h, data, path, offset, *, use_async):
    """Write ``data`` with a plain tensor, read it back into a fresh one, both ways."""
    source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    target = torch.zeros(len(data), dtype=torch.uint8)
    if use_async:
        assert h.async_pwrite(source, path, offset) == 0
        assert h.wait() == 1
        assert h.async_pread(target, path, offset) == 0
        assert h.wait() == 1
    else:
        assert h.sync_pwrite(source, path, offset) == 1
        assert h.sync_pread(target, path, offset) == 1
    return bytes(target.numpy())


@pytest.mark.parametrize("single_submit,overlap_events", MODES)
@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_round_trip_grid(handle_factory, tmp_path, parallelism, single_submit, overlap_events):
    h = handle_factory(intra_op_parallelism=parallelism, single_submit=single_submit,
                       overlap_events=overlap_events)
    cases = list(itertools.product(SIZES, OFFSETS)) + [(BIG, 0), (BIG, 12345)]
    for i, (size, offset) in enumerate(cases):
        data = random_bytes(size, seed=i)
        path = tmp_path / f"f{i}"
        got = _write_read(h, data, path, offset, use_async=i % 2 == 1)
        assert got == data, f"size={size} offset={offset}"
        on_disk = path.read_bytes()
        assert len(on_disk) == offset + size, f"size={size} offset={offset}"
        assert on_disk[offset:] == data


@pytest.mark.parametrize("block_size", [4096, 64 << 10, MiB, 8 * MiB])
@pytest.mark.parametrize("queue_depth", [1, 4, 128])
def test_block_size_and_queue_depth(handle_factory, tmp_path, block_size, queue_depth):
    h = handle_factory(block_size=block_size, queue_depth=queue_depth, overlap_events=True,
                       intra_op_parallelism=2)
    size = 3 * MiB + 4097 if block_size < MiB else 20 * MiB + 3
    data = random_bytes(size)
    assert _write_read(h, data, tmp_path / "f", 4096, use_async=False) == data


def test_many_async_ops_then_one_wait(handle_factory, tmp_path):
    h = handle_factory(intra_op_parallelism=2)
    pieces = [random_bytes(n, seed=n) for n in (4096, 5000, MiB + 3, 1, 3 * MiB)]
    offsets = np.cumsum([0] + [len(p) for p in pieces])[:-1]
    path = tmp_path / "many"
    sources = [bytearray(p) for p in pieces]
    for source, offset in zip(sources, offsets):
        assert h.async_pwrite(source, str(path), int(offset)) == 0
    assert h.wait() == len(pieces)
    assert path.read_bytes() == b"".join(pieces)
    targets = [bytearray(len(p)) for p in pieces]
    for target, offset in zip(targets, offsets):
        h.async_pread(target, str(path), int(offset))
    assert h.wait() == len(pieces)
    assert [bytes(t) for t in targets] == pieces


def test_locked_tensor_round_trip(handle_factory, tmp_path):
    h = handle_factory(intra_op_parallelism=2)
    t = h.new_cpu_locked_tensor(16 * MiB + 3, torch.empty(0, dtype=torch.uint8))
    data = random_bytes(t.numel())
    t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert h.sync_pwrite(t, tmp_path / "locked") == 1
    t.zero_()
    assert h.async_pread(t, tmp_path / "locked") == 0 and h.wait() == 1
    assert bytes(t.numpy()) == data


@pytest.mark.parametrize("start,offset", [(0, 0), (4096, 8192), (100, 100), (100, 0), (7, 12345)])
def test_locked_tensor_slices(handle_factory, tmp_path, start, offset):
    """Slices are zero-copy when in phase with the file offset and staged otherwise."""
    h = handle_factory(intra_op_parallelism=2)
    t = h.new_cpu_locked_tensor(4 * MiB, torch.empty(0, dtype=torch.uint8))
    view = t[start:start + 2 * MiB + 5]
    data = random_bytes(view.numel(), seed=start)
    view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert h.is_pinned(view)
    h.sync_pwrite(view, tmp_path / "slice", offset)
    t.zero_()
    h.sync_pread(view, tmp_path / "slice", offset)
    assert bytes(view.numpy()) == data
    assert int(t[:start].sum()) == 0 and int(t[start + view.numel():].sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool])
def test_plain_tensors_of_several_dtypes(handle, tmp_path, dtype):
    source = torch.randn(300_001).to(dtype)
    target = torch.empty_like(source)
    handle.sync_pwrite(source, tmp_path / "t", 512)
    handle.sync_pread(target, tmp_path / "t", 512)
    assert torch.equal(source, target)


def test_locked_tensor_of_another_dtype(handle, tmp_path):
    t = handle.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float64))
    assert t.dtype == torch.float64 and t.shape == (1000,) and handle.is_pinned(t)
    t.copy_(torch.arange(1000, dtype=torch.float64))
    handle.sync_pwrite(t, tmp_path / "f64")
    back = torch.empty(1000, dtype=torch.float64)
    handle.sync_pread(back, tmp_path / "f64")
    assert torch.equal(back, torch.arange(1000, dtype=torch.float64))


def test_numpy_bytearray_memoryview_mmap(handle, tmp_path):
    data = random_bytes(3 * MiB + 1)
    array = np.frombuffer(data, dtype=np.uint8).copy()
    handle.sync_pwrite(array, tmp_path / "np")
    assert (tmp_path / "np").read_bytes() == data

    into_array = np.zeros(len(data) // 4, dtype=np.float32)
    handle.sync_pread(into_array, tmp_path / "np")
    assert into_array.tobytes() == data[: into_array.nbytes]

    into_bytearray = bytearray(len(data))
    handle.sync_pread(memoryview(into_bytearray), tmp_path / "np")
    assert into_bytearray == data

    with mmap.mmap(-1, len(data)) as mapped:
        handle.sync_pread(mapped, tmp_path / "np")
        assert mapped[:] == data
        handle.sync_pwrite(mapped, tmp_path / "from_mmap", 4097)
    assert (tmp_path / "from_mmap").read_bytes()[4097:] == data


def test_block_device_style_sizes_are_exact(handle, tmp_path):
    """DeepNVMe drops an unaligned tail and leaves a short file; we never do."""
    for size in (4095, 4097, 8191, 1 << 20 | 1):
        path = tmp_path / f"tail{size}"
        data = random_bytes(size)
        handle.sync_pwrite(bytearray(data), path)
        assert os.path.getsize(path) == size and path.read_bytes() == data


def test_thousands_of_async_ops_then_one_wait(handle_factory, tmp_path):
    """More operations in flight than a process has descriptors: back-pressure, no EMFILE."""
    import resource
    h = handle_factory(intra_op_parallelism=2)
    data = random_bytes(16 * MiB)
    (tmp_path / "src").write_bytes(data)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = max(3000, soft + 500)
    offsets = np.random.default_rng(1).integers(0, len(data) - 5000, count)
    targets = [bytearray(4096 + i % 7) for i in range(count)]
    for target, offset in zip(targets, offsets):
        h.async_pread(target, tmp_path / "src", int(offset))
    assert h.wait() == count
    for target, offset in zip(targets, offsets):
        assert target == data[offset:offset + len(target)]


def test_staging_stays_bounded_in_a_burst(handle_factory, tmp_path):
    """Note [staging ring]: plain tensors of any size and number pass through one staging
    region of the handle's staging size, in the parent and in the workers."""
    def staging_bytes(pid="self"):
        total = 0
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if "memfd:nvmeswap" in line:
                    start, end = (int(x, 16) for x in line.split()[0].split("-"))
                    total += end - start
        return total

    h = handle_factory(intra_op_parallelism=2)
    sources = [torch.full((40 * MiB + i,), i, dtype=torch.uint8) for i in range(8)]
    for i, source in enumerate(sources):
        h.async_pwrite(source, tmp_path / f"burst{i}", 4096 * i + 7)
    assert 0 < staging_bytes() <= 64 * MiB      # 320 MiB in flight, through 64 MiB
    assert h.wait() == 8
    for i in range(8):
        back = torch.empty(40 * MiB + i, dtype=torch.uint8)
        h.sync_pread(back, tmp_path / f"burst{i}", 4096 * i + 7)
        assert int(back.min()) == int(back.max()) == i
    workers = worker_processes(h)
    assert len(workers) == 2 and all(staging_bytes(w.pid) <= 64 * MiB for w in workers)


def test_staging_size_and_memory_budget(handle_factory, tmp_path):
    h = handle_factory(staging_bytes=2 * MiB, memory_budget=6 * MiB)
    assert h.memory_budget == 6 * MiB and h.memory_in_use == 2 * MiB
    data = torch.randint(0, 256, (20 * MiB + 3,), dtype=torch.uint8)
    h.sync_pwrite(data, tmp_path / "f", 5)        # 20 MiB through 2 MiB of staging
    back = torch.zeros_like(data)
    h.sync_pread(back, tmp_path / "f", 5)
    assert torch.equal(back, data)
    with open("/proc/self/maps") as maps:
        sizes = [int(b, 16) - int(a, 16) for a, b in (line.split()[0].split("-")
                 for line in maps if "memfd:nvmeswap" in line)]
    assert sizes == [2 * MiB]
    t = h.new_cpu_locked_tensor(3 * MiB, torch.empty(0, dtype=torch.uint8))
    assert h.memory_in_use == 5 * MiB
    with pytest.raises(nvmeswap.MemoryBudgetError, match="6291456 bytes"):
        h.new_cpu_locked_tensor(2 * MiB, torch.empty(0, dtype=torch.uint8))
    with pytest.raises(nvmeswap.MemoryBudgetError, match="below what"):
        h.memory_budget = 4 * MiB
    assert h.free_cpu_locked_tensor(t) and h.memory_in_use == 2 * MiB
    h.memory_budget = None
    assert h.new_cpu_locked_tensor(2 * MiB, torch.empty(0, dtype=torch.uint8)).numel() == 2 * MiB
    with pytest.raises(ValueError, match="staging_bytes"):
        nvmeswap.aio_handle(staging_bytes=4096)
    with pytest.raises(nvmeswap.MemoryBudgetError, match="below what"):
        nvmeswap.aio_handle(memory_budget=MiB)
    with nvmeswap.aio_handle.from_config({"aio": {"staging_bytes": "4M",
                                                  "memory_budget": "1G"}}) as c:
        assert c.memory_in_use == 4 * MiB and c.memory_budget == 1 << 30


def test_a_small_async_operation_never_overtakes_an_earlier_one(handle_factory, tmp_path):
    """Note [small synchronous operations]: a small async operation runs inline only when
    nothing is in flight; behind a large one it keeps its place."""
    h = handle_factory()
    path = tmp_path / "f"
    for round_number in range(5):
        h.async_pwrite(bytearray(b"\x11") * (8 * MiB), path)
        h.async_pwrite(bytearray(b"\x22") * 4096, path, 4096)
        assert h.wait() == 2
        data = path.read_bytes()
        assert data[4096:8192] == b"\x22" * 4096 and data[:4096] == b"\x11" * 4096
    back = bytearray(4096)
    h.async_pread(back, path, 4096)         # nothing in flight: it may run inline
    assert h.wait() == 1 and back == b"\x22" * 4096
