"""Note [fast CRC-32]: the CRC-32 a save puts in its archive is zlib's, whichever
implementation computes it; where ISA-L's will not import, zlib's takes its place."""
import importlib.util
import subprocess
import sys
import zlib

import pytest
from conftest import package_env, random_bytes

from nvmeswap.checkpoint.crc import crc32


def test_isal_computes_it_where_it_is_installed():
    expected = "isal" if importlib.util.find_spec("isal") else "zlib"
    assert crc32.__module__.split(".")[0] == expected


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 1 << 20, (5 << 20) + 17])
def test_the_crc_is_zlibs_whole_and_in_pieces(size):
    data = random_bytes(size, seed=size)
    assert crc32(data) == zlib.crc32(data)
    view = memoryview(data)
    running = 0
    for start in range(0, size, 1 << 20):
        running = crc32(view[start:start + (1 << 20)], running)
    assert running == zlib.crc32(data)
    assert crc32(view[3:], 12345) == zlib.crc32(view[3:], 12345)


def test_without_isal_a_save_still_writes_right_crcs(tmp_path):
    """A platform without ISA-L's wheels: the save's CRCs come from zlib, and zipfile
    checks every one of them."""
    blocker = tmp_path / "blocked" / "isal"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no isal here')\n")
    script = r"""
import sys, zipfile, torch, nvmeswap
from nvmeswap.checkpoint import crc
assert crc.crc32.__module__ == "zlib", crc.crc32.__module__
state = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
nvmeswap.save(state, sys.argv[1])
with zipfile.ZipFile(sys.argv[1]) as archive:
    assert archive.testzip() is None
loaded = torch.load(sys.argv[1])
assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
print("ok")
"""
    pytest.importorskip("torch", reason="needs torch (pip install torch)")
    env = package_env()
    env["PYTHONPATH"] = f"{blocker.parent}:{env['PYTHONPATH']}"
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "s.pt")], env=env,
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("threads_from", [0, 1 << 20], ids=["all-on-thread", "small-from-ring"])
def test_crcs_from_the_ring_and_the_thread_are_right_across_chunks(tmp_path, monkeypatch,
                                                                   threads_from):
    """Note [streamed checkpoint writes]: runs under THREAD_CRC_BYTES take their CRC from
    the ring, in pieces where they straddle two chunks; larger ones from the thread."""
    import zipfile

    torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")
    import nvmeswap
    from nvmeswap.checkpoint import image

    monkeypatch.setattr(image, "THREAD_CRC_BYTES", threads_from)
    # Runs of 300 KiB and more: several straddle the 1 MiB chunks; one of 3 MiB goes to
    # the thread when the small ones do not.
    state = {f"t{index}": torch.frombuffer(bytearray(random_bytes(size, seed=index)),
                                           dtype=torch.uint8)
             for index, size in enumerate([300 << 10, (300 << 10) + 5, 700 << 10, 3 << 20,
                                           (1 << 20) - 3, 13, 450 << 10])}
    with nvmeswap.Checkpointer(chunk_bytes=1 << 20, chunks=2) as saver:
        saver.save(state, tmp_path / "s.pt")
    with zipfile.ZipFile(tmp_path / "s.pt") as archive:
        assert archive.testzip() is None
    loaded = torch.load(tmp_path / "s.pt")
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
