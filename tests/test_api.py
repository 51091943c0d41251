"""The DeepNVMe behaviours that code written against aio_handle relies on."""
import gc
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes

import nvmeswap
from nvmeswap.compat import AsyncIOBuilder

ARGS = {"block_size": 65536, "queue_depth": 16, "single_submit": True, "overlap_events": True,
            "intra_op_parallelism": 2}


def test_getters_equal_constructor_arguments(handle_factory):
    h = handle_factory(**ARGS)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
            h.get_overlap_events(), h.get_intra_op_parallelism()) == tuple(ARGS.values())
    assert h.get_alignment() == 512 * ARGS["intra_op_parallelism"]   # DeepNVMe's meaning


def test_positional_constructor_like_deepnvme(handle_factory):
    h = handle_factory(**dict(zip(ARGS, ARGS.values())))
    assert h.get_intra_op_parallelism() == 2
    with nvmeswap.aio_handle(131072, 8, False, True, 1) as positional:
        assert positional.get_block_size() == 131072 and positional.get_overlap_events()


def test_return_values(handle, tmp_path):
    buf = bytearray(random_bytes(10000))
    path = str(tmp_path / "r")
    assert handle.wait() == 0
    assert handle.sync_pwrite(buf, path) == 1
    assert handle.sync_pread(buf, path) == 1
    assert handle.async_pwrite(buf, path) == 0
    assert handle.async_pread(bytearray(100), path) == 0
    assert handle.wait() == 2
    assert handle.wait() == 0
    assert handle.pwrite(buf, path, False, False) == 1
    assert handle.pread(buf, path, False, False) == 1
    assert handle.pwrite(buf, path, False, True) == 0
    assert handle.pread(buf, path, True, True, 0) == 0
    assert handle.wait() == 2
    assert handle.pread(buf, path, False, **{"async": True}) == 0     # DeepNVMe's keyword
    assert handle.wait() == 1
    # read() and write() return 0, as DeepNVMe's C++ does (its sync pread/pwrite 1).
    assert handle.write(buf, path, True) == 0 and handle.read(buf, path, True, 0) == 0


def test_offset_write_keeps_the_other_bytes(handle, tmp_path):
    path = tmp_path / "existing"
    model = bytearray(random_bytes(300_000))
    path.write_bytes(model)
    for offset, size in [(0, 100), (4096, 8192), (12345, 5000), (299_000, 3000), (100_000, 1)]:
        patch = random_bytes(size, seed=offset)
        handle.sync_pwrite(bytearray(patch), path, offset)
        model[offset:offset + size] = patch
    assert path.read_bytes() == bytes(model)


def test_write_creates_and_never_truncates(handle, tmp_path):
    path = tmp_path / "grow"
    handle.sync_pwrite(bytearray(b"x" * 5000), path, 10000)
    assert path.read_bytes() == b"\0" * 10000 + b"x" * 5000
    handle.sync_pwrite(bytearray(b"y" * 10), path)
    assert os.path.getsize(path) == 15000 and path.read_bytes()[:11] == b"y" * 10 + b"\0"


def test_fd_overload_writes_and_does_not_close(handle, tmp_path):
    path = tmp_path / "byfd"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        data = random_bytes(70000)
        assert handle.async_pwrite(bytearray(data), fd, 4096) == 0
        assert handle.wait() == 1
        os.fstat(fd)   # still open
        assert os.pread(fd, len(data), 4096) == data
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0   # the caller's position is untouched
    finally:
        os.close(fd)


def test_validate_passes_on_good_data(handle, tmp_path):
    data = bytearray(random_bytes(1 << 20 | 17))
    assert handle.pwrite(data, tmp_path / "v", True, False, 512) == 1
    back = bytearray(len(data))
    assert handle.pread(back, tmp_path / "v", True, False, 512) == 1
    assert back == data


