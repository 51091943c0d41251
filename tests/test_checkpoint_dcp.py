"""torch.distributed.checkpoint through nvmeswap, 2 ranks (gloo, CPU): every local byte of
a sharded state comes back, whichever of DCP's FileSystemWriter/Reader and nvmeswap's
NvmeFileSystemWriter/Reader wrote and read it (Note [DCP files])."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.checkpoint")


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
