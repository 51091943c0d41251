"""Where DeepSpeed's compiled AIO op also loads, it and nvmeswap write byte-identical files
and read back the same bytes. Opt-in (``NVMESWAP_TEST_DEEPSPEED_OP=1``): DeepSpeed's op
JIT-compiles for minutes on first load (then cached under TORCH_EXTENSIONS_DIR)."""
import os

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
if os.environ.get("NVMESWAP_TEST_DEEPSPEED_OP", "") != "1":
    pytest.skip("set NVMESWAP_TEST_DEEPSPEED_OP=1 to compare with DeepSpeed's compiled op "
                "(it JIT-compiles on first load)", allow_module_level=True)

import nvmeswap.deepspeed as nds


@pytest.fixture(scope="module")
def theirs():
    nds.uninstall()
    from deepspeed.ops.op_builder import AsyncIOBuilder
    try:
        return AsyncIOBuilder().load(verbose=False).aio_handle
    except Exception as error:
        pytest.skip(f"DeepSpeed's AIO op does not load here: {error}")


GEOMETRIES = [(1024, 2, False, False, 2), (1024, 2, True, True, 2), (512, 1, False, True, 1),
              (4096, 8, True, False, 2), (65536, 4, False, False, 1), (1 << 20, 8, False, True, 2)]
SIZES = [1 << 20, 301 * 1024, 4096 * 3]     # DeepSpeed's op needs multiples of its alignment


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_same_files_and_bytes_as_deepspeeds_op(theirs, tmp_path, geometry):
    engines = {"deepspeed": theirs(*geometry), "nvmeswap": nds.AsyncIOBuilder().load()
               .aio_handle(*geometry)}
    try:
        for size in SIZES:
            data = torch.frombuffer(bytearray(random_bytes(size, seed=size)), dtype=torch.uint8)
            files = {}
            for name, h in engines.items():
                locked = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
                locked.copy_(data)
                files[name] = tmp_path / f"{name}-{size}"
                assert h.async_pwrite(locked, str(files[name])) == 0 and h.wait() == 1
                locked.zero_()
                assert h.sync_pread(locked, str(files[name])) == 1
                assert torch.equal(locked, data), name
                h.free_cpu_locked_tensor(locked)
            assert files["deepspeed"].read_bytes() == files["nvmeswap"].read_bytes()
            assert files["nvmeswap"].read_bytes() == bytes(data.numpy())
            for name, h in engines.items():
                assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
                        h.get_overlap_events(), h.get_intra_op_parallelism(),
                        h.get_alignment()) == (*geometry, 512 * geometry[4]), name
    finally:
        engines["nvmeswap"].close()
