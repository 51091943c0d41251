"""CUDA tensors for real: aio_handle's staging ring and gds_handle's cuFile road.

These need an NVIDIA GPU (and, for gds_handle, cuFile); elsewhere they skip with the
reason. Without a GPU the same roads are covered by test_device_pipeline.py and
test_gds_handle.py with a stand-in device.
"""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import device_round_trips, random_bytes

import nvmeswap

MiB = 1 << 20
SIZES = [1, 4095, 4097, MiB + 3, 40 * MiB + 5]
OFFSETS = [0, 512, 12345]

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
needs_gds = pytest.mark.skipif(not (torch.cuda.is_available() and nvmeswap.gds_available()),
                               reason="no CUDA GPU with cuFile here: "
                                      f"{nvmeswap.gds_unavailable_reason() or 'no GPU'}")
pytestmark = needs_gpu


@pytest.fixture(scope="module", autouse=True)
def cuda_warmed_up(tmp_path_factory):
    """CUDA opens device files as it starts and on first use of each road; let that
    happen before the per-test leak check takes its "before" picture."""
    folder = tmp_path_factory.mktemp("warm-up")
    tensor = torch.ones(MiB, dtype=torch.uint8, device="cuda")
    handles = [nvmeswap.aio_handle]
    if nvmeswap.gds_available():
        handles.append(nvmeswap.gds_handle)
    for make in handles:
        with make() as h:
            h.sync_pwrite(tensor, str(folder / "f"))
            h.sync_pread(tensor, str(folder / "f"))
    torch.cuda.synchronize()


def gpu_bytes(data):
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()


def host_bytes(tensor):
    return bytes(tensor.cpu().numpy())


def _round_trips(h, tmp_path, *, pin=False):
    def make(data):
        if isinstance(data, bytes):
            return gpu_bytes(data)
        return torch.zeros(data, dtype=torch.uint8, device="cuda")

    device_round_trips(h, tmp_path, SIZES, OFFSETS, make, host_bytes, pin)


@pytest.mark.parametrize("parallelism", [1, 2])
def test_aio_round_trips_of_cuda_tensors(handle_factory, tmp_path, parallelism):
    _round_trips(handle_factory(intra_op_parallelism=parallelism), tmp_path)


def test_aio_respects_the_callers_stream(handle_factory, tmp_path):
    """A write sees the work queued before it; a read is visible to work queued after wait()."""
    h = handle_factory(intra_op_parallelism=2)
    n = 16 * MiB
    stream = torch.cuda.Stream()
    expected = (torch.arange(n, dtype=torch.int64) * 7 % 251).to(torch.uint8)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)               # the kernel below finishes late
        produced = (torch.arange(n, dtype=torch.int64, device="cuda") * 7 % 251).to(torch.uint8)
        h.sync_pwrite(produced, str(tmp_path / "f"))
        target = torch.empty(n, dtype=torch.uint8, device="cuda")
        h.async_pread(target, str(tmp_path / "f"))
        assert h.wait() == 1
        checksum = target.to(torch.int64).sum()     # queued after wait() on the same stream
    assert (tmp_path / "f").read_bytes() == bytes(expected.numpy())
    assert checksum.item() == expected.to(torch.int64).sum().item()


def test_locked_tensors_are_pinned_for_cuda_copies(handle):
    torch.cuda.init()
    locked = handle.new_cpu_locked_tensor(MiB, torch.empty(0, dtype=torch.uint8))
    assert locked.is_pinned()


@needs_gds
@pytest.mark.parametrize("parallelism", [1, 2])
@pytest.mark.parametrize("pin", [False, True])
def test_gds_round_trips(gds_factory, tmp_path, parallelism, pin):
    _round_trips(gds_factory(intra_op_parallelism=parallelism), tmp_path, pin=pin)


