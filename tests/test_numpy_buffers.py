"""The core I/O on buffers that are not torch tensors (numpy arrays, bytearray, mmap), so that
a Python without torch proves it too (.ci/other_pythons): sync and async round trips, batches
and futures, on every engine, each checked against the file's bytes as Python reads them."""
import mmap

import numpy as np
import pytest
from conftest import random_bytes, uring_unusable

import nvmeswap

KiB, MiB = 1 << 10, 1 << 20
URING_UNUSABLE = uring_unusable()
ENGINES = ["aio", pytest.param("uring", marks=pytest.mark.skipif(
    bool(URING_UNUSABLE), reason=URING_UNUSABLE))]


def array_of(data):
    """A fresh, writable uint8 array holding ``data``."""
    return np.frombuffer(bytearray(data), dtype=np.uint8)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("size", [1, 4095, 4097, 3 * MiB + 5])
@pytest.mark.parametrize("offset", [0, 4096, 513])
def test_sync_round_trip(handle_factory, tmp_path, engine, size, offset):
    h = handle_factory(intra_op_parallelism=3, block_size=256 * KiB, engine=engine)
    path = tmp_path / "f"
    data = random_bytes(size, seed=size + offset)
    assert h.sync_pwrite(array_of(data), path, offset) == 1
    on_disk = path.read_bytes()
    assert len(on_disk) == offset + size and on_disk[offset:] == data
    back = np.zeros(size, dtype=np.uint8)
    assert h.sync_pread(back, path, offset) == 1
    assert back.tobytes() == data


@pytest.mark.parametrize("engine", ENGINES)
def test_async_round_trips_of_several_buffer_kinds(handle_factory, tmp_path, engine):
    h = handle_factory(intra_op_parallelism=2, engine=engine)
    sizes = [4096, 1 * MiB + 7, 100, 2 * MiB]
    datas = [random_bytes(n, seed=k) for k, n in enumerate(sizes)]
    written = [array_of(datas[0]), bytearray(datas[1]),
               memoryview(bytearray(datas[2])), np.frombuffer(datas[3], dtype=np.float32)]
    paths = [tmp_path / f"f{k}" for k in range(len(sizes))]
    for buffer, path in zip(written, paths):
        assert h.async_pwrite(buffer, path) == 0
    assert h.wait() == len(sizes)
    assert [path.read_bytes() for path in paths] == datas

    region = mmap.mmap(-1, sizes[3])
    targets = [np.zeros(sizes[0], dtype=np.uint8), bytearray(sizes[1]),
               memoryview(bytearray(sizes[2])), region]
    for buffer, path in zip(targets, paths):
        assert h.async_pread(buffer, path) == 0
    assert h.wait() == len(sizes)
    assert [bytes(buffer) for buffer in targets] == datas
    region.close()


def test_a_2d_array_is_moved_as_its_bytes(handle, tmp_path):
    rng = np.random.default_rng(5)
    matrix = rng.standard_normal((300, 77))
    handle.sync_pwrite(matrix, tmp_path / "m")
    assert (tmp_path / "m").read_bytes() == matrix.tobytes()
    back = np.empty_like(matrix)
    handle.sync_pread(back, tmp_path / "m")
    assert np.array_equal(back, matrix)


def test_futures_give_the_bytes_moved(handle, tmp_path):
    data = random_bytes(600 * KiB + 3, seed=9)
    written = handle.submit_pwrite(array_of(data), tmp_path / "f")
    assert written.result() == len(data)
    assert (tmp_path / "f").read_bytes() == data
    back = np.zeros(len(data), dtype=np.uint8)
    read = handle.submit_pread(back, tmp_path / "f")
    assert read.result() == len(data) and read.done()
    assert back.tobytes() == data
    assert handle.wait() == 0           # futures are not wait()'s to count


@pytest.mark.parametrize("engine", ENGINES)
def test_batches_of_one_file(handle_factory, tmp_path, engine):
    h = handle_factory(intra_op_parallelism=2, engine=engine)
    path = tmp_path / "blocks"
    data = random_bytes(64 * 4 * KiB, seed=3)
    path.write_bytes(data)
    # One buffer cut into requests: whole blocks in reverse order, and odd pieces.
    offsets = [k * 4 * KiB for k in reversed(range(64))] + [5, 70 * KiB + 1]
    lengths = [4 * KiB] * 64 + [3000, 1]
    blocks = np.zeros(sum(lengths), dtype=np.uint8)
    assert h.async_pread_many(blocks, path, offsets, lengths=lengths) == 0
    assert h.wait() == len(offsets)
    expected = b"".join(data[o:o + n] for o, n in zip(offsets, lengths))
    assert blocks.tobytes() == expected

    # A list of buffers written to another file, then read back one by one.
    pieces = [array_of(random_bytes(n, seed=n)) for n in (4096, 10, 8192, 777)]
    starts = [0, 4096, 12288, 8192 + 10]
    other = tmp_path / "other"
    assert h.async_pwrite_many(pieces, other, starts) == 0
    assert h.wait() == len(pieces)
    on_disk = other.read_bytes()
    for piece, start in zip(pieces, starts):
        assert on_disk[start:start + len(piece)] == piece.tobytes()


def test_a_batch_past_the_end_names_the_file_and_reads_nothing(handle, tmp_path):
    path = tmp_path / "short"
    path.write_bytes(random_bytes(8 * KiB))
    target = np.full(8 * KiB, 0x55, dtype=np.uint8)
    with pytest.raises(nvmeswap.ShortFileError) as info:
        handle.async_pread_many(target, path, [0, 6 * KiB], lengths=[4 * KiB, 4 * KiB])
    assert info.value.filename == str(path)
    assert "the file is 8192 bytes long" in str(info.value)
    assert handle.wait() == 0
    assert (target == 0x55).all()       # checked before any I/O


def test_a_refused_async_read_names_the_file_and_leaves_the_others(handle, tmp_path):
    path = tmp_path / "f"
    data = random_bytes(64 * KiB + 1, seed=11)
    path.write_bytes(data)
    back = np.zeros(len(data), dtype=np.uint8)
    handle.async_pread(back, path)
    with pytest.raises(FileNotFoundError) as info:
        handle.async_pread(np.zeros(4 * KiB, dtype=np.uint8), str(tmp_path / "nope"))
    assert info.value.filename == str(tmp_path / "nope")
    assert handle.wait() == 1
    assert back.tobytes() == data
