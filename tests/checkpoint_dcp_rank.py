"""One rank of tests/test_checkpoint_dcp.py: ``python checkpoint_dcp_rank.py RANK PORT FOLDER``.

Saves a sharded state (DTensors over 2 ranks, tensors of this rank only, replicated
tensors, Python values) with DCP's FileSystemWriter and with NvmeFileSystemWriter (and
with dcp.async_save), loads each checkpoint back with both readers into zeroed states,
and checks every local byte. Exits 0 when all is well; prints what differs otherwise.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import nvmeswap
from nvmeswap.checkpoint.dcp import NvmeFileSystemReader, NvmeFileSystemWriter

WORLD = 2


def make_state(mesh, rank, fill):
    """The state of ``rank``; with ``fill`` None its values, else the same shapes filled
    with ``fill``."""
    made = torch.Generator().manual_seed(1234)
    full = {
        "w": torch.randn(1001, 515, generator=made),
        "emb": torch.randn(4097, 33, generator=made).bfloat16(),
        "ids": torch.randint(-(2**40), 2**40, (3000,), generator=made),
    }
    mine = torch.Generator().manual_seed(rank)
    state = {
        "model": {name: distribute_tensor(tensor, mesh, [Shard(0)])
                  for name, tensor in full.items()},
        f"rank{rank}": torch.randn(777, generator=mine).half(),
        "replicated": torch.arange(100, dtype=torch.float64),
        "step": 17,
        "extra": {"lr": 3e-4, "names": ["a", "b"]},
    }
    if fill is not None:
        for tensor in state["model"].values():
            tensor.to_local().fill_(fill)
        state[f"rank{rank}"].fill_(fill)
        state["replicated"].fill_(fill)
        state["step"] = 0
        state["extra"] = {"lr": 0.0, "names": ["", ""]}
    return state


def local_bytes(value):
    if hasattr(value, "to_local"):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.contiguous().reshape(-1).view(torch.uint8).clone()
    return value


def differences(expected, got, where=""):
    if isinstance(expected, dict):
        out = []
        for key in expected:
            out += differences(expected[key], got.get(key), f"{where}.{key}")
        return out
    a, b = local_bytes(expected), local_bytes(got)
    same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    return [] if same else [where]


def main():
    rank, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    state = make_state(mesh, rank, None)
    ours, theirs, later, kept, handled = (
        os.path.join(folder, name) for name in ("ours", "theirs", "async", "kept", "handle"))
    # Without a handle (a Checkpointer kept or not) the files go through the process's own
    # queue (Note [saves without a handle], Note [fresh private reads]); with one, through
    # it.
    checkpointer = nvmeswap.Checkpointer()
    handle = nvmeswap.aio_handle()
    dcp.save(state, storage_writer=NvmeFileSystemWriter(ours))
    dcp.save(state, storage_writer=FileSystemWriter(theirs))
    dcp.async_save(state, storage_writer=NvmeFileSystemWriter(later)).result()
    dcp.save(state, storage_writer=NvmeFileSystemWriter(kept, checkpointer=checkpointer))
    dcp.save(state, storage_writer=NvmeFileSystemWriter(handled, handle=handle))
    problems = []
    for name, checkpoint, reader in [
            ("ours by ours", ours, NvmeFileSystemReader),
            ("ours by DCP", ours, FileSystemReader),
            ("DCP by ours", theirs, NvmeFileSystemReader),
            ("async by DCP", later, FileSystemReader),
            ("kept by DCP", kept, FileSystemReader),
            ("handle by DCP", handled, FileSystemReader),
            ("DCP by ours, kept", theirs,
             lambda path: NvmeFileSystemReader(path, checkpointer=checkpointer)),
            ("DCP by ours, handle", theirs,
             lambda path: NvmeFileSystemReader(path, handle=handle))]:
        loaded = make_state(mesh, rank, 0)
        dcp.load(loaded, storage_reader=reader(checkpoint))
        problems += [f"{name}: {where}" for where in differences(state, loaded)]
    checkpointer.close()
    handle.close()
    dist.barrier()
    dist.destroy_process_group()
    if problems:
        print("\n".join(problems))
        sys.exit(1)


if __name__ == "__main__":
    main()
