"""CUDA tensors to files and back: aio_handle's staging ring and gds_handle's cuFile,
against a host tensor, DeepSpeed's handles and fio, in one run on one folder.

    python bench/gpu_roads.py --folder /nvme/scratch --size 1G --rounds 3

The question it answers: does a CUDA tensor move at the speed of a host tensor (the
staging ring overlaps the GPU copies with the disk), and how do both roads compare with
DeepNVMe's. Needs a CUDA GPU; DeepSpeed, cuFile and fio columns appear when installed
(``--peers none`` leaves DeepSpeed and fio out).
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import peers
from peers import JOBS

import nvmeswap
from nvmeswap.cli import report
from nvmeswap.units import parse_size

BASELINES = ("nvmeswap aio host locked", "deepspeed aio cuda", "deepspeed gds pinned",
             "fio libaio")


def contenders(folder, size, running):
    made = {
        "nvmeswap aio host locked": lambda: peers.NvmeswapContender(size, "locked"),
        "nvmeswap aio cuda": lambda: peers.CudaTensorContender(nvmeswap.aio_handle(), size),
        "nvmeswap aio cuda P2": lambda: peers.CudaTensorContender(
            nvmeswap.aio_handle(intra_op_parallelism=2), size),
    }
    if nvmeswap.gds_available():
        made["nvmeswap gds pinned"] = lambda: peers.CudaTensorContender(
            nvmeswap.gds_handle(), size, pin=True)
        made["nvmeswap gds pinned P2"] = lambda: peers.CudaTensorContender(
            nvmeswap.gds_handle(intra_op_parallelism=2), size, pin=True)
    else:
        print(f"no cuFile: {nvmeswap.gds_unavailable_reason()}", file=sys.stderr)
    if "deepspeed" in running:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        made["deepspeed aio cuda"] = lambda: peers.CudaTensorContender(
            AsyncIOBuilder().load(verbose=False).aio_handle(), size)
    if "deepspeed" in running and peers.deepspeed_gds_available():
        refusal = cufile_refusal(folder)
        if refusal:     # DeepSpeed's gds_handle writes nothing to a file cuFile refuses
            print(f"DeepSpeed's gds_handle left out: cuFile {refusal}", file=sys.stderr)
        else:
            from deepspeed.ops.op_builder import GDSBuilder
            made["deepspeed gds pinned"] = lambda: peers.CudaTensorContender(
                GDSBuilder().load(verbose=False).gds_handle(), size, pin=True)
    if "fio" in running:
        made["fio libaio"] = lambda: peers.FioContender(size)
    return {name: make() for name, make in made.items()}


def cufile_refusal(folder):
    """Why cuFile cannot take a file in ``folder``, or None where it can."""
    check = report.cufile_takes_files(folder)
    return None if check["status"] == report.OK else check["found"]


def main():
    parser = peers.side_by_side_arguments(__doc__.splitlines()[0])
    peers.add_peers_argument(parser)
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_roads.py needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    os.makedirs(arguments.folder, exist_ok=True)
    size = parse_size(arguments.size)
    everyone = contenders(arguments.folder, size, peers.peers_to_run(arguments.peers))
    try:
        seconds = peers.run_rounds(arguments.folder, size, arguments.rounds, everyone)
    finally:
        for contender in everyone.values():
            contender.close()
    print(f"\n{torch.cuda.get_device_name()}, {size / 2**30:.2f} GiB per job, "
          f"{arguments.rounds} rounds, GB/s (median over rounds)")
    print(f"{'contender':<26}" + "".join(f"{job:>14}" for job in JOBS))
    for name in everyone:
        cells = [statistics.median(size / s / 1e9 for s in seconds[name, job]) for job in JOBS]
        print(f"{name:<26}" + "".join(f"{c:>14.2f}" for c in cells))
    print("\nmedian per-round ratio (higher is better for nvmeswap)")
    for name in everyone:
        if not name.startswith("nvmeswap") or name in BASELINES:
            continue
        for baseline in BASELINES:
            if baseline not in everyone:
                continue
            ratios = [statistics.median(b / a for a, b in zip(seconds[name, job],
                                                               seconds[baseline, job]))
                      for job in JOBS]
            print(f"{name:<24} vs {baseline:<26}" + "".join(
                f"{job}: {r:5.2f}x   " for job, r in zip(JOBS, ratios)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
