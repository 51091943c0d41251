"""The DeepNVMe behaviours that code written against aio_handle relies on."""
import json
import os

import pytest
import torch
from conftest import random_bytes

import nvmeswap
from nvmeswap.compat import AsyncIOBuilder

ARGS = dict(block_size=65536, queue_depth=16, single_submit=True, overlap_events=True,
            intra_op_parallelism=2)


def test_getters_equal_constructor_arguments(handle_factory):
    h = handle_factory(**ARGS)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
            h.get_overlap_events(), h.get_intra_op_parallelism()) == tuple(ARGS.values())
    assert h.get_alignment() == 4096


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
    assert handle.write(buf, path, True) == 1 and handle.read(buf, path, True, 0) == 1


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
    ('{"aio": {"single_submit": "true", "overlap_events": "false", "num_threads": 1, '
     '"block_size": "1M", "queue_depth": 8}}', (1 << 20, 8, True, False, 1)),
    ({"block_size": 65536, "intra_op_parallelism": 2}, (65536, 128, False, False, 2)),
])
def test_from_config(config, expected):
    with nvmeswap.aio_handle.from_config(config) as h:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
                h.get_overlap_events(), h.get_intra_op_parallelism()) == expected


def test_from_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown aio setting 'blocksize'"):
        nvmeswap.aio_handle.from_config(json.dumps({"aio": {"blocksize": 4096}}))


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
    h = nvmeswap.aio_handle()
    with pytest.warns(ResourceWarning, match="unclosed"):
        del h
        import gc
        gc.collect()


def test_compat_gds_builder_loads_a_gds_handle():
    from nvmeswap.compat import GDSBuilder
    assert GDSBuilder().is_compatible() is nvmeswap.gds_available()
    assert GDSBuilder().load().gds_handle is nvmeswap.gds_handle
