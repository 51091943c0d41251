"""DeepSpeed's own code on nvmeswap: its op through the routed builders, its swappers,
FastFileWriter and ds_io engines, and the routing itself. Skipped where DeepSpeed is not
installed; nothing of DeepSpeed is compiled."""
import filecmp
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

import nvmeswap
import nvmeswap.deepspeed as nds


@pytest.fixture
def routed():
    """DeepSpeed routed to nvmeswap for one test, and put back after it."""
    nds.install()
    try:
        yield
    finally:
        nds.uninstall()


@pytest.fixture(scope="module")
def ds_dist():
    """deepspeed.comm on gloo with world size 1, as ZeRO-Infinity's code needs a rank."""
    import socket

    import deepspeed
    import deepspeed.comm as dist
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import deepspeed.ops
        # One rank: no shared-memory all-reduce op to JIT-compile (minutes when cold).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    yield dist


def _op_builder():
    from deepspeed.ops.op_builder import AsyncIOBuilder
    return AsyncIOBuilder


def _closing(handles):
    for h in handles:
        h.close()


# -- routing -------------------------------------------------------------------------------
def test_install_routes_every_import_site_and_uninstall_puts_them_back():
    import deepspeed.nvme.ds_aio_basic as basic
    import deepspeed.runtime.swap_tensor.partitioned_param_swapper as param_swapper
    from deepspeed.ops import op_builder
    theirs = op_builder.AsyncIOBuilder
    assert theirs is not nds.AsyncIOBuilder
    nds.install()
    nds.install()      # idempotent
    try:
        import deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper as later
        from deepspeed.accelerator import get_accelerator
        assert op_builder.AsyncIOBuilder is nds.AsyncIOBuilder
        assert op_builder.PinMemoryBuilder is nds.PinMemoryBuilder
        assert basic.AsyncIOBuilder is param_swapper.AsyncIOBuilder is nds.AsyncIOBuilder
        assert param_swapper.GDSBuilder is nds.GDSBuilder
        assert later.AsyncIOBuilder is nds.AsyncIOBuilder
        assert get_accelerator().get_op_builder("AsyncIOBuilder") is nds.AsyncIOBuilder
        import deepspeed.ops
        assert deepspeed.ops.__compatible_ops__["async_io"] is True
        assert nds.installed() and "routed to nvmeswap" in nds.deepspeed_status()
    finally:
        nds.uninstall()
        nds.uninstall()
    assert not nds.installed()
    assert op_builder.AsyncIOBuilder is theirs and basic.AsyncIOBuilder is theirs
    assert param_swapper.AsyncIOBuilder is theirs


def test_environment_switch_routes_a_fresh_interpreter(tmp_path):
    """The startup file turns NVMESWAP_DEEPSPEED=1 into install() in every new process
    (here a site directory of our own stands in for site-packages)."""
    path = nds.write_startup_file(str(tmp_path))
    assert os.path.basename(path) == nds.STARTUP_FILE
    probe = ("import site, sys; site.addsitedir(sys.argv[1]); "
             "from deepspeed.ops.op_builder import AsyncIOBuilder as B; print(B.__module__)")
    env = dict(os.environ)
    outputs = {}
    for switch in ("1", "0"):
        env[nds.ENVIRONMENT_SWITCH] = switch
        outputs[switch] = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], env=env,
                                         capture_output=True, text=True, timeout=120,
                                         check=True).stdout.split()[-1]
    assert outputs["1"] == "nvmeswap.deepspeed"
    assert outputs["0"].startswith("deepspeed.ops.op_builder")


def test_loaded_module_has_what_deepspeeds_has(routed, tmp_path):
    op = _op_builder()().load()
    for name in ("aio_handle", "aio_read", "aio_write", "deepspeed_memcpy"):
        assert callable(getattr(op, name))
    data = torch.frombuffer(bytearray(random_bytes(12_345)), dtype=torch.uint8)
    path = str(tmp_path / "basic")
    assert op.aio_write(data, path, 1024, 2, False, False, True) == 0
    back = torch.zeros_like(data)
    assert op.aio_read(back, path, 1024, 2, True, True, True) == 0
    assert torch.equal(back, data)
    dest = torch.zeros(100)
    assert op.deepspeed_memcpy(dest, torch.arange(100.0)) == 0
    assert torch.equal(dest, torch.arange(100.0))


