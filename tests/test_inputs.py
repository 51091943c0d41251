"""Whatever a user may hand a handle: every kind of tensor, odd paths, extreme offsets, low
descriptor limits, many handles. Each is done exactly or refused up front, by name."""
import errno
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes

import nvmeswap

MiB = 1 << 20
PACKAGE_ROOT = os.path.dirname(os.path.dirname(nvmeswap.__file__))


def _round_trip(h, tensor, path):
    """Write ``tensor``, read the file back into a fresh tensor and return that."""
    h.sync_pwrite(tensor, path)
    back = torch.empty_like(tensor.resolve_conj().resolve_neg()).contiguous()
    h.sync_pread(back, path)
    return back


DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.uint16, torch.uint32, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.complex32, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.bits8, torch.bits16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 1023, 70_001])
def test_every_dtype_round_trips_its_bytes(handle, tmp_path, dtype, numel):
    raw = torch.frombuffer(bytearray(random_bytes(numel * torch.empty((), dtype=dtype)
                                                  .element_size())), dtype=torch.uint8)
    tensor = raw.view(dtype)
    back = _round_trip(handle, tensor, tmp_path / "t")
    assert bytes(back.view(torch.uint8).numpy()) == bytes(raw.numpy())
    assert os.path.getsize(tmp_path / "t") == raw.numel()


def test_views_write_the_values_they_show(handle, tmp_path):
    z = torch.randn(5000, dtype=torch.complex64)
    # A conjugate view holds z in memory but shows conj(z): conj(z) is what must be written.
    back = _round_trip(handle, z.conj(), tmp_path / "conj")
    assert torch.equal(back, z.conj().resolve_conj())
    x = torch.randn(5000)
    back = _round_trip(handle, torch._neg_view(x), tmp_path / "neg")
    assert torch.equal(back, -x)
    scalar = torch.tensor(3.25, dtype=torch.float64)       # zero-dim
    back = _round_trip(handle, scalar, tmp_path / "scalar")
    assert back.shape == () and back.item() == 3.25
    storage = torch.arange(100_000, dtype=torch.int32)
    window = storage[12_345:67_890]                         # an offset into a storage
    back = _round_trip(handle, window, tmp_path / "window")
    assert torch.equal(back, window)


