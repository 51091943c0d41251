"""Note [crash-consistent checkpoints]: a save killed at any instant leaves the previous
checkpoint loadable, and never a file that loads with other bytes than were saved."""
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from checkpoint_crash_child import make_state
from test_checkpoint import assert_same

import nvmeswap
from nvmeswap.checkpoint.commit import TEMPORARY

# More for a soak: NVMESWAP_CRASH_ROUNDS=500 (the normal suite keeps it near 10 s).
ROOT = Path(__file__).resolve().parent.parent
# The children import this checkout's nvmeswap, whatever is installed.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                os.environ.get("PYTHONPATH")]))}
ROUNDS = int(os.environ.get("NVMESWAP_CRASH_ROUNDS", "12"))


def kill_window(folder, mode=""):
    """Seconds within which the child's kills fall: three times what one save of the
    mode's state takes here (at least 0.3 s), so that about two kills in three come after
    a whole save and nearly all the others inside the first, whatever the disk's speed."""
    path = Path(folder) / "timed.pt"
    started = time.perf_counter()
    nvmeswap.save(make_state(0, mode), path)
    took = time.perf_counter() - started
    path.unlink()
    return f"{max(0.3, 3 * took):.3f}"


@pytest.mark.parametrize("mode", ["", "background", "one-call"])
def test_saves_killed_at_random_instants_leave_a_whole_checkpoint(tmp_path, mode):
    """``background``: async saves with their snapshots in the background (Note [snapshot
    in the background]), two in flight, killed with them; ``one-call``: ``nvmeswap.save``
    without a handle (Note [saves without a handle])."""
    with nvmeswap.Checkpointer() as checkpointer:
        for index in range(ROUNDS):
            (tmp_path / f"round{index}").mkdir()
            checkpointer.save(make_state(index, mode), tmp_path / f"round{index}" / "ckpt.pt")
    child = Path(__file__).with_name("checkpoint_crash_child.py")
    done = subprocess.run([sys.executable, str(child), str(tmp_path), str(ROUNDS),
                           {"": "33", "background": "35", "one-call": "37"}[mode],
                           kill_window(tmp_path, mode), *([mode] if mode else [])],
                          capture_output=True, text=True, timeout=240, check=False, env=ENV)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)) == ROUNDS
    newer = cut_short = 0
    with nvmeswap.Checkpointer() as checkpointer:
        for index in range(ROUNDS):
            folder = tmp_path / f"round{index}"
            path = folder / "ckpt.pt"
            cut_short += any(TEMPORARY in name for name in os.listdir(folder))
            with zipfile.ZipFile(path) as archive:
                assert archive.testzip() is None, f"round {index}: a CRC does not match"
            loaded = torch.load(path)
            generation = loaded["generation"]
            assert generation == index or 0 <= generation - (index + 1) * 1000 < 4, generation
            newer += generation != index
            assert_same(make_state(generation, mode), loaded, f"round {index}")
            ours = checkpointer.load(path)
            assert_same(make_state(generation, mode), ours, f"round {index}")
            checkpointer.free(ours)
            # The next save removes what the killed one left behind.
            checkpointer.save(make_state(7), path)
            assert os.listdir(folder) == ["ckpt.pt"]
    # The kills landed both between saves and inside them (else this tested nothing).
    assert newer > 0 and cut_short > 0, (newer, cut_short)


def test_striped_saves_killed_at_random_instants_leave_a_whole_checkpoint(tmp_path):
    """Note [striped checkpoints]: the layout file is the one commit point."""
    rounds = max(ROUNDS // 2, 1)
    folders = [tmp_path / "dev0", tmp_path / "dev1"]
    for folder in folders:
        folder.mkdir()

    def files_of(index):
        return [sorted(n for n in os.listdir(f) if n.startswith(f"ckpt{index}.pt"))
                for f in folders]

    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=256 << 10) as checkpointer:
        for index in range(rounds):
            checkpointer.save(make_state(index), folders[0] / f"ckpt{index}.pt")
        child = Path(__file__).with_name("checkpoint_crash_child.py")
        done = subprocess.run([sys.executable, str(child), str(tmp_path), str(rounds), "34",
                               kill_window(tmp_path), "striped"], capture_output=True, text=True, timeout=240,
                              check=False, env=ENV)
        assert done.returncode == 0, done.stderr
        newer = cut_short = 0
        for index in range(rounds):
            path = folders[0] / f"ckpt{index}.pt"
            layout = json.loads(path.read_text())
            cut_short += len(files_of(index)[1]) > 1      # stripes of a killed save
            loaded = checkpointer.load(path)
            generation = loaded["generation"]
            assert generation == index or 0 <= generation - (index + 1) * 1000 < 4, generation
            newer += generation != index
            assert_same(make_state(generation), loaded, f"round {index}")
            checkpointer.free(loaded)
            checkpointer.save(make_state(7), path)
            fresh = json.loads(path.read_text())["name"]
            assert fresh != layout["name"]
            assert files_of(index) == [sorted([f"ckpt{index}.pt", fresh]), [fresh]]
    assert newer > 0 and cut_short > 0, (newer, cut_short)
