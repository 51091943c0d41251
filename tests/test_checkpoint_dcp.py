"""torch.distributed.checkpoint through nvmeswap, 2 ranks (gloo, CPU): every local byte of
a sharded state comes back, whichever of DCP's FileSystemWriter/Reader and nvmeswap's
NvmeFileSystemWriter/Reader wrote and read it (Note [DCP files])."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_two_ranks_save_and_load_through_both_writers_and_readers(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo")
    script = Path(__file__).with_name("checkpoint_dcp_rank.py")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root,
                                                                    os.environ.get("PYTHONPATH")]))}
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), port, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank in range(2)]
    outputs = []
    try:
        for rank in ranks:
            outputs.append(rank.communicate(timeout=240)[0])
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(outputs)
    # Each rank wrote its own shard file through nvmeswap.
    assert sorted(name for name in os.listdir(tmp_path / "ours") if name.endswith(".distcp")) \
        == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("writer", ["FileSystemWriter", "NvmeFileSystemWriter"])
def test_tensors_with_a_bit_are_read_as_their_values(tmp_path, writer):
    """DCP saves a conjugate or negative view as its bytes and the bit: our reader gives
    its values, as DCP's own does, into plain targets and into one with a bit."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from nvmeswap.checkpoint.dcp import NvmeFileSystemReader, NvmeFileSystemWriter

    values = torch.arange(6, dtype=torch.float32).view(torch.complex64) + 1j
    saved = {"conj": values.conj(), "neg": torch.arange(4.0)._neg_view(), "plain": values}
    writers = {"FileSystemWriter": FileSystemWriter, "NvmeFileSystemWriter": NvmeFileSystemWriter}
    dcp.save(saved, storage_writer=writers[writer](tmp_path / "c"), no_dist=True)
    for reader in (FileSystemReader, NvmeFileSystemReader):
        loaded = {name: torch.zeros(tensor.shape, dtype=tensor.dtype)
                  for name, tensor in saved.items()}
        loaded["plain"] = torch.zeros_like(values).conj()       # a target with a bit
        dcp.load(loaded, storage_reader=reader(tmp_path / "c"), no_dist=True)
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), (reader.__name__, name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("last_length", [1000, 3000], ids=["like-the-first", "its-own"])
def test_an_item_cut_short_fails_naming_its_file(tmp_path, last_length):
    """A .distcp file cut short inside its last item: a ShortFileError naming the file
    and the item, not a complaint about the archive's format; also when an item of the
    same length came before it, whose reading the reader reuses."""
    from nvmeswap.checkpoint.dcp import NvmeFileSystemReader, NvmeFileSystemWriter
    from nvmeswap.errors import ShortFileError

    saved = {"a": torch.arange(1000.0), "b": torch.arange(float(last_length))}
    dcp.save(saved, storage_writer=NvmeFileSystemWriter(tmp_path / "c"), no_dist=True)
    (data,) = (tmp_path / "c").glob("*.distcp")
    os.truncate(data, data.stat().st_size - 8)
    with pytest.raises(dcp.api.CheckpointException) as raised:
        dcp.load({name: torch.zeros_like(t) for name, t in saved.items()},
                 storage_reader=NvmeFileSystemReader(tmp_path / "c"), no_dist=True)
    failure, _ = raised.value.failures[0]       # DCP gathers each rank's error
    assert isinstance(failure, ShortFileError) and failure.filename == str(data)
    assert "runs past the file's end" in str(failure)
