"""The staging space that CUDA tensors take through aio_handle, driven by a stand-in device.

No GPU is needed: the stand-in device (stand_in_device.py) puts a stand-in CUDA runtime
under nvmeswap.gpu.copies, so that the real copier runs (its stream, its wait on the
caller's stream, its asynchronous copies and their synchronization, the registration of
the staging space), and the pieces, the workers and the files all run for real. On a
GPU, test_gpu.py runs the same code on CUDA.
"""
import functools
import os
import threading

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes, wait_until
from stand_in_device import copied, device_tensor, use_stand_in_device

import nvmeswap
from nvmeswap.io.limits import Limits

KiB, MiB = 1 << 10, 1 << 20
PIECE = 64 * KiB


@pytest.fixture
def handle_factory(handle_factory):
    # Four pieces of PIECE bytes (two pages of each piece's extent are for alignment).
    return functools.partial(handle_factory, _limits=Limits(staging_bytes=4 * (PIECE + 8 * KiB)))


@pytest.fixture
def device(monkeypatch):
    return use_stand_in_device(monkeypatch)


@pytest.mark.parametrize("parallelism", [1, 3])
@pytest.mark.parametrize("use_async", [False, True])
def test_round_trip_through_ring(handle_factory, tmp_path, device, parallelism, use_async):
    h = handle_factory(intra_op_parallelism=parallelism)
    sizes = [1, 4095, 4097, 256 * KiB, MiB + 3, 3 * MiB + 4097]
    for i, (size, offset) in enumerate((s, o) for s in sizes for o in (0, 512, 12345)):
        data = random_bytes(size, seed=i)
        path = tmp_path / f"f{i}"
        source, target = device_tensor(h, data), device_tensor(h, size)
        if use_async:
            h.async_pwrite(source, str(path), offset)
            assert h.wait() == 1
            h.async_pread(target, str(path), offset)
            assert h.wait() == 1
        else:
            h.sync_pwrite(source, str(path), offset)
            h.sync_pread(target, str(path), offset)
        assert bytes(target.numpy()) == data, f"size={size} offset={offset}"
        assert path.read_bytes()[offset:] == data
        assert copied(source) == copied(target) == size     # every byte via the copier


@pytest.mark.parametrize("is_read", [False, True])
def test_a_batch_of_slices_of_one_device_tensor(handle_factory, tmp_path, device, is_read):
    """Each request of a batch cut from one device tensor by ``lengths`` moves its own
    bytes, not the tensor's first ones (the copier starts at the request's address)."""
    h = handle_factory()
    length, count = 64 * KiB + 512, 4
    data = random_bytes(length * count, seed=3)
    path = tmp_path / "f"
    offsets = [k * 80 * KiB for k in reversed(range(count))]    # out of order on purpose
    expected = bytearray(offsets[0] + length)
    for k, offset in enumerate(offsets):
        expected[offset:offset + length] = data[k * length:(k + 1) * length]
    if is_read:
        path.write_bytes(bytes(expected))
        target = device_tensor(h, len(data))
        h.async_pread_many(target, str(path), offsets, lengths=[length] * count)
        assert h.wait() == count
        assert bytes(target.numpy()) == data
    else:
        source = device_tensor(h, data)
        h.async_pwrite_many(source, str(path), offsets, lengths=[length] * count)
        assert h.wait() == count
        assert path.read_bytes() == bytes(expected)


def test_staging_stays_at_ring_size(handle_factory, tmp_path, device):
    """Four slots, not a bounce buffer as large as the tensor; the staging space is
    registered with CUDA once (Note [registered staging]) and unregistered at close."""
    h = handle_factory(intra_op_parallelism=2)
    size = 80 * PIECE + 5
    data = random_bytes(size)
    h.sync_pwrite(device_tensor(h, data), str(tmp_path / "f"), 4096)
    target = device_tensor(h, size)
    h.sync_pread(target, str(tmp_path / "f"), 4096)
    assert bytes(target.numpy()) == data
    assert len(device.registered) == 1 and all(n < size / 2 for n in device.registered.values())
    h.close()
    assert device.registered == {}


def test_a_write_sees_the_work_queued_before_it(handle_factory, tmp_path, device):
    """Note [stream order]: the bytes a kernel queued on the caller's stream will write
    are the bytes written to the file, though the kernel has not run at the call."""
    h = handle_factory(intra_op_parallelism=2)
    data = random_bytes(9 * PIECE + 11)
    source = device_tensor(h, len(data))            # zeros, until the kernel runs
    device.current_stream().enqueue(
        lambda: source.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8)))
    h.async_pwrite(source, str(tmp_path / "f"))
    assert h.wait() == 1
    assert (tmp_path / "f").read_bytes() == data


def test_a_read_is_in_the_tensor_when_wait_returns(handle_factory, tmp_path, device):
    """Note [stream order]: the copies of a read are complete at wait(), for work queued
    after it on any stream; nothing is left queued on the handle's stream."""
    h = handle_factory(intra_op_parallelism=2)
    data = random_bytes(9 * PIECE + 11)
    (tmp_path / "f").write_bytes(data)
    target = device_tensor(h, len(data))
    h.async_pread(target, str(tmp_path / "f"))
    assert h.wait() == 1
    assert bytes(target.numpy()) == data
    (stream,) = device.streams_made
    assert stream._queued == []