@pytest.mark.parametrize("make", ["aio", "gds"])
def test_batches_of_slices_of_one_cuda_tensor(handle_factory, gds_factory, tmp_path, make):
    """Each request of a batch cut from one CUDA tensor moves its own bytes."""
    if make == "gds" and not nvmeswap.gds_available():
        pytest.skip(f"no cuFile here: {nvmeswap.gds_unavailable_reason()}")
    h = handle_factory() if make == "aio" else gds_factory()
    length, count = 64 * 1024 + 512, 4
    data = random_bytes(length * count, seed=5)
    offsets = [k * 80 * 1024 for k in reversed(range(count))]
    expected = bytearray(offsets[0] + length)
    for k, offset in enumerate(offsets):
        expected[offset:offset + length] = data[k * length:(k + 1) * length]
    path = tmp_path / "f"
    h.async_pwrite_many(gpu_bytes(data), str(path), offsets, lengths=[length] * count)
    assert h.wait() == count
    assert path.read_bytes() == bytes(expected)
    target = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
    h.async_pread_many(target, str(path), offsets, lengths=[length] * count)
    assert h.wait() == count
    assert host_bytes(target) == data


@needs_gds
def test_gds_small_reads_are_in_the_tensor_when_wait_returns(gds_factory, tmp_path):
    """A read under a block goes around cuFile: the worker copies the bytes to the device
    with cuMemcpyHtoD from pageable memory, which may return before they land. wait() must
    not return before they are in the tensor (on an H200 about one read in a hundred
    showed the tensor's old bytes before the worker synchronized its context)."""
    h = gds_factory()
    data = random_bytes(1 << 16)
    path = tmp_path / "f"
    path.write_bytes(data)
    for k in range(400):
        size = 1 + k * 97 % 4095
        offset = k * 131 % (len(data) - size)
        target = torch.zeros(size, dtype=torch.uint8, device="cuda")
        assert h.async_pread(target, str(path), offset) == 0 and h.wait() == 1
        assert host_bytes(target) == data[offset:offset + size], f"read {k}"


@needs_gds
def test_gds_pinned_tensors_and_their_slices(gds_factory, tmp_path):
    h = gds_factory(intra_op_parallelism=2)
    whole = h.new_pinned_device_tensor(8 * MiB, torch.empty(0, dtype=torch.uint8, device="cuda"))
    data = random_bytes(MiB + 3)
    for start in (0, 123, 4096, 3 * MiB + 1):
        piece = whole[start:start + len(data)]
        piece.copy_(gpu_bytes(data))
        assert h.sync_pwrite(piece, str(tmp_path / "f"), start) == 1
        piece.zero_()
        assert h.sync_pread(piece, str(tmp_path / "f"), start) == 1
        assert host_bytes(piece) == data, f"slice at {start}"
    assert h.free_pinned_device_tensor(whole) and not h.free_pinned_device_tensor(whole)


@needs_gds
def test_gds_errors_name_the_file(gds_factory, tmp_path):
    h = gds_factory()
    target = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(FileNotFoundError) as caught:
        h.sync_pread(target, str(tmp_path / "missing"))
    assert caught.value.filename == str(tmp_path / "missing")
    (tmp_path / "short").write_bytes(bytes(MiB - 1))
    with pytest.raises(nvmeswap.ShortFileError):
        h.sync_pread(target, str(tmp_path / "short"))
    assert h.unpin_device_tensor(target) is False       # never pinned


@needs_gds
def test_gds_on_a_non_default_stream(gds_factory, tmp_path):
    h = gds_factory(intra_op_parallelism=2)
    n = 16 * MiB
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        produced = torch.full((n,), 42, dtype=torch.uint8, device="cuda")
        h.sync_pwrite(produced, str(tmp_path / "f"))
    assert (tmp_path / "f").read_bytes() == bytes([42]) * n


@pytest.mark.parametrize("road", ["--gpu", pytest.param("--gds", marks=needs_gds)])
def test_bench_moves_cuda_tensors(tmp_path, road):
    from test_cli import nvmeswap_command

    result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "64M", "--loops", 1,
                              "--validate", road)
    assert result.returncode == 0, result.stderr
    assert "Task Read Speed" in result.stdout and "Task Write Speed" in result.stdout
