"""Checkpoints of CUDA state for real: save, load, load_into, async_save, safetensors and
DCP with the tensors on the GPU, bit for bit against what was saved.

These need an NVIDIA GPU; elsewhere they skip with the reason.
"""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from test_checkpoint import DTYPES, assert_same, assert_saved_as_torch_saves, random_tensor

import nvmeswap

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")


def cuda_state():
    """Every dtype on the GPU, nested containers, a view sharing its base's storage, a
    non-contiguous tensor, a CPU tensor beside them and Python values."""
    base = random_tensor((64, 33), torch.float32, 1).cuda()
    return {
        "tensors": {str(dtype): random_tensor((257, 3), dtype, index).cuda()
                    for index, dtype in enumerate(DTYPES)},
        "base": base,
        "view": base[5:9],
        "columns": base.t(),
        "list": [random_tensor((1 << 20) + 3, torch.bfloat16, 7).cuda(), 3.5, "text"],
        "host": random_tensor((100,), torch.int16, 8),
        "step": 12,
    }


def on_device(obj):
    """Each tensor of ``obj`` with the device it is on."""
    if isinstance(obj, torch.Tensor):
        return [obj.device.type]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [device for item in obj for device in on_device(item)]
    return []


def test_torch_load_reads_cuda_state_saved_by_nvmeswap(tmp_path):
    state = cuda_state()
    nvmeswap.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt")
    assert_same(state, loaded)
    assert on_device(loaded) == on_device(state)
    assert loaded["view"].untyped_storage().data_ptr() == \
        loaded["base"].untyped_storage().data_ptr()


def test_a_cuda_state_s_file_is_torch_s_byte_for_byte(tmp_path):
    """Note [CUDA state layout] and Note [laying out many tensors]: the storages named by
    the pickler and the layout's own reduction of CUDA tensors give torch's archive."""
    state = cuda_state()
    state["grad"] = random_tensor((33,), torch.float32, 9).cuda().requires_grad_()
    assert_saved_as_torch_saves(state, tmp_path)


@pytest.mark.parametrize("writer", ["torch", "nvmeswap"])
def test_nvmeswap_load_puts_cuda_state_back_on_the_gpu(tmp_path, writer):
    state = cuda_state()
    path = tmp_path / "state.pt"
    (torch.save if writer == "torch" else nvmeswap.save)(state, path)
    loaded = nvmeswap.load(path)
    assert_same(state, loaded)
    assert on_device(loaded) == on_device(state)
    on_host = nvmeswap.load(path, map_location="cpu")
    assert set(on_device(on_host)) == {"cpu"}
    assert_same(on_cpu(state), on_host)


def on_cpu(obj, moved=None):
    """A host copy of ``obj``: each storage copied once, views kept views of it."""
    moved = {} if moved is None else moved
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() not in moved:
            moved[storage.data_ptr()] = storage.cpu() if obj.is_cuda else storage.clone()
        return torch.empty(0, dtype=obj.dtype).set_(
            moved[storage.data_ptr()], obj.storage_offset(), obj.shape, obj.stride())
    if isinstance(obj, dict):
        return {key: on_cpu(value, moved) for key, value in obj.items()}
    if isinstance(obj, list):
        return [on_cpu(value, moved) for value in obj]
    return obj


def test_load_into_fills_cuda_tensors_in_place(tmp_path):
    state = {"w": random_tensor((1000, 257), torch.float32, 3).cuda(),
             "b": random_tensor((4097,), torch.bfloat16, 4).cuda(), "step": 9}
    nvmeswap.save(state, tmp_path / "state.pt")
    into = {"w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"]), "step": 0}
    addresses = [into["w"].data_ptr(), into["b"].data_ptr()]
    nvmeswap.load_into(tmp_path / "state.pt", into)
    assert [into["w"].data_ptr(), into["b"].data_ptr()] == addresses
    assert torch.equal(into["w"].view(torch.int32), state["w"].view(torch.int32))
    assert torch.equal(into["b"].view(torch.int16), state["b"].view(torch.int16))


@pytest.mark.parametrize("form", ["kept", "background", "one call"])
def test_async_save_of_cuda_state_keeps_the_bytes_of_the_call(tmp_path, form):
    state = cuda_state()
    expected = on_cpu(state)
    with nvmeswap.Checkpointer() as saver:
        if form == "one call":      # its snapshot: clones on the GPU
            future = nvmeswap.async_save(state, tmp_path / "state.pt")
        else:
            future = saver.async_save(state, tmp_path / "state.pt",
                                      background_snapshot=form == "background")
        future.snapshot_taken.result()
        state["base"].add_(1)               # the next step changes the state
        state["list"][0].zero_()
        state["host"].fill_(-1)
        future.result()
    assert_same(expected, torch.load(tmp_path / "state.pt", map_location="cpu"))