# -- DeepSpeed's op-test geometry, and a sweep of block sizes and queue depths ------------
def _write_read(h, tmp_path, size, locked, use_async, tag):
    """What DeepSpeed's op tests do: write a buffer, compare the file with a reference
    written by Python, read it back into a fresh buffer and compare."""
    ref = random_bytes(size, seed=size)
    ref_file = tmp_path / f"ref{tag}"
    ref_file.write_bytes(ref)
    if locked:
        buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        buf.copy_(torch.frombuffer(bytearray(ref), dtype=torch.uint8))
    else:
        buf = torch.frombuffer(bytearray(ref), dtype=torch.uint8)
    out = str(tmp_path / f"out{tag}")
    if use_async:
        assert h.async_pwrite(buf, out) == 0 and h.wait() == 1
    else:
        assert h.sync_pwrite(buf, out) == 1
    assert filecmp.cmp(ref_file, out, shallow=False)
    back = torch.zeros(size, dtype=torch.uint8)
    if use_async:
        assert h.async_pread(back, out) == 0 and h.wait() == 1
    else:
        assert h.sync_pread(back, out) == 1
    assert bytes(back.numpy()) == ref
    if locked:
        assert h.free_cpu_locked_tensor(buf)


@pytest.mark.parametrize("single_submit,overlap_events", [(False, False), (True, True)])
def test_deepspeed_op_test_geometry(routed, tmp_path, single_submit, overlap_events):
    """DeepSpeed's op tests: block 1024, queue depth 2, parallelism 2, 1 MiB transfers."""
    h = _op_builder()().load().aio_handle(1024, 2, single_submit, overlap_events, 2)
    try:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism(),
                h.get_alignment()) == (1024, 2, 2, 1024)
        for locked in (False, True):
            for use_async in (False, True):
                _write_read(h, tmp_path, 1 << 20, locked, use_async, f"{locked}{use_async}")
    finally:
        h.close()


@pytest.mark.parametrize("block_size", [512, 1024, 4096, 65536, 1 << 20])
def test_block_size_and_queue_depth_sweep(routed, tmp_path, block_size):
    """Every block size 512 B..1 MiB at queue depths 1..8 moves the same bytes."""
    handles = [_op_builder()().load().aio_handle(block_size, qd, qd % 2 == 0, qd > 2, 2)
               for qd in (1, 2, 4, 8)]
    try:
        for qd, h in zip((1, 2, 4, 8), handles):
            assert (h.get_block_size(), h.get_queue_depth()) == (block_size, qd)
            _write_read(h, tmp_path, 300_000 + qd, locked=qd % 2 == 0, use_async=qd > 2,
                        tag=qd)
    finally:
        _closing(handles)


# -- the pinned-memory manager --------------------------------------------------------------
def test_pin_handle_and_aio_handle_share_the_locked_set(routed, handle):
    from deepspeed.ops.op_builder import PinMemoryBuilder
    pins = PinMemoryBuilder().load().pin_handle()
    example = torch.empty(0, dtype=torch.float32)
    theirs = pins.new_cpu_locked_tensor(4096, example)
    ours = handle.new_cpu_locked_tensor(4096, example)
    assert handle.is_pinned(theirs) and pins.is_pinned(ours) and pins.is_pinned(theirs[5:9])
    assert not pins.is_pinned(torch.empty(10))
    assert pins.free_cpu_locked_tensor(ours) and not handle.is_pinned(ours)
    assert pins.free_cpu_locked_tensor_by_ptr(theirs.data_ptr())
    assert not handle.is_pinned(theirs) and not pins.free_cpu_locked_tensor_by_ptr(1)
    del pins


