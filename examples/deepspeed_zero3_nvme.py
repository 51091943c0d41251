"""DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to NVMe through nvmeswap.

World size 1, on whichever accelerator DeepSpeed picks (the CPU with gloo, a GPU with
its own backend); nothing of DeepSpeed is compiled for the I/O. The
same training runs twice, in fresh processes: offloading to NVMe (through nvmeswap) and
offloading to CPU memory; the losses and final weights must agree bit for bit.

    python examples/deepspeed_zero3_nvme.py                 # both runs, compared
    python examples/deepspeed_zero3_nvme.py --offload nvme --out run.pt --folder /mnt/nvme
    python examples/deepspeed_zero3_nvme.py --engine deepspeed   # DeepSpeed's compiled op

Layer sizes are deliberately not multiples of 4 KiB, so ZeRO's partitions sit at
locked-buffer addresses that are not 4 KiB-aligned.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

STEPS = 6
# An MLP whose weights are not 4 KiB multiples; the two large ones exceed the 1 MiB below
# which DeepSpeed's swappers keep a tensor in memory instead of on NVMe.
SIZES = (37, 521, 509, 523, 11)


def config(offload: str, folder: str) -> dict:
    """The DeepSpeed configuration: ZeRO-3 with both offloads to ``offload``."""
    device = {"device": offload}
    if offload == "nvme":
        device["nvme_path"] = folder
    return {
        "train_batch_size": 8,
        "steps_per_print": 1_000_000,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {**device, "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 1 << 19, "max_in_cpu": 0},
            "offload_optimizer": {**device, "pin_memory": True, "buffer_count": 4},
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 0,
            "stage3_prefetch_bucket_size": 0,
            "sub_group_size": 270_001,      # optimizer sub-groups of 1,080,004 bytes
        },
        # DeepSpeed's own op-test geometry: a block smaller than a page.
        "aio": {"block_size": 1024, "queue_depth": 2, "intra_op_parallelism": 2,
                "single_submit": False, "overlap_events": True},
        "zero_force_ds_cpu_optimizer": False,     # torch's Adam: nothing to compile
        "zero_allow_untested_optimizer": True,
    }


def train(offload: str, folder: str, engine: str = "nvmeswap") -> dict:
    """Train a few steps; return the losses and the final (gathered) weights."""
    import nvmeswap
    import nvmeswap.deepspeed
    if engine == "nvmeswap":
        nvmeswap.deepspeed.install()    # the one line: DeepSpeed's I/O goes to nvmeswap

    import deepspeed
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)            # the same arithmetic in both runs
    import deepspeed.ops
    # One rank: DeepSpeed's shared-memory all-reduce has nothing to do, so do not let it
    # JIT-compile that op (a minute or two on a fresh machine).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               verbose=False)
    cfg = config(offload, folder)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        layers = []
        for n_in, n_out in zip(SIZES, SIZES[1:]):
            layers += [torch.nn.Linear(n_in, n_out), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers[:-1])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    data = torch.Generator().manual_seed(1)
    # Made on the CPU (the same numbers on every accelerator), moved where the model is.
    inputs = torch.randn(STEPS, 8, SIZES[0], generator=data).to(model_engine.device)
    targets = torch.randn(STEPS, 8, SIZES[-1], generator=data).to(model_engine.device)
    losses = []
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(model_engine(inputs[step]), targets[step])
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.detach().cpu().clone())
    swap_files = 0
    if offload == "nvme":
        # Both ZeRO-Infinity swappers run on nvmeswap handles, and wrote swap files.
        param_swapper = next(iter(model_engine.module.parameters())).nvme_swapper
        handles = (model_engine.optimizer.optimizer_swapper.aio_handle,
                   param_swapper.aio_read_handle, param_swapper.aio_write_handle)
        if engine == "nvmeswap":
            assert all(isinstance(h, nvmeswap.aio_handle) for h in handles), handles
        swap_files = sum(len(files) for _, _, files in os.walk(folder))
        assert swap_files > 0, f"no swap files under {folder}"
        print(f"ZeRO-Infinity swappers on {type(handles[0]).__module__}.aio_handle; "
              f"{swap_files} swap files")
    weights = {}
    for name, param in model_engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            weights[name] = param.detach().cpu().clone()
    model_engine.destroy()
    return {"losses": torch.stack(losses), "weights": weights, "swap_files": swap_files}


def _run_child(offload: str, folder: str, out: str, engine: str) -> None:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    subprocess.run([sys.executable, __file__, "--offload", offload, "--folder", folder,
                    "--out", out, "--engine", engine], env=env, check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(folder: str, engine: str = "nvmeswap") -> bool:
    """Run NVMe (through ``engine``) and CPU offload in fresh processes; print and return
    whether they agree."""
    import torch

    results = {}
    for offload in ("nvme", "cpu"):
        out = os.path.join(folder, f"{offload}.pt")
        _run_child(offload, os.path.join(folder, "swap"), out, engine)
        results[offload] = torch.load(out)
    nvme, cpu = results["nvme"], results["cpu"]
    for step, (a, b) in enumerate(zip(nvme["losses"].tolist(), cpu["losses"].tolist())):
        print(f"step {step}: loss nvme {a:.9g}  cpu {b:.9g}")
    same_losses = torch.equal(nvme["losses"], cpu["losses"])
    same_weights = all(torch.equal(nvme["weights"][k], cpu["weights"][k]) for k in cpu["weights"])
    print(f"losses bit-identical: {same_losses}; final weights bit-identical: {same_weights} "
          f"({sum(w.numel() for w in cpu['weights'].values())} parameters)")
    return same_losses and same_weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offload", choices=("nvme", "cpu"))
    parser.add_argument("--folder", help="swap folder (default: a temporary one)")
    parser.add_argument("--out", help="where a single run saves its losses and weights")
    parser.add_argument("--engine", choices=("nvmeswap", "deepspeed"), default="nvmeswap",
                        help="who does the NVMe I/O: nvmeswap, or DeepSpeed's compiled op")
    args = parser.parse_args()
    if args.offload is None:
        with tempfile.TemporaryDirectory(dir=args.folder) as folder:
            return 0 if compare(folder, args.engine) else 1
    import torch
    if args.folder:
        os.makedirs(args.folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        result = train(args.offload, folder, args.engine)
    if args.out:
        torch.save(result, args.out)
    print("losses:", [f"{x:.9g}" for x in result["losses"].tolist()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