def test_safetensors_of_cuda_tensors_round_trip(tmp_path):
    pytest.importorskip("safetensors", reason="needs safetensors (pip install safetensors)")
    tensors = {f"t{index}": random_tensor((513, 7), dtype, index).cuda()
               for index, dtype in enumerate([torch.float32, torch.bfloat16, torch.int8])}
    nvmeswap.save_safetensors(tensors, tmp_path / "state.safetensors")
    into = {key: torch.zeros_like(value) for key, value in tensors.items()}
    nvmeswap.load_safetensors_into(tmp_path / "state.safetensors", into)
    for key, value in tensors.items():
        assert torch.equal(into[key].view(torch.uint8), value.view(torch.uint8)), key


def test_dcp_writer_and_reader_with_cuda_state(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from nvmeswap.checkpoint.dcp import NvmeFileSystemReader, NvmeFileSystemWriter

    state = {f"layer{index}": random_tensor((1000, 100 + index), torch.float32, index).cuda()
             for index in range(4)}
    dcp.save(state, storage_writer=NvmeFileSystemWriter(tmp_path / "ours"))
    for reader in (NvmeFileSystemReader(tmp_path / "ours"),
                   dcp.FileSystemReader(tmp_path / "ours")):
        into = {key: torch.zeros_like(value) for key, value in state.items()}
        dcp.load(into, storage_reader=reader)
        for key, value in state.items():
            assert into[key].is_cuda
            assert torch.equal(into[key].view(torch.int32), value.view(torch.int32)), \
                (type(reader).__name__, key)


def test_a_background_snapshot_sees_the_work_queued_before_the_call(tmp_path):
    """Note [stream order]: the saving thread copies on a stream of its own; it must wait
    for what the caller queued (on a side stream here, behind a long sleep) first."""
    state = {"w": torch.zeros(1 << 20, device="cuda")}
    fresh = random_tensor((1 << 20,), torch.float32, 5).cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with nvmeswap.Checkpointer() as saver:
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 30)      # about half a second
            state["w"].copy_(fresh)
            future = saver.async_save(state, tmp_path / "state.pt", background_snapshot=True)
        future.result()
    loaded = torch.load(tmp_path / "state.pt", map_location="cpu")
    assert torch.equal(loaded["w"].view(torch.int32), fresh.cpu().view(torch.int32))


def test_loads_of_cuda_state_leave_no_locked_memory_behind(tmp_path):
    """Note [checkpoint reads]: the locked buffers a CUDA checkpoint is read into through
    a handle leave the locked set once their storages are on the GPU."""
    state = {"w": random_tensor((3 << 20,), torch.float32, 11).cuda(),
             "b": random_tensor((1 << 20,), torch.bfloat16, 12).cuda(), "step": 3}
    nvmeswap.save(state, tmp_path / "state.pt")
    with nvmeswap.aio_handle() as handle, nvmeswap.Checkpointer(handle) as loader:
        before = loader.handle.memory_in_use
        for _ in range(2):
            assert_same(state, loader.load(tmp_path / "state.pt"))
            assert loader.handle.memory_in_use == before


def test_calls_without_a_handle_start_no_worker_and_leave_nothing_registered(tmp_path,
                                                                            monkeypatch):
    """Note [own queue and CUDA]: with CUDA in use, the calls made without a handle keep
    to the process's own queue, and register with CUDA for their copies only while
    they need it."""
    from test_checkpoint_fresh import refuse_workers

    from nvmeswap.checkpoint import own_queue

    registered = {}     # address -> size, while registered
    made = []           # the size of each registration, in order
    register_range = own_queue.register_range

    def recorded(address, size):
        unregister = register_range(address, size)
        assert unregister is not None, "CUDA refused a registration"
        registered[address] = size
        made.append(size)

        def recorded_unregister():
            del registered[address]
            unregister()
        return recorded_unregister

    monkeypatch.setattr(own_queue, "register_range", recorded)
    refuse_workers(monkeypatch)
    state = cuda_state()
    path = tmp_path / "state.pt"
    nvmeswap.save(state, path)
    assert len(made) == 1 and registered == {}          # the ring, for the call
    assert_same(state, torch.load(path))
    loaded = nvmeswap.load(path)
    assert len(made) >= 2 and registered == {}          # the buffers bound for the GPU
    assert_same(state, loaded)
    assert on_device(loaded) == on_device(state)
    into = {"w": torch.zeros_like(state["base"])}
    nvmeswap.save({"w": state["base"]}, path)
    made.clear()
    nvmeswap.load_into(path, into)
    assert len(made) == 1 and registered == {}          # the reading ring
    assert torch.equal(into["w"].view(torch.int32), state["base"].view(torch.int32))
    with nvmeswap.Checkpointer() as saver:
        saver.async_save(state, path).result()
        assert registered       # the kept snapshot
    assert_same(state, nvmeswap.load(path))
    assert registered == {}
