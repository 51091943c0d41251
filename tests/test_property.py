"""Thousands of random operations against a plain-Python model of the files' contents,
and several processes, each with its own handle, sharing one file."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import needs_torch

import nvmeswap

PACKAGE_ROOT = os.path.dirname(os.path.dirname(nvmeswap.__file__))
LOCKED = 4 << 20


def _buffer(kind, size, locked, rng):
    """A buffer of ``size`` bytes of the given kind, and a uint8 numpy view of it."""
    import torch

    if kind == "bytearray":
        buffer = bytearray(size)
        return buffer, np.frombuffer(buffer, dtype=np.uint8)
    if kind == "numpy":
        buffer = np.zeros(size, dtype=np.uint8)
        return buffer, buffer
    if kind == "tensor":
        buffer = torch.zeros(size, dtype=torch.uint8)
        return buffer, buffer.numpy()
    start = int(rng.integers(0, LOCKED - size + 1))
    buffer = locked[start:start + size]
    return buffer, buffer.numpy()


@needs_torch
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_a_model(handle_factory, tmp_path, seed):
    import torch

    rng = np.random.default_rng(seed)
    h = handle_factory(block_size=int(rng.choice([4096, 65536, 1 << 20])),
                       queue_depth=int(rng.choice([1, 8, 128])),
                       single_submit=bool(rng.integers(2)), overlap_events=bool(rng.integers(2)),
                       intra_op_parallelism=seed + 1)
    locked = h.new_cpu_locked_tensor(LOCKED, torch.empty(0, dtype=torch.uint8))
    paths = [tmp_path / f"f{i}" for i in range(3)]
    models = [bytearray() for _ in paths]
    pending = {}            # file index -> [(view, expected)] of reads not yet waited for
    kept = []               # buffers of async writes, alive until wait()
    operations = 0

    def settle():
        h.wait()
        for reads in pending.values():
            for view, expected in reads:
                assert view.tobytes() == expected
        pending.clear()
        kept.clear()

    for _ in range(600):
        i = int(rng.integers(len(paths)))
        if i in pending:
            settle()         # an operation on a file waits for that file's async ones
        model = models[i]
        size = int(rng.integers(1, 9000) if rng.random() < 0.6 else rng.integers(1, 600_000))
        is_read = len(model) >= size and rng.random() < 0.5
        kind = str(rng.choice(["bytearray", "numpy", "tensor", "locked"]))
        use_async = kind != "locked" and rng.random() < 0.5
        buffer, view = _buffer(kind, size, locked, rng)
        if is_read:
            offset = int(rng.integers(0, len(model) - size + 1))
            expected = bytes(model[offset:offset + size])
            if use_async:
                h.async_pread(buffer, paths[i], offset)
                pending.setdefault(i, []).append((view, expected))
                kept.append(buffer)
            else:
                h.sync_pread(buffer, paths[i], offset)
                assert view.tobytes() == expected, f"step {operations}"
        else:
            offset = int(rng.integers(0, len(model) + 20_000))
            data = rng.integers(0, 256, size, dtype=np.uint8)
            view[:] = data
            if use_async:
                h.async_pwrite(buffer, paths[i], offset)
                pending.setdefault(i, [])
                kept.append(buffer)
            else:
                h.sync_pwrite(buffer, paths[i], offset)
            model.extend(bytes(max(0, offset + size - len(model))))
            model[offset:offset + size] = data.tobytes()
        operations += 1
    settle()
    for path, model in zip(paths, models):
        assert path.read_bytes() == bytes(model)
    assert operations == 600


WRITER_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[4])
    import numpy as np, nvmeswap
    rank, shared, own = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    region = 1_000_003                       # unaligned: neighbours share 4 KiB blocks
    data = np.random.default_rng(rank).integers(0, 256, region, dtype=np.uint8)
    with nvmeswap.aio_handle(intra_op_parallelism=2) as h:
        h.sync_pwrite(data, shared, rank * region)
        h.sync_pwrite(data, own)
        back = np.zeros_like(data)
        h.sync_pread(back, own)
        assert (back == data).all()
    print("ok")
""")


def test_processes_with_their_own_handles_share_a_file(tmp_path):
    shared = tmp_path / "shared"
    ranks = [subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(rank), str(shared),
                               str(tmp_path / f"own{rank}"), PACKAGE_ROOT],
                              stdout=subprocess.PIPE, text=True) for rank in range(4)]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert all(p.returncode == 0 and out.strip() == "ok" for p, out in zip(ranks, outputs))
    region = 1_000_003
    content = shared.read_bytes()
    assert len(content) == 4 * region
    for rank in range(4):
        expected = np.random.default_rng(rank).integers(0, 256, region, dtype=np.uint8).tobytes()
        assert content[rank * region:(rank + 1) * region] == expected
        assert (tmp_path / f"own{rank}").read_bytes() == expected