def test_validate_catches_a_mismatch(handle, tmp_path, monkeypatch):
    """validate re-reads just the region; a byte changed behind our back is reported."""
    path = tmp_path / "v"
    data = bytearray(random_bytes(100_000))
    handle.sync_pwrite(data, path, 4096)
    import nvmeswap.io.validate as module
    real_pread = os.pread

    def corrupting_pread(fd, n, offset):
        chunk = bytearray(real_pread(fd, n, offset))
        chunk[5] ^= 0xFF
        return bytes(chunk)

    monkeypatch.setattr(module.os, "pread", corrupting_pread)
    with pytest.raises(nvmeswap.ValidationError) as info:
        handle.pwrite(data, path, True, False, 4096)
    assert info.value.filename == str(path) and info.value.offset == 4096 + 5


def test_locked_tensor_lifecycle(handle):
    example = torch.empty(0, dtype=torch.float32)
    t = handle.new_cpu_locked_tensor(1024, example)
    assert t.data_ptr() % 4096 == 0 and t.numel() == 1024
    assert handle.is_pinned(t) and handle.is_pinned(t[10:20])
    assert not handle.is_pinned(torch.empty(10))
    misspelt = handle.new_cpu_locked_tensor(8, example_tenosr=example)
    assert handle.is_pinned(misspelt)
    assert handle.free_cpu_locked_tensor(t) is True
    assert not handle.is_pinned(t)
    assert handle.free_cpu_locked_tensor(torch.empty(4)) is False
    t.fill_(1.0)   # the memory stays valid while the tensor lives
    assert float(t.sum()) == 1024.0


@pytest.mark.parametrize("config,expected", [
    ({"aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2,
              "single_submit": False, "overlap_events": True, "use_gds": False}},
     (262144, 32, False, True, 2)),
    (('{"aio": {"single_submit": "true", "overlap_events": "false", "num_threads": 1, '
      '"block_size": "1M", "queue_depth": 8}}'), (1 << 20, 8, True, False, 1)),
    # What a config leaves out: DeepSpeed's defaults, as its swappers would run with.
    ({"block_size": 65536, "intra_op_parallelism": 2}, (65536, 8, False, True, 2)),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3}},       # no "aio": defaults
     (1 << 20, 8, False, True, 1)),
    ({"steps_per_print": 10, "wall_clock_breakdown": False},            # the same
     (1 << 20, 8, False, True, 1)),
    ({"num_threads": 2, "intra_op_parallelism": 2}, (1 << 20, 8, False, True, 2)),
])
def test_from_config(config, expected):
    with nvmeswap.aio_handle.from_config(config) as h:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
                h.get_overlap_events(), h.get_intra_op_parallelism()) == expected


def test_from_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown aio setting 'blocksize'"):
        nvmeswap.aio_handle.from_config(json.dumps({"aio": {"blocksize": 4096}}))
    with pytest.raises(ValueError, match="unknown aio setting 'train_batch_size'"):
        nvmeswap.aio_handle.from_config({"train_batch_size": 8, "block_size": 4096})
    with pytest.raises(TypeError, match='the "aio" section must be a dict of settings, '
                                        "got NoneType"):
        nvmeswap.aio_handle.from_config('{"aio": null}')
    with pytest.raises(ValueError, match="num_threads and intra_op_parallelism are one "
                                         "setting, given 2 and 4"):
        nvmeswap.aio_handle.from_config({"num_threads": 2, "intra_op_parallelism": 4})


def test_compat_builder(tmp_path):
    builder = AsyncIOBuilder()
    assert builder.is_compatible()
    h = builder.load().aio_handle(1048576, 16, False, True, 1)
    try:
        data = torch.arange(5000, dtype=torch.int32)
        h.sync_pwrite(data, str(tmp_path / "c"))
        back = torch.empty_like(data)
        h.sync_pread(back, str(tmp_path / "c"))
        assert torch.equal(back, data)
    finally:
        h.close()


