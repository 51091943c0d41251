"""Data-parallel training with each rank's Adam state offloaded to its own NVMe folder.

    torchrun --nproc-per-node 2 examples/offload_ddp.py --folder /nvme/swap --steps 20
    torchrun --nproc-per-node 2 examples/offload_ddp.py --folder /nvme/swap --no-offload

Every rank owns its handle, its worker processes and its folder ``{folder}/rank{r}``,
and swaps only its own optimizer state. The printed losses are the same, bit for bit,
with and without ``--no-offload``.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nvmeswap.training import OffloadedOptimizer


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 1))


def train(rank, world_size, folder, offload, steps, init_method="env://"):
    """Train ``steps`` steps on this rank; return the losses it saw."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=init_method)
    try:
        losses = _train(rank, folder, offload, steps)   # the DDP model is freed on return
        _all_ranks_done(rank, world_size)
        return losses
    finally:
        dist.destroy_process_group()


def _all_ranks_done(rank, world_size):
    """Wait until every rank is here, so that none tears the group down while another
    still talks to it. Through the store, not ``dist.barrier()``: gloo's barrier holds
    the collectives before it for gloo's own thread to free, which it may do while the
    interpreter exits, an abort (seen about 1 run in 10). Rank 0, which may host the
    store, leaves last."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"rank {rank} done", "1")
    store.wait([f"rank {other} done" for other in range(world_size)])
    if rank:
        store.set(f"rank {rank} left", "1")
    else:
        store.wait([f"rank {other} left" for other in range(1, world_size)])


def _train(rank, folder, offload, steps):
    model = DistributedDataParallel(make_model())
    layers = list(model.parameters())
    # Two parameter groups, so one group's state is prefetched while the other steps.
    optimizer = torch.optim.Adam([{"params": layers[:2]}, {"params": layers[2:]}], lr=1e-3)
    if offload:
        optimizer = OffloadedOptimizer(optimizer, os.path.join(folder, f"rank{rank}"))
    generator = torch.Generator().manual_seed(1000 + rank)    # each rank its own shard
    losses = []
    for _ in range(steps):
        inputs = torch.randn(32, 64, generator=generator)
        targets = inputs[:, :1].sin()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if offload:
        optimizer.close()
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-offload")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-offload", action="store_true")
    arguments = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    losses = train(rank, world_size, arguments.folder, not arguments.no_offload, arguments.steps)
    print(f"rank {rank} losses: {' '.join(f'{loss:.6f}' for loss in losses)}")


if __name__ == "__main__":
    main()