def test_deepspeed_native_pinned_memory_is_zero_copy_for_aio_handles(routed, handle_factory,
                                                                     tmp_path):
    """DeepSpeed's DS_PIN_MEMORY_BACKEND=native manager allocates from the same set."""
    from deepspeed.utils.pin_memory import NativePinnedMemory
    os.environ["DS_PIN_MEMORY_REGISTER_DEVICE"] = "0"
    try:
        manager = NativePinnedMemory()
        source = torch.arange(10_000, dtype=torch.float32)
        pinned = manager.pin(source)
        reader, writer = handle_factory(intra_op_parallelism=2), handle_factory()
        assert manager.is_pinned(pinned) and reader.is_pinned(pinned) and writer.is_pinned(pinned)
        assert writer.sync_pwrite(pinned, tmp_path / "p") == 1
        back = reader.new_cpu_locked_tensor(10_000, pinned)
        assert reader.sync_pread(back, tmp_path / "p") == 1 and torch.equal(back, source)
        assert manager.unpin(pinned) and not reader.is_pinned(pinned)
        reader.free_cpu_locked_tensor(back)
        del manager
    finally:
        del os.environ["DS_PIN_MEMORY_REGISTER_DEVICE"]


# -- DeepSpeed's swappers and writers, driven directly ---------------------------------------
def test_async_tensor_swapper_writes_every_tensor_exactly(ds_dist, routed, tmp_path):
    """ZeRO-Infinity's AsyncTensorSwapper: tensors of sizes that are not multiples of its
    alignment packed into locked buffers and swapped out; every file holds its tensor."""
    from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper
    h = _op_builder()().load().aio_handle(1024, 2, False, False, 2)
    try:
        alignment = h.get_alignment() // 4
        buffers = [h.new_cpu_locked_tensor(1 << 16, torch.empty(0)) for _ in range(2)]
        swapper = AsyncTensorSwapper(h, alignment, timers=None)
        swapper.add_buffers(buffers)
        sizes = [1000, 4097, 30_001, 255, 12_288]
        tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
        paths = [str(tmp_path / f"t{i}.swp") for i in range(len(sizes))]
        swapper.swap_out_tensors(tensors, paths)
        swapper.release_buffers()
        for tensor, path in zip(tensors, paths):
            written = Path(path).read_bytes()
            assert written[:tensor.numel() * 4] == tensor.numpy().tobytes()
        for buffer in buffers:
            assert h.free_cpu_locked_tensor(buffer)
    finally:
        h.close()