def test_threads_share_one_handle(handle_factory, tmp_path):
    import threading
    h = handle_factory(intra_op_parallelism=2)
    errors = []

    def work(k):
        try:
            for i in range(20):
                data = random_bytes(4096 * (i + 1) + k, seed=k * 100 + i)
                path = tmp_path / f"t{k}_{i}"
                h.sync_pwrite(bytearray(data), path)
                back = bytearray(len(data))
                h.sync_pread(back, path)
                assert back == data
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_unclosed_handle_warns_and_cleans_up():
    handles = [nvmeswap.aio_handle()]
    with pytest.warns(ResourceWarning, match="unclosed"):
        _drop_and_collect(handles)


def _drop_and_collect(handles):
    handles.clear()
    gc.collect()


def test_compat_gds_builder_loads_a_gds_handle():
    from nvmeswap.compat import GDSBuilder
    assert GDSBuilder().is_compatible() is nvmeswap.gds_available()
    assert GDSBuilder().load().gds_handle is nvmeswap.gds_handle


@pytest.mark.parametrize("block_size", [1, 512, 1024, 1000, 4097, 6000])
def test_block_size_below_or_off_4096_reports_what_was_asked(handle_factory, tmp_path,
                                                             block_size):
    """DeepNVMe accepts any block size (its own op tests use 1024/2/2); a small one is
    served by a larger internal block, with the same bytes and return values."""
    h = handle_factory(block_size=block_size, queue_depth=2, intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism(),
            h.get_alignment()) == (block_size, 2, 2, 1024)
    for size, offset in [(1, 0), (4095, 512), (70_001, 4096), (300_000, 12_345)]:
        data = bytearray(random_bytes(size, seed=size))
        path = tmp_path / f"s{size}"
        assert h.sync_pwrite(data, path, offset) == 1
        # A new file: a hole up to the offset, then the data, and nothing after it.
        assert path.read_bytes() == bytes(offset) + data
        back = bytearray(size)
        assert h.async_pread(back, path, offset) == 0 and h.wait() == 1
        assert back == data


@pytest.mark.parametrize("block_size", [0, -4096, 1 << 31])
def test_block_size_out_of_range_is_refused(block_size):
    with pytest.raises(ValueError, match="block_size"):
        nvmeswap.aio_handle(block_size=block_size)


def test_keyword_arguments_are_deepnvmes(handle_factory, tmp_path):
    """Every method by the keyword names of DeepSpeed's pybind signatures."""
    h = handle_factory(block_size=1024, queue_depth=2, single_submit=False,
                       overlap_events=False, intra_op_parallelism=2)
    example = torch.empty(0, dtype=torch.uint8)
    locked = h.new_cpu_locked_tensor(num_elem=8192, example_tenosr=example)
    data = torch.frombuffer(bytearray(random_bytes(8192)), dtype=torch.uint8)
    locked.copy_(data)
    path = str(tmp_path / "kw")
    assert h.sync_pwrite(buffer=locked, filename=path, file_offset=0) == 1
    assert h.write(buffer=locked, filename=path, validate=True, file_offset=8192) == 0
    fd = os.open(path, os.O_RDWR)
    try:
        assert h.async_pwrite(buffer=locked, fd=fd, file_offset=16384) == 0
        assert h.wait() == 1
    finally:
        os.close(fd)
    assert h.async_pwrite(buffer=locked, filename=path, file_offset=24576) == 0
    assert h.pwrite(buffer=locked, filename=path, validate=False, file_offset=32768,
                    **{"async": True}) == 0
    assert h.wait() == 2
    expected = bytes(data.numpy()) * 5
    assert (tmp_path / "kw").read_bytes() == expected
    for i, read in enumerate([
            lambda b, o: h.sync_pread(buffer=b, filename=path, file_offset=o),
            lambda b, o: h.read(buffer=b, filename=path, validate=True, file_offset=o),
            lambda b, o: h.pread(buffer=b, filename=path, validate=False, file_offset=o,
                                 **{"async": False})]):
        back = torch.zeros(8192, dtype=torch.uint8)
        assert read(back, 8192 * i) == (0 if i == 1 else 1) and torch.equal(back, data)
    back = torch.zeros(8192, dtype=torch.uint8)
    assert h.async_pread(buffer=back, filename=path, file_offset=0) == 0 and h.wait() == 1
    assert torch.equal(back, data)
    assert h.is_pinned(buffer=locked) and not h.is_pinned(buffer=back)
    assert h.free_cpu_locked_tensor(tensor=locked) is True