def test_views_that_cannot_hold_what_is_read_are_refused_before_io(handle, tmp_path):
    (tmp_path / "f").write_bytes(random_bytes(80_000))
    z = torch.zeros(5000, dtype=torch.complex64)
    before = z.clone()
    with pytest.raises(ValueError, match="conjugate or negative view"):
        handle.sync_pread(z.conj(), tmp_path / "f")
    with pytest.raises(ValueError, match="conjugate or negative view"):
        handle.sync_pread(torch._neg_view(torch.zeros(100)), tmp_path / "f")
    with pytest.raises(ValueError, match="not contiguous"):
        handle.sync_pread(torch.zeros(100, 2)[:, 0], tmp_path / "f")
    assert torch.equal(z, before)
    with pytest.raises(TypeError, match="dense tensors"):
        handle.sync_pwrite(torch.randn(10).to_sparse(), tmp_path / "g")
    with pytest.raises(TypeError, match="quantized"):
        handle.sync_pwrite(torch.quantize_per_tensor(torch.randn(10), 0.1, 0, torch.qint8),
                           tmp_path / "g")
    with pytest.raises(TypeError, match="CPU and CUDA"):
        handle.sync_pwrite(torch.empty(10, device="meta"), tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_memory_mapped_tensors_and_arrays(handle, tmp_path):
    source = tmp_path / "mapped"
    source.write_bytes(random_bytes(3 * MiB + 5))
    mapped = torch.from_file(str(source), shared=True, size=3 * MiB + 5, dtype=torch.uint8)
    handle.sync_pwrite(mapped, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == source.read_bytes()
    array = np.memmap(tmp_path / "target", dtype=np.uint8, mode="w+", shape=(3 * MiB + 5,))
    handle.sync_pread(array, tmp_path / "copy")
    array.flush()
    assert (tmp_path / "target").read_bytes() == source.read_bytes()
    readonly = np.memmap(tmp_path / "target", dtype=np.uint8, mode="r")
    with pytest.raises(TypeError, match="read-only"):
        handle.sync_pread(readonly, tmp_path / "copy")


@pytest.mark.parametrize("name", [b"with space", b"new\nline", b"not utf-8 \xff\xfe",
                                  b"n" * 255])
def test_names_any_bytes_and_name_max(handle, tmp_path, name):
    path = os.path.join(os.fsencode(tmp_path), name)
    data = bytearray(random_bytes(70_000))
    handle.sync_pwrite(data, path)
    back = bytearray(len(data))
    handle.sync_pread(back, os.fsdecode(path))      # the same file by its str name
    assert back == data


def test_name_too_long_and_bad_descriptors_are_named(handle, tmp_path):
    long_name = tmp_path / ("n" * 256)
    with pytest.raises(OSError) as info:
        handle.sync_pwrite(bytearray(10), long_name)
    assert info.value.errno == errno.ENAMETOOLONG and info.value.filename == str(long_name)
    for fd in (-1, 2**20):
        with pytest.raises(OSError) as info:
            handle.async_pwrite(bytearray(10), fd)
        assert info.value.errno == errno.EBADF and info.value.filename == f"<fd {fd}>"
    assert handle.wait() == 0


def test_special_files_are_refused_without_blocking(handle, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device"),
                       ("/dev/null", "a character device")):
        for call in (handle.sync_pread, handle.sync_pwrite, handle.async_pread):
            with pytest.raises(OSError) as info:
                call(bytearray(4096), path)
            assert info.value.errno == errno.EINVAL and kind in str(info.value)
            assert info.value.filename == str(path)
    warnings.simplefilter("ignore", nvmeswap.BufferedIOWarning)
    with pytest.raises(nvmeswap.ShortFileError, match="0 bytes long"):    # procfs
        handle.sync_pread(bytearray(100), "/proc/self/status")
    assert handle.wait() == 0


def test_a_file_renamed_or_replaced_during_a_read_is_read_as_opened(handle_factory, tmp_path):
    h = handle_factory(block_size=4096, queue_depth=1)
    data = random_bytes(32 * MiB)
    (tmp_path / "f").write_bytes(data)
    target = h.new_cpu_locked_tensor(len(data), torch.empty(0, dtype=torch.uint8))
    h.async_pread(target, tmp_path / "f")
    os.rename(tmp_path / "f", tmp_path / "g")
    (tmp_path / "f").write_bytes(b"\0" * len(data))
    assert h.wait() == 1 and bytes(target.numpy()) == data


def test_offsets_up_to_the_63_bit_limit(handle, tmp_path):
    path = tmp_path / "far"
    for offset in (2**63, 2**64, 2**63 - 5, -1):
        with pytest.raises(ValueError, match="file_offset"):
            handle.sync_pwrite(bytearray(10), path, offset)
    assert not path.exists()
    with pytest.raises(OSError) as info:     # beyond what ext4 and tmpfs hold
        handle.sync_pwrite(bytearray(10), path, 2**63 - 11)
    assert info.value.errno in (errno.EFBIG, errno.EINVAL) and info.value.filename == str(path)
    handle.sync_pwrite(bytearray(b"far away"), path, np.int64(2**40 + 3))
    back = bytearray(8)
    handle.sync_pread(back, path, 2**40 + 3)
    assert back == b"far away" and os.path.getsize(path) == 2**40 + 11


DESCRIPTOR_LIMIT = """
    import os, resource, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np, torch
    import nvmeswap
    from nvmeswap.io.limits import Limits
    from nvmeswap.io.roads import ALWAYS_OPEN
    workers_only = Limits(roads=ALWAYS_OPEN)    # every operation through the workers' sockets
    folder, limit, parallelism = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    rng = np.random.default_rng(limit + parallelism)
    with nvmeswap.aio_handle(intra_op_parallelism=parallelism, block_size=65536,
                             _limits=workers_only) as h:
        locked = h.new_cpu_locked_tensor(1000 * 8192, torch.empty(0, dtype=torch.uint8))
        plain = torch.zeros(1000 * 8192, dtype=torch.uint8)
        for buffer in (locked, plain):
            buffer.copy_(torch.from_numpy(rng.integers(0, 256, buffer.numel(), dtype=np.uint8)))
            for aligned in (True, False):
                size = 8192 if aligned else 8000
                path = os.path.join(folder, f"f{aligned}")
                for i in range(1000):
                    h.async_pwrite(buffer[i * 8192:i * 8192 + size], path, i * size)
                assert h.wait() == 1000
                back = torch.zeros_like(buffer)
                for i in range(1000):
                    h.async_pread(back[i * 8192:i * 8192 + size], path, i * size)
                assert h.wait() == 1000
                for i in range(1000):
                    piece = slice(i * 8192, i * 8192 + size)
                    assert torch.equal(back[piece], buffer[piece]), (aligned, i)
    print("ok")
"""


@pytest.mark.parametrize("limit", [64, 256])
@pytest.mark.parametrize("parallelism", [1, 2])
def test_a_thousand_operations_in_flight_under_a_low_descriptor_limit(tmp_path, limit,
                                                                      parallelism):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(DESCRIPTOR_LIMIT),
                             PACKAGE_ROOT, str(tmp_path), str(limit), str(parallelism)],
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.fixture
def loop_device(tmp_path):
    """An 8 MiB block device over a file of the test's own (needs root and losetup)."""
    if os.geteuid() != 0:
        pytest.skip("attaching a loop device needs root (CAP_SYS_ADMIN outside any user "
                    "namespace), and no other block device is a user's to write")
    losetup = shutil.which("losetup", path=os.pathsep.join([os.environ.get("PATH", ""),
                                                            "/usr/sbin", "/sbin"]))
    if losetup is None:
        pytest.skip("losetup (util-linux) is not installed")
    backing = tmp_path / "backing"
    backing.write_bytes(b"\0" * (8 * MiB))
    result = subprocess.run([losetup, "-f", "--show", str(backing)], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot attach a loop device here: {result.stderr.strip()}")
    device = result.stdout.strip()
    try:
        yield device
    finally:
        subprocess.run([losetup, "-d", device], check=True)


def test_a_block_device_at_any_offset(handle, loop_device):
    data = bytearray(random_bytes(MiB + 3))
    handle.sync_pwrite(data, loop_device, 3 * 4096 + 5)
    back = bytearray(len(data))
    handle.sync_pread(back, loop_device, 3 * 4096 + 5)
    assert back == data
    with pytest.raises(nvmeswap.ShortFileError) as info:     # its end is its size
        handle.sync_pread(bytearray(10), loop_device, 8 * MiB - 5)
    assert info.value.filename == loop_device


@pytest.mark.parametrize("text", ["1IB", "2\u00b2", "\u0661\u0662", "0x10", "-1K", "1.5M", "",
                                  "K", "1KK"])
def test_a_size_is_ascii_digits_and_one_suffix(text):
    """Note [units]: a size is ASCII digits and an optional K, M, G or T (KiB, KB...);
    anything else (a lone "IB", a superscript, another script's digits) is refused."""
    from nvmeswap.units import parse_size

    assert [parse_size(t) for t in ("7", "1K", "1kib", "2MB", "1B")] == [
        7, 1024, 1024, 2 << 20, 1]
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_o_direct_required_where_the_filesystem_refuses_it(filesystem_without_o_direct):
    """o_direct=True on a filesystem that refuses O_DIRECT: an error saying so, naming the
    file, and no file made by the refused write (Linux makes it, then refuses)."""
    folder = filesystem_without_o_direct
    (folder / "old").write_bytes(b"x" * 8192)
    with nvmeswap.aio_handle(o_direct=True) as h:
        for call, path in ((h.sync_pwrite, folder / "new"), (h.sync_pread, folder / "old"),
                           (h.async_pwrite, folder / "new")):
            with pytest.raises(OSError) as raised:
                call(np.ones(8192, np.uint8), str(path))
            assert raised.value.errno == errno.EINVAL and raised.value.filename == str(path)
            assert "the filesystem refuses O_DIRECT (o_direct=True" in str(raised.value)
    assert os.listdir(folder) == ["old"]
