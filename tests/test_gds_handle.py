"""gds_handle's cuFile road, end to end through real worker processes, without a GPU.

The device is the stand-in of stand_in_device.py, the CUDA driver and cuFile are the
fakes of fake_gpu.py: the parent exports "device" memory, the workers map it by the
fake IPC, register it and move the bytes with the fake cuFile, and the tests check the
bytes in the files and in the tensors. Real CUDA and cuFile are tested in test_gpu.py.
"""
import errno
import os
import warnings

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import device_round_trips, random_bytes
from fake_gpu import FAKE_CUDA, FAKE_CUFILE, build
from stand_in_device import StandInCuda, copied, device_tensor, use_stand_in_device

import nvmeswap
import nvmeswap.gds as gpudirect
from nvmeswap import _cuda, errors
from nvmeswap.io import cufile_placement
from nvmeswap.io.placement import HostPlacement

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="session")
def fake_libraries(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fake_gpu")
    return build(folder, "libcufile.so.0", FAKE_CUFILE), build(folder, "libcuda.so.1", FAKE_CUDA)


@pytest.fixture
def gds(fake_libraries, monkeypatch, gds_factory):
    """Make gds_handles that see stand-in device tensors and use the fake libraries."""
    if torch.cuda.is_available():
        pytest.skip("a real GPU is here, and test_gpu.py moves real CUDA tensors: the fake "
                    "CUDA driver, once loaded, would stand in for the real one for the rest "
                    "of this process")
    cufile, cuda = map(str, fake_libraries)
    ok, why = _cuda.load(cuda)
    assert ok, why
    monkeypatch.setattr(gpudirect, "gds_available", lambda: True)
    monkeypatch.setattr(gpudirect, "library_paths", lambda: (cufile, cuda))
    monkeypatch.setattr(gpudirect, "nvidia_fs_loaded", lambda: True)
    monkeypatch.setattr(errors, "_warned", set())
    use_stand_in_device(monkeypatch)
    return gds_factory


def _no_copies():
    """Every byte went through cuFile: the staging copier never ran."""
    return not any(event[0] == "copied" for event in StandInCuda.active.events)


@pytest.mark.parametrize("parallelism", [1, 3])
@pytest.mark.parametrize("pinned", [False, True])
def test_round_trip_through_cufile(gds, tmp_path, parallelism, pinned):
    h = gds(intra_op_parallelism=parallelism)
    device_round_trips(h, tmp_path, [1, 4095, 4097, 256 * KiB + 3, 3 * MiB + 5],
                       [0, 512, 12345], lambda data: device_tensor(h, data, shared=True),
                       lambda tensor: bytes(tensor.numpy()), pinned)
    assert _no_copies()


def test_slices_of_a_pinned_tensor_use_its_registration(gds, tmp_path, monkeypatch):
    # The fake cuFile refuses any buffer that is not registered at the base it is given.
    monkeypatch.setenv("FAKE_CUFILE_REGISTERED_ONLY", "1")
    exported = []

    class CountedRegion(cufile_placement.DeviceRegion):
        def __init__(self, *args):
            super().__init__(*args)
            exported.append(self)

    monkeypatch.setattr(cufile_placement, "DeviceRegion", CountedRegion)
    h = gds(intra_op_parallelism=2)
    whole = device_tensor(h, 4 * MiB, shared=True)
    assert h.pin_device_tensor(whole) and len(exported) == 1
    data = random_bytes(MiB + 3)
    for start in (0, 123, 4096, 2 * MiB + 1):
        piece = whole[start:start + len(data)]
        piece.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        assert h.sync_pwrite(piece, str(tmp_path / "f"), start) == 1
        piece.zero_()
        assert h.sync_pread(piece, str(tmp_path / "f"), start) == 1
        assert bytes(piece.numpy()) == data, f"slice at {start}"
    assert _no_copies() and len(exported) == 1      # every slice used the pinned region


def test_unpinned_tensors_are_registered_on_the_fly(gds, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CUFILE_REGISTERED_ONLY", "1")
    h = gds(intra_op_parallelism=2)
    data = random_bytes(2 * MiB + 5)
    h.sync_pwrite(device_tensor(h, data, shared=True), str(tmp_path / "f"), 7)
    target = device_tensor(h, len(data), shared=True)
    h.sync_pread(target, str(tmp_path / "f"), 7)
    assert bytes(target.numpy()) == data and _no_copies()


def test_unregistered_buffer_where_cufile_demands_registration(gds, tmp_path, monkeypatch):
    # Registration refused (a speed-up only, so not an error by itself), and then a
    # cuFile that moves registered memory only: its error, by name, with the file.
    monkeypatch.setenv("FAKE_CUFILE_REFUSE_REGISTRATION", "1")
    monkeypatch.setenv("FAKE_CUFILE_REGISTERED_ONLY", "1")
    h = gds()
    path = tmp_path / "f"
    with pytest.raises(nvmeswap.CuFileError) as caught:
        h.sync_pwrite(device_tensor(h, random_bytes(MiB), shared=True), str(path))
    assert caught.value.name == "CU_FILE_MEMORY_NOT_REGISTERED"
    assert caught.value.filename == str(path) and str(path) in str(caught.value)
    assert path.stat().st_size == 0        # the file the failed write created holds nothing


@pytest.mark.parametrize("parallelism", [1, 3])
def test_a_file_cufile_refuses_takes_the_staging_road_and_others_still_cufile(
        gds, tmp_path, monkeypatch, parallelism):
    """Note [cuFile refusing a file]: cuFile loads but refuses a file (status 5027, as on a
    cloud VM without nvidia-fs): that file's CUDA tensors go through locked host memory,
    after one warning; it used to raise CU_FILE_HANDLE_NOT_REGISTERED."""
    monkeypatch.setenv("FAKE_CUFILE_REFUSE_FILES", "5027")
    monkeypatch.setenv("FAKE_CUFILE_REFUSE_MATCHING", "refused")
    h = gds(intra_op_parallelism=parallelism)
    refused, accepted = tmp_path / "refused.bin", tmp_path / "accepted.bin"
    data = random_bytes(3 * MiB + 5, seed=1)
    written = device_tensor(h, data, shared=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert h.sync_pwrite(written, str(refused), 7) == 1
    said = [str(w.message) for w in caught if w.category is nvmeswap.GdsFallbackWarning]
    assert len(said) == 1 and "CU_FILE_HANDLE_NOT_REGISTERED" in said[0]
    assert str(refused) in said[0] and " at " in said[0]       # the file and its filesystem
    assert refused.read_bytes()[7:] == data
    assert copied(written) == len(data)     # it went through host memory
    # The file's later operations go there at once; async, read back, bytes compared.
    back = device_tensor(h, len(data), shared=True)
    h.async_pread(back, str(refused), 7)
    assert h.wait() == 1 and bytes(back.numpy()) == data and copied(back) == len(data)
    # Another file still goes through cuFile: no staging copy for it.
    source = device_tensor(h, data, shared=True)
    h.sync_pwrite(source, str(accepted))
    target = device_tensor(h, len(data), shared=True)
    h.sync_pread(target, str(accepted))
    assert bytes(target.numpy()) == data and copied(source) == copied(target) == 0


def test_missing_and_short_files(gds, tmp_path):
    h = gds()
    with pytest.raises(FileNotFoundError) as caught:
        h.sync_pread(device_tensor(h, MiB, shared=True), str(tmp_path / "missing"))
    assert caught.value.filename == str(tmp_path / "missing")
    (tmp_path / "short").write_bytes(bytes(MiB - 1))
    with pytest.raises(nvmeswap.ShortFileError, match="short"):
        h.sync_pread(device_tensor(h, MiB, shared=True), str(tmp_path / "short"))


def test_cufile_configuration_is_passed_explicitly(gds, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    h = gds(cufile_config={"properties": {"allow_compat_mode": True}})
    data = random_bytes(MiB)
    assert h.sync_pwrite(device_tensor(h, data, shared=True), "f") == 1
    refusing = gds(cufile_config={"fail_driver_open": True})
    with pytest.raises(nvmeswap.CuFileError) as caught:
        refusing.sync_pwrite(device_tensor(refusing, data, shared=True), "g")
    assert caught.value.name == "CU_FILE_DRIVER_INVALID_PROPS"
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["f", "g"])   # no config file
    with pytest.raises(ValueError, match="not a cuFile JSON"):
        (tmp_path / "bad.json").write_text("{")
        gds(cufile_config=str(tmp_path / "bad.json"))


def test_memory_that_cannot_be_exported_takes_the_aio_road(gds, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_NO_IPC", "1")
    h = gds(intra_op_parallelism=2)
    data = random_bytes(3 * MiB + 1)
    with pytest.warns(nvmeswap.GdsFallbackWarning, match="CUDA_ERROR_NOT_SUPPORTED"):
        assert h.pin_device_tensor(device_tensor(h, 16, shared=True)) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error", nvmeswap.GdsFallbackWarning)     # once, not per operation
        h.sync_pwrite(device_tensor(h, data, shared=True), str(tmp_path / "f"))
        target = device_tensor(h, len(data), shared=True)
        h.sync_pread(target, str(tmp_path / "f"))
    assert bytes(target.numpy()) == data
    assert copied(target) == len(data)     # staged through host memory


def test_workers_let_go_of_device_memory(gds, tmp_path):
    """An operation's mapping ends with it; a pinned tensor's with unpin."""
    h = gds()
    worker = h._scheduler.workers.pool.workers[0].process.pid
    host = torch.ones(2 * MiB, dtype=torch.uint8)

    def worker_maps_device_memory():
        h.sync_pwrite(host, str(tmp_path / "sync"))     # the worker has run what came before
        with open(f"/proc/{worker}/maps") as maps:
            return "stand-in-device" in maps.read()

    h.sync_pwrite(device_tensor(h, random_bytes(MiB), shared=True), str(tmp_path / "f"))
    assert not worker_maps_device_memory()
    pinned = device_tensor(h, MiB, shared=True)
    assert h.pin_device_tensor(pinned)
    h.sync_pread(pinned, str(tmp_path / "f"))
    assert worker_maps_device_memory()
    assert h.unpin_device_tensor(pinned) and not h.unpin_device_tensor(pinned)
    assert not worker_maps_device_memory()


def test_unpinned_while_held_the_workers_still_let_go(gds, tmp_path):
    """A read into a pinned tensor held behind a write (Note [ordering]), the tensor
    unpinned before it is sent: the worker maps it for the read and unmaps it after."""
    h = gds()
    worker = h._scheduler.workers.pool.workers[0].process.pid
    path = str(tmp_path / "f")
    data = random_bytes(MiB, seed=2)
    h.sync_pwrite(torch.frombuffer(bytearray(data), dtype=torch.uint8), path)

    def worker_maps_device_memory():
        h.sync_pwrite(torch.ones(2 * MiB, dtype=torch.uint8), str(tmp_path / "sync"))
        with open(f"/proc/{worker}/maps") as maps:
            return "stand-in-device" in maps.read()

    pinned = device_tensor(h, MiB, shared=True)
    assert h.pin_device_tensor(pinned)
    h.async_pwrite(torch.frombuffer(bytearray(data * 64), dtype=torch.uint8), path, MiB)
    h.async_pread(pinned, path)     # overlaps nothing of the write: not held ...
    held = device_tensor(h, MiB, shared=True)
    assert h.pin_device_tensor(held)
    h.async_pread(held, path, MiB)  # ... this one is, behind the write
    assert h._scheduler.books.held
    assert h.unpin_device_tensor(held) and h.unpin_device_tensor(pinned)
    assert h.wait() == 3
    assert bytes(pinned.numpy()) == data and bytes(held.numpy()) == data
    assert not worker_maps_device_memory()


def test_a_refused_operation_that_cannot_be_staged_fails_and_ends(gds, tmp_path, monkeypatch):
    """Note [cuFile refusing a file]: where the staging road cannot take the operation
    again (no staging memory, say), it fails with that error; nothing is left in the
    books, and the handle goes on."""
    monkeypatch.setenv("FAKE_CUFILE_REFUSE_FILES", "5027")
    monkeypatch.setenv("FAKE_CUFILE_REFUSE_MATCHING", "refused")
    h = gds()
    data = random_bytes(MiB, seed=1)
    real = HostPlacement.place

    def place(self, op):
        if op.buffer.device is not None:
            raise OSError(errno.EMFILE, "no staging memory (simulated)")
        return real(self, op)

    monkeypatch.setattr(HostPlacement, "place", place)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nvmeswap.GdsFallbackWarning)
        with pytest.raises(OSError, match="simulated"):
            h.sync_pwrite(device_tensor(h, data, shared=True), str(tmp_path / "refused"))
    assert not h._scheduler.books.ops and h.wait() == 0
    monkeypatch.setattr(HostPlacement, "place", real)
    back = device_tensor(h, len(data), shared=True)
    h.sync_pwrite(device_tensor(h, data, shared=True), str(tmp_path / "refused"))
    h.sync_pread(back, str(tmp_path / "refused"))
    assert bytes(back.numpy()) == data


def test_pin_takes_device_tensors_only(gds):
    h = gds()
    with pytest.raises(TypeError, match="CUDA tensors"):
        h.pin_device_tensor(torch.zeros(4))
    assert h.unpin_device_tensor(torch.zeros(4)) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="here it makes a CUDA tensor")
def test_device_tensor_calls_without_cuda_say_what_is_wrong(tmp_path, monkeypatch):
    """Without a GPU, new_pinned_device_tensor says CUDA is missing (not torch's
    AssertionError); a closed handle says it is closed; a non-tensor and a cuFile
    configuration that is not a JSON object are refused by name."""
    monkeypatch.setattr(errors, "_warned", set())
    with pytest.warns(nvmeswap.GdsFallbackWarning):
        h = nvmeswap.gds_handle()
    try:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            h.new_pinned_device_tensor(10, torch.zeros(1))
        with pytest.raises(TypeError, match="takes a tensor, got NoneType"):
            h.free_pinned_device_tensor(None)
    finally:
        h.close()
    with pytest.raises(ValueError, match="closed"):
        h.new_pinned_device_tensor(10, torch.zeros(1))
    config = tmp_path / "cufile.json"
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list, not an object"):
        nvmeswap.gds_handle(cufile_config=str(config))


def test_without_cufile_gds_handle_warns_once_and_works(tmp_path, monkeypatch):
    monkeypatch.setattr(gpudirect, "gds_available", lambda: False)
    monkeypatch.setattr(gpudirect, "gds_unavailable_reason", lambda: "cuFile could not be loaded")
    monkeypatch.setattr(errors, "_warned", set())
    use_stand_in_device(monkeypatch)
    with pytest.warns(nvmeswap.GdsFallbackWarning, match="cuFile could not be loaded"):
        h = nvmeswap.gds_handle()
    try:
        data = random_bytes(MiB + 1)
        assert h.pin_device_tensor(device_tensor(h, 16)) is False
        h.sync_pwrite(device_tensor(h, data), str(tmp_path / "f"))
        target = torch.zeros(len(data), dtype=torch.uint8)
        h.sync_pread(target, str(tmp_path / "f"))
        assert bytes(target.numpy()) == data
    finally:
        h.close()


def test_without_o_direct_device_bytes_go_the_buffered_way(gds, tmp_path):
    h = gds(o_direct=False, intra_op_parallelism=2)
    data = random_bytes(3 * MiB + 7)
    h.sync_pwrite(device_tensor(h, data, shared=True), str(tmp_path / "f"), 5)
    target = device_tensor(h, len(data), shared=True)
    h.sync_pread(target, str(tmp_path / "f"), 5)
    assert bytes(target.numpy()) == data and _no_copies()
