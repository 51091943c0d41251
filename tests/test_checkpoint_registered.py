"""Note [own queue and CUDA]: where CUDA is in use, the checkpoint calls made without a
handle keep to the process's own queue (no worker starts) and register with CUDA the
private memory that copies to or from a GPU go through, each unregistered before its
memory goes. A stand-in CUDA runtime (stand_in_device.py) takes the registrations here,
so these roads run without a GPU; tests/test_checkpoint_gpu.py runs them on one."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from stand_in_device import use_stand_in_device
from test_checkpoint import assert_same, random_tensor
from test_checkpoint_fresh import refuse_workers

import nvmeswap
from nvmeswap import locked_tensors
from nvmeswap.checkpoint import loading, own_queue, queue_reader


@pytest.fixture
def cuda(monkeypatch):
    """CUDA in use (while ``in_use``), as far as nvmeswap can tell, under the stand-in
    runtime; its ``sizes`` lists the bytes of each registration, in order. No worker
    may start."""
    runtime = use_stand_in_device(monkeypatch)
    runtime.in_use = True
    for module in (locked_tensors, own_queue):
        monkeypatch.setattr(module, "registers_with_cuda_now", lambda: runtime.in_use)
    runtime.sizes = []
    register_range = own_queue.register_range

    def recorded(address, size):
        runtime.sizes.append(size)
        return register_range(address, size)

    monkeypatch.setattr(own_queue, "register_range", recorded)
    refuse_workers(monkeypatch)
    return runtime


def state():
    return {"w": random_tensor((3 << 20,), torch.float32, 1),
            "b": random_tensor((5000,), torch.bfloat16, 2), "step": 7}


def test_a_save_registers_its_ring_for_the_call(cuda, tmp_path):
    expected = state()
    nvmeswap.save(expected, tmp_path / "s.pt")
    assert len(cuda.sizes) == 1 and cuda.sizes[0] >= 1 << 20     # the ring, once
    assert cuda.registered == {}
    assert_same(expected, torch.load(tmp_path / "s.pt"))


def test_a_kept_checkpointer_registers_its_snapshot_until_close(cuda, tmp_path):
    expected = state()
    checkpointer = nvmeswap.Checkpointer()
    try:
        for round_number in range(2):
            checkpointer.async_save(expected, tmp_path / "s.pt").result()
            assert_same(expected, torch.load(tmp_path / "s.pt"))
            # The snapshot stays registered, once, for the next save to copy into.
            assert list(cuda.registered.values()) == cuda.sizes
            assert len(cuda.sizes) == 1 and cuda.sizes[0] >= 12 << 20
    finally:
        checkpointer.close()
    assert cuda.registered == {}


def test_a_larger_snapshot_replaces_the_registered_one(cuda, tmp_path):
    with nvmeswap.Checkpointer() as checkpointer:
        for nbytes in (1 << 20, 8 << 20):
            state = {"w": random_tensor((nbytes,), torch.uint8, nbytes)}
            checkpointer.async_save(state, tmp_path / "s.pt").result()
            assert_same(state, torch.load(tmp_path / "s.pt"))
            assert list(cuda.registered.values()) == cuda.sizes[-1:]
        assert len(cuda.sizes) == 2 and cuda.sizes[1] > 8 << 20
    assert cuda.registered == {}


def test_a_checkpointer_dropped_unclosed_unregisters_before_its_memory_goes(cuda,
                                                                            tmp_path):
    import gc

    checkpointer = nvmeswap.Checkpointer()
    checkpointer.save(state(), tmp_path / "s.pt")              # a kept ring
    checkpointer.async_save(state(), tmp_path / "t.pt").result()  # a kept snapshot
    assert len(cuda.registered) == 2
    del checkpointer
    gc.collect()
    assert cuda.registered == {}
    assert_same(state(), torch.load(tmp_path / "t.pt"))


def test_memory_kept_from_before_cuda_came_into_use_is_registered_after(cuda, tmp_path):
    cuda.in_use = False
    with nvmeswap.Checkpointer() as checkpointer:
        checkpointer.save(state(), tmp_path / "s.pt")
        checkpointer.async_save(state(), tmp_path / "t.pt").result()
        assert cuda.sizes == []
        cuda.in_use = True
        checkpointer.save(state(), tmp_path / "s.pt")
        checkpointer.async_save(state(), tmp_path / "t.pt").result()
        assert len(cuda.registered) == 2        # the ring and the snapshot
    assert cuda.registered == {}
    assert_same(state(), torch.load(tmp_path / "s.pt"))
    assert_same(state(), torch.load(tmp_path / "t.pt"))


def test_a_failed_load_unregisters_and_raises_its_own_error(cuda, tmp_path, monkeypatch):
    nvmeswap.save(state(), tmp_path / "s.pt")
    monkeypatch.setattr(loading, "_bound_for_gpu", lambda location, map_location: True)

    def refuse(storage, location):
        raise RuntimeError("no room on the device")

    with pytest.raises(RuntimeError, match="no room on the device"):
        nvmeswap.load(tmp_path / "s.pt", map_location=refuse)
    assert cuda.sizes and cuda.registered == {}


def test_load_into_registers_its_reading_ring_for_the_call(cuda, tmp_path):
    expected = state()
    nvmeswap.save(expected, tmp_path / "s.pt")
    cuda.sizes.clear()
    into = {"w": torch.zeros(3 << 20), "b": torch.zeros(5000, dtype=torch.bfloat16),
            "step": 0}
    nvmeswap.load_into(tmp_path / "s.pt", into)
    assert cuda.sizes == [queue_reader.QueueReader().slot_bytes * queue_reader.QueueReader().slots]
    assert cuda.registered == {}
    assert_same({**expected, "step": 0}, into)


def test_a_load_registers_the_buffers_of_storages_bound_for_a_gpu(cuda, tmp_path,
                                                                  monkeypatch):
    """Here every storage counts as bound for a GPU (the copies stay on the host): each
    buffer is registered once, and unregistered once the load is done."""
    expected = state()
    nvmeswap.save(expected, tmp_path / "s.pt")
    cuda.sizes.clear()
    monkeypatch.setattr(loading, "_bound_for_gpu", lambda location, map_location: True)
    assert_same(expected, nvmeswap.load(tmp_path / "s.pt"))
    assert len(cuda.sizes) == 1 and cuda.sizes[0] >= 12 << 20    # one group: one buffer
    assert cuda.registered == {}


def test_a_load_of_host_storages_registers_nothing(cuda, tmp_path):
    expected = state()
    nvmeswap.save(expected, tmp_path / "s.pt")
    cuda.sizes.clear()
    assert_same(expected, nvmeswap.load(tmp_path / "s.pt"))
    assert cuda.sizes == [] and cuda.registered == {}


@pytest.mark.parametrize("location, map_location, bound", [
    ("cuda:0", None, True), ("cpu", None, False), ("cuda:1", "cpu", False),
    ("cpu", "cuda", True), ("cpu", torch.device("cuda", 0), True),
    ("cpu", {"cpu": "cuda:0"}, True), ("cuda:0", {"cuda:0": "cpu"}, False),
    ("cuda:0", {"cuda:1": "cpu"}, True), ("cuda:0", lambda storage, location: storage, False),
])
def test_where_a_storage_goes(location, map_location, bound):
    assert loading._bound_for_gpu(location, map_location) is bound