def test_copies_overlap_the_workers_io(handle_factory, tmp_path, device):
    """Pipelined: the copy of each piece of a write waits until the piece before it is
    in the file. A piece gets there only if it went to the workers before this copy
    began, so the copies and the workers' writes overlap; a handle that copied every
    piece (or the next piece) before handing the last one out would stop here."""
    h = handle_factory(intra_op_parallelism=2)
    data = random_bytes(20 * PIECE)
    path = tmp_path / "f"
    seen = []

    def after_the_previous_piece_is_written(start, length):
        if seen:
            before, before_length = seen[-1]
            expected = data[before:before + before_length]
            with open(path, "rb") as written:
                wait_until(lambda: os.pread(written.fileno(), before_length, before) == expected,
                           f"piece at {before} reaches the file while the next is copied")
        seen.append((start, length))

    source = device_tensor(h, data, before_copy=after_the_previous_piece_is_written)
    assert h.sync_pwrite(source, str(path)) == 1
    assert len(seen) >= 20 and path.read_bytes() == data


@pytest.mark.parametrize("parallelism", [1, 3])
@pytest.mark.parametrize("use_async", [False, True])
def test_reads_overlap_the_copies(handle_factory, tmp_path, device, parallelism, use_async):
    """Pipelined: the copy of each piece of a read (but the last) waits until the workers
    have read another piece, one not copied yet, into the staging space. That piece gets
    there only if its read went out before this copy, so the workers' reads and the
    copies overlap; a handle that read the next piece only after copying this one, or
    that read a ring's worth of pieces and then copied them all, would stop here.

    Any piece not copied yet, not the next one: a worker runs its reads at once, and
    they may end in any order.
    """
    h = handle_factory(intra_op_parallelism=parallelism)
    data = random_bytes(20 * PIECE + 5, seed=parallelism)
    path = tmp_path / "f"
    path.write_bytes(data)      # not through the handle: no piece is in staging before
    copied_pieces, waited, missed = set(), [], []

    def after_another_piece_is_read(start, length):
        (op,) = h._scheduler.books.ops.values()
        staging = memoryview(op.region.mapping)
        copied_pieces.add((start, length))
        uncopied = [data[s:s + n] for s, n in op.chunks if (s, n) not in copied_pieces]
        if not uncopied or missed:
            return

        def another_is_read():
            held = bytes(staging)
            return any(piece in held for piece in uncopied)

        try:
            wait_until(another_is_read, f"another piece is read into staging while the "
                       f"piece at {start} is copied", within=20)
        except pytest.fail.Exception as failure:
            # Kept, not raised: pytest's failure is a BaseException, which would leave
            # the response reading half-way (as an interrupt would) and the read unended.
            missed.append(str(failure))
        else:
            waited.append(start)

    target = device_tensor(h, len(data), before_copy=after_another_piece_is_read)
    if use_async:
        h.async_pread(target, str(path))
        assert h.wait() == 1
    else:
        assert h.sync_pread(target, str(path)) == 1
    assert not missed, missed[0]
    assert bytes(target.numpy()) == data
    assert len(waited) == len(copied_pieces) - 1 >= 20


def test_async_write_progresses_before_wait(handle_factory, tmp_path, device):
    """More pieces than slots: a background thread keeps the ring turning."""
    h = handle_factory()
    size = 32 * PIECE
    path = tmp_path / "f"
    source = device_tensor(h, random_bytes(size))
    h.async_pwrite(source, str(path))
    wait_until(lambda: copied(source) == size, "the ring turns until every piece is copied")
    assert h.wait() == 1
    assert path.read_bytes() == random_bytes(size)


@pytest.mark.parametrize("is_read", [False, True])
def test_failed_copy_fails_the_operation(handle_factory, tmp_path, device, is_read):
    h = handle_factory(intra_op_parallelism=2)
    size = 12 * PIECE
    path = tmp_path / "f"
    data = random_bytes(size)
    if is_read:
        path.write_bytes(data)
        tensor = device_tensor(h, size, fail_at_piece=5)
        h.async_pread(tensor, str(path))
    else:
        path.write_bytes(b"keep")
        h.async_pwrite(device_tensor(h, data, fail_at_piece=5), str(path))
    with pytest.raises(RuntimeError, match="illegal memory access") as caught:
        h.wait()
    assert str(path) in str(caught.value)
    if not is_read:
        assert path.stat().st_size == 4     # the growth is undone: no file that looks complete
    # The handle goes on working.
    assert h.sync_pwrite(torch.ones(10, dtype=torch.uint8), str(tmp_path / "g")) == 1


def test_validate_compares_the_file_with_device_bytes(handle_factory, tmp_path, device):
    h = handle_factory()
    data = random_bytes(5 * PIECE + 7)
    assert h.pwrite(device_tensor(h, data), str(tmp_path / "f"), validate=True) == 1
    # A copy that flips one bit on its way to the file is caught.
    with pytest.raises(nvmeswap.ValidationError) as caught:
        h.pwrite(device_tensor(h, data, corrupt_copies=True), str(tmp_path / "g"),
                 validate=True)
    assert caught.value.offset == 0


def test_worker_death_during_a_ring_operation(handle_factory, tmp_path, device):
    h = handle_factory(intra_op_parallelism=2)
    size = 64 * PIECE
    (tmp_path / "f").write_bytes(random_bytes(size))
    h.async_pread(device_tensor(h, size, kill_worker_at_piece=3), str(tmp_path / "f"))
    result = {}
    waiter = threading.Thread(target=lambda: result.update(error=_wait_error(h)))
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive(), "wait() hung after a worker died"
    assert isinstance(result["error"], nvmeswap.WorkerDied), result
    target = device_tensor(h, size)
    assert h.sync_pread(target, str(tmp_path / "f")) == 1      # a new set of workers
    assert bytes(target.numpy()) == random_bytes(size)


def _wait_error(h):
    try:
        h.wait()
    except Exception as error:
        return error
    return None