def test_flags_that_are_not_bools_are_refused_before_any_io(handle, tmp_path):
    """``validate`` and ``async_op`` (``async``) take what DeepSpeed's pybind signatures
    take for a bool; a string or a count is a mistake, named at the call."""
    path = tmp_path / "f"
    for call in (lambda: handle.pwrite(bytearray(10), path, validate="yes"),
                 lambda: handle.pwrite(bytearray(10), path, async_op=2),
                 lambda: handle.pread(bytearray(10), path, **{"async": "no"}),
                 lambda: handle.write(bytearray(10), path, validate=None),
                 lambda: handle.read(bytearray(10), path, validate=0.5)):
        with pytest.raises(TypeError, match=r"(validate|async_op|async) must be a bool"):
            call()
    assert not path.exists() and handle.wait() == 0
    assert handle.pwrite(bytearray(b"abc"), path, validate=np.bool_(True), async_op=1) == 0
    assert handle.wait() == 1 and path.read_bytes() == b"abc"


def test_async_pwrite_target_mistakes_are_type_errors(handle, tmp_path):
    buf = bytearray(10)
    with pytest.raises(TypeError, match="filename or an fd"):
        handle.async_pwrite(buffer=buf)
    with pytest.raises(TypeError, match="not both"):
        handle.async_pwrite(buf, str(tmp_path / "x"), fd=3)
    with pytest.raises(TypeError, match="fd must be an int"):
        handle.async_pwrite(buf, fd="3")


def _mapped_by_workers(h, region_id):
    return [region_id in worker.mapped for worker in h._scheduler.workers.pool.workers]


def test_locked_memory_is_process_wide(handle_factory, tmp_path):
    """A tensor locked by one handle is pinned, and zero-copy, in every handle; any handle
    frees it, and then no handle's workers map it."""
    a = handle_factory(intra_op_parallelism=2)
    b = handle_factory(block_size=1024, queue_depth=2, intra_op_parallelism=2)
    t = a.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    assert a.is_pinned(t) and b.is_pinned(t) and b.is_pinned(t[4096:8192])
    region = b._placement.locked.containing(t.data_ptr(), t.numel())
    data = torch.frombuffer(bytearray(random_bytes(1 << 20, seed=3)), dtype=torch.uint8)
    t.copy_(data)
    assert b.sync_pwrite(t, tmp_path / "f") == 1
    assert all(_mapped_by_workers(b, region.region_id))     # zero-copy: b's workers map it
    t.zero_()
    assert a.sync_pread(t, tmp_path / "f") == 1 and torch.equal(t, data)
    assert all(_mapped_by_workers(a, region.region_id))
    assert b.free_cpu_locked_tensor(t) is True                # freed by the other handle
    assert not a.is_pinned(t) and not b.is_pinned(t)
    assert a.free_cpu_locked_tensor(t) is False
    assert not any(_mapped_by_workers(a, region.region_id))
    assert not any(_mapped_by_workers(b, region.region_id))
    assert torch.equal(t, data)       # the memory stays valid while the tensor lives


def test_locked_memory_outlives_the_handle_that_made_it(handle_factory, tmp_path):
    """The set belongs to the process: closing the handle that made a tensor leaves it
    pinned for the others; the last handle to close releases it."""
    a = handle_factory()
    b = handle_factory()
    t = a.new_cpu_locked_tensor(5000, torch.empty(0, dtype=torch.float64))
    a.close()
    assert b.is_pinned(t)
    t.copy_(torch.arange(5000, dtype=torch.float64))
    assert b.sync_pwrite(t, tmp_path / "f") == 1
    assert (tmp_path / "f").read_bytes() == torch.arange(5000, dtype=torch.float64).numpy().tobytes()
    b.close()
    with nvmeswap.aio_handle() as c:
        assert not c.is_pinned(t)     # released with the last handle