def test_swap_buffer_pool_round_trip_at_unaligned_slices(routed, tmp_path):
    """ZeRO-Infinity's swap buffer pool (runtime/swap_tensor/utils.py), as its optimizer
    swappers use it: partitions whose sizes are not multiples of 4 KiB packed at
    DeepSpeed's alignment (512 x parallelism bytes), so most sit at locked addresses
    that are not 4 KiB-aligned; written by one handle, read back by another."""
    from deepspeed.runtime.swap_tensor.utils import SwapBufferPool
    op = _op_builder()().load()
    writer = op.aio_handle(1024, 2, False, False, 2)
    reader = op.aio_handle(1 << 20, 8, True, True, 2)
    try:
        numel_alignment = writer.get_alignment() // 4
        buffers = [writer.new_cpu_locked_tensor(1 << 15, torch.empty(0)) for _ in range(2)]
        sizes = [1000, 3001, 7777, 255, 12_000, 4096]
        values = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
        paths = [str(tmp_path / f"part{i}.swp") for i in range(len(sizes))]

        def pack(pool):
            tensors = []
            for numel, path in zip(sizes, paths):
                aligned = -(-numel // numel_alignment) * numel_alignment
                assert pool.has_space(aligned)
                tensors.append(pool.allocate_tensor(numel, path, aligned)[1])
            return tensors

        out_pool = SwapBufferPool(buffers, writer)
        for tensor, value in zip(pack(out_pool), values):
            tensor.copy_(value)
        assert any(t.data_ptr() % 4096 for t in out_pool.get_compute_tensors())
        out_pool.swap_out(writer)
        for buffer in buffers:
            buffer.zero_()
        in_pool = SwapBufferPool(buffers, reader)
        tensors = pack(in_pool)
        in_pool.swap_in(reader)
        for tensor, value in zip(tensors, values):
            assert torch.equal(tensor, value)
        for buffer in buffers:
            assert reader.free_cpu_locked_tensor(buffer)
    finally:
        _closing([writer, reader])


def _byte_view(tensor):
    return tensor if tensor.nbytes <= 1 else tensor.reshape(-1).view(torch.uint8)


@pytest.fixture
def utils_op(monkeypatch):
    """FastFileWriter loads DeepSpeed's ``UtilsBuilder`` op for one cast, and DeepSpeed's
    CPU backend has no such op ("not implemented on CPU backend"); this is that cast
    (ops/csrc/utils/tensor_cast.cpp) in Python. It moves no bytes to files."""
    import deepspeed.io.fast_file_writer as module

    def cast_to_byte_tensor(tensors):
        return [_byte_view(t) for t in tensors] if isinstance(tensors, list) \
            else _byte_view(tensors)

    class UtilsBuilder:
        def load(self, verbose=True):
            return types.SimpleNamespace(cast_to_byte_tensor=cast_to_byte_tensor)

    monkeypatch.setattr(module, "UtilsBuilder", UtilsBuilder)


@pytest.mark.parametrize("io_buffer_size,total", [(64 << 10, 1_000_003), (64_512, 200_000),
                                                  (1_001_472, 3_000_001),
                                                  (1 << 20, 123)])
def test_fast_file_writer_round_trip(routed, utils_op, tmp_path, io_buffer_size, total):
    """DeepSpeed's FastFileWriter (the fast checkpoint engine's writer) with double
    buffers of sizes DeepSpeed accepts (multiples of 2 x get_alignment(), some not of
    4 KiB: 64_512 and 1_001_472, like its "io_buffer_size": 64e6)."""
    from deepspeed.io import FastFileWriter, FastFileWriterConfig
    h = _op_builder()().load().aio_handle(1 << 20, 8, False, False, 1)
    try:
        pinned = h.new_cpu_locked_tensor(io_buffer_size, torch.empty(0, dtype=torch.uint8))
        data = random_bytes(total, seed=total)
        path = str(tmp_path / "checkpoint.pt")
        writer = FastFileWriter(path, FastFileWriterConfig(dnvme_handle=h, pinned_tensor=pinned))
        for start in range(0, total, 77_777):
            writer.write(data[start:start + 77_777])
        writer.close()
        del writer
        assert Path(path).read_bytes() == data
        assert h.free_cpu_locked_tensor(pinned)
    finally:
        h.close()


def test_fast_file_writer_checkpoint_of_a_state_dict(routed, utils_op, tmp_path):
    """torch.save through FastFileWriter, loaded back bit for bit."""
    from deepspeed.io import FastFileWriter, FastFileWriterConfig
    h = _op_builder()().load().aio_handle(1024, 2, False, False, 2)
    try:
        pinned = h.new_cpu_locked_tensor(256_000, torch.empty(0, dtype=torch.uint8))
        state = {"w": torch.randn(1000, 37), "b": torch.arange(999, dtype=torch.int64)}
        path = str(tmp_path / "state.pt")
        writer = FastFileWriter(path, FastFileWriterConfig(dnvme_handle=h, pinned_tensor=pinned))
        torch.save(state, writer)
        writer.close()
        del writer
        loaded = torch.load(path)
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        h.free_cpu_locked_tensor(pinned)
    finally:
        h.close()


# -- ds_io's engines -------------------------------------------------------------------------
def _ds_io_args(monkeypatch, folder, *extra):
    from deepspeed.nvme.ds_aio_args import get_validated_args
    monkeypatch.setattr(sys, "argv", ["ds_io", "--folder", str(folder), "--io_size", "301K",
                                      "--block_size", "1K", "--queue_depth", "2",
                                      "--io_parallel", "2", "--validate", "--loops", "1",
                                      *extra])
    return get_validated_args()


@pytest.mark.parametrize("engine", ["aio_basic", "aio_handle"])
def test_ds_io_engines_write_and_read_their_buffers(routed, monkeypatch, tmp_path, engine):
    """ds_io's basic (aio_read/aio_write) and handle (pread/pwrite) engines, at DeepSpeed's
    op-test geometry with its own validation on: the files hold the engines' buffers."""
    from deepspeed.nvme.ds_aio_basic import AIOBasic_Engine
    from deepspeed.nvme.ds_aio_constants import BUFFER, FILE, HANDLE
    from deepspeed.nvme.ds_aio_handle import AIOHandle_Engine
    engine_class = AIOBasic_Engine if engine == "aio_basic" else AIOHandle_Engine
    args = _ds_io_args(monkeypatch, tmp_path)
    writer = engine_class(args, 0, False)
    writer.write(args, 0, 0)
    path = writer.ctxt[FILE] if engine == "aio_basic" else writer.ctxt[FILE][0]
    written = bytes(writer.ctxt[BUFFER].numpy())
    assert Path(path).read_bytes() == written and len(written) == 301 * 1024     # not a 4 KiB multiple
    writer.fini()

    read_args = _ds_io_args(monkeypatch, tmp_path, "--read")
    reader = engine_class(read_args, 0, True)
    source = reader.ctxt[FILE] if engine == "aio_basic" else reader.ctxt[FILE][0]
    reader.ctxt[BUFFER].zero_()
    reader.read(read_args, 0, 0)
    assert bytes(reader.ctxt[BUFFER].numpy()) == Path(source).read_bytes()
    handle = reader.ctxt.get(HANDLE)
    reader.fini()
    if handle is not None:
        handle.close()
    if engine == "aio_handle":
        writer.ctxt[HANDLE].close()


def test_fast_checkpoint_engine_round_trip(ds_dist, routed, utils_op, monkeypatch, tmp_path):
    """DeepSpeed's FastCheckpointEngine as its config builds it: the writer's I/O buffer
    from DeepSpeed's native pinned manager (DS_PIN_MEMORY_BACKEND=native, routed to
    nvmeswap's pin_handle), an io_buffer_size DeepSpeed accepts that is not a 4 KiB
    multiple, DeepSpeed's op-test aio geometry; the checkpoint loads back bit for bit."""
    from deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.model_checkpointing.data_parallel_writer_factory import (
        DataParallelWriterConfig,
    )
    from deepspeed.utils import pin_memory
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    monkeypatch.setenv("DS_PIN_MEMORY_REGISTER_DEVICE", "0")
    monkeypatch.setattr(pin_memory, "_shared_native_pins", None)
    config = DeepSpeedConfig({
        "train_batch_size": 1,
        "checkpoint": {"writer": {"type": "fast", "io_buffer_size": 1_001_472,
                                  "io_buffer_double": True}},
        "aio": {"block_size": 1024, "queue_depth": 2, "intra_op_parallelism": 2,
                "single_submit": False, "overlap_events": True}})
    dp_writer = DataParallelWriterConfig(world_size=1, rank=0, global_rank=0, local_rank=0,
                                         pure_dp=True)
    engine = FastCheckpointEngine(config, dp_writer, optimize_dp_state=False)
    handle = engine._writer._dnvme_handle
    assert isinstance(handle, nvmeswap.aio_handle) and handle.is_pinned(engine._writer._io_buffer)
    state = {"w": torch.randn(513, 77, generator=torch.Generator().manual_seed(5)),
             "step": torch.tensor(12), "names": ["a", "b"]}
    path = str(tmp_path / "model_states.pt")
    engine.save(state, path)
    loaded = engine.load(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 12
    assert loaded["names"] == ["a", "b"]
    handle.close()
    buffer = engine._writer._io_buffer
    del engine
    assert pin_memory._shared_native_pins.unpin(buffer)
