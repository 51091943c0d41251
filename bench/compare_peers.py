"""nvmeswap against fio and DeepSpeed's aio_handle, in one run on one folder.

    python bench/compare_peers.py --folder /nvme/scratch --size 1G --rounds 3

Each round runs every contender once, in turn (rotated each round), for three jobs:
write into a fresh file,
overwrite that file, and read it back after dropping the page cache. Machines are noisy,
so what counts is the median over rounds of each per-round ratio against fio and
DeepSpeed. Then small synchronous reads (4 KiB, 64 KiB) are counted per second.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import peers  # noqa: E402

from nvmeswap.units import parse_size  # noqa: E402

JOBS = ("fresh write", "overwrite", "read")


def contenders(size, with_deepspeed, with_fio, only=()):
    made = {
        "nvmeswap locked": lambda: peers.NvmeswapContender(size, "locked"),
        "nvmeswap locked P2": lambda: peers.NvmeswapContender(size, "locked",
                                                              intra_op_parallelism=2),
        "nvmeswap plain": lambda: peers.NvmeswapContender(size, "plain"),
        "nvmeswap plain P2": lambda: peers.NvmeswapContender(size, "plain",
                                                             intra_op_parallelism=2),
    }
    if with_deepspeed:
        made["deepspeed locked"] = lambda: peers.DeepSpeedContender(size, "locked")
        made["deepspeed plain"] = lambda: peers.DeepSpeedContender(size, "plain")
    if with_fio:
        made["fio libaio"] = lambda: peers.FioContender(size)
    return {name: make() for name, make in made.items() if not only or name in only}


def run_rounds(folder, size, rounds, everyone):
    seconds = {(name, job): [] for name in everyone for job in JOBS}
    names = list(everyone)
    for round_number in range(rounds):
        # Rotate who goes first, so that no contender always follows the same neighbour.
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            contender = everyone[name]
            path = os.path.join(folder, "bench-" + name.replace(" ", "-"))
            peers.fresh(contender, path)
            seconds[name, "fresh write"].append(contender.write(path))
            os.sync()
            seconds[name, "overwrite"].append(contender.write(path))
            peers.drop_page_cache()
            seconds[name, "read"].append(contender.read(path))
        print(f"round {round_number + 1}/{rounds} done", file=sys.stderr)
    for name, contender in everyone.items():
        contender.remove(os.path.join(folder, "bench-" + name.replace(" ", "-")))
    return seconds


def small_reads(folder, everyone_small, op_size, duration):
    """Synchronous reads of ``op_size`` bytes at random aligned offsets, per second."""
    path = os.path.join(folder, "bench-small")
    with open(path, "wb") as f:
        f.write(os.urandom(64 << 20))
    os.sync()
    slots = (64 << 20) // op_size
    rates = {}
    for name, (handle, buffer) in everyone_small.items():
        offsets = torch.randint(0, slots, (100_000,)).tolist()
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < duration:
            handle.sync_pread(buffer, path, offsets[count % len(offsets)] * op_size)
            count += 1
        rates[name] = count / (time.perf_counter() - started)
    os.unlink(path)
    return rates


def main():
    parser = peers.side_by_side_arguments(__doc__.splitlines()[0])
    parser.add_argument("--small-seconds", type=float, default=3.0,
                        help="seconds per small-read contender (0: skip)")
    parser.add_argument("--only", action="append", default=[], metavar="CONTENDER",
                        help='run just these, e.g. --only "nvmeswap locked" --only "fio libaio"')
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    size = parse_size(arguments.size)
    with_deepspeed = peers.deepspeed_available()
    with_fio = peers.fio_available()
    for missing, have in (("DeepSpeed", with_deepspeed), ("fio", with_fio)):
        if not have:
            print(f"{missing} is not installed: its column is left out", file=sys.stderr)
    everyone = contenders(size, with_deepspeed, with_fio, arguments.only)
    try:
        seconds = run_rounds(arguments.folder, size, arguments.rounds, everyone)
    finally:
        for contender in everyone.values():
            contender.close()
    report_bandwidth(seconds, size, arguments.rounds, everyone, with_deepspeed, with_fio)
    if arguments.small_seconds > 0:
        report_small_reads(arguments.folder, with_deepspeed, arguments.small_seconds)


def report_bandwidth(seconds, size, rounds, everyone, with_deepspeed, with_fio):
    print(f"\n{size / 2**30:.2f} GiB per job, {rounds} rounds, GB/s (median over rounds)")
    print(f"{'contender':<22}" + "".join(f"{job:>14}" for job in JOBS))
    for name in everyone:
        cells = [statistics.median(size / s / 1e9 for s in seconds[name, job]) for job in JOBS]
        print(f"{name:<22}" + "".join(f"{c:>14.2f}" for c in cells))
    baselines = [("fio libaio", "fio libaio")] if "fio libaio" in everyone else []
    if "deepspeed locked" in everyone and "deepspeed plain" in everyone:
        baselines += [("deepspeed locked", "deepspeed locked"),
                      ("deepspeed plain", "deepspeed plain")]
    print("\nmedian per-round ratio (higher is better for nvmeswap)")
    for name in everyone:
        if not name.startswith("nvmeswap"):
            continue
        for baseline, label in baselines:
            if ("plain" in name) != ("plain" in baseline) and baseline != "fio libaio":
                continue
            ratios = [statistics.median(b / a for a, b in zip(seconds[name, job],
                                                               seconds[baseline, job]))
                      for job in JOBS]
            print(f"{name:<22} vs {label:<18}" + "".join(f"{job}: {r:5.2f}x   "
                                                        for job, r in zip(JOBS, ratios)))


def report_small_reads(folder, with_deepspeed, duration):
    print("\nsynchronous reads per second (locked buffers, random aligned offsets)")
    for op_size in (4096, 65536):
        handles = {"nvmeswap": __import__("nvmeswap").aio_handle()}
        if with_deepspeed:
            from deepspeed.ops.op_builder import AsyncIOBuilder
            handles["deepspeed"] = AsyncIOBuilder().load(verbose=False).aio_handle()
        small = {name: (h, h.new_cpu_locked_tensor(op_size, torch.empty(0, dtype=torch.uint8)))
                 for name, h in handles.items()}
        rates = small_reads(folder, small, op_size, duration)
        line = "  ".join(f"{name}: {rate:8.0f}/s" for name, rate in rates.items())
        if "deepspeed" in rates:
            line += f"  ratio: {rates['nvmeswap'] / rates['deepspeed']:.2f}x"
        print(f"{op_size // 1024:>3} KiB  {line}")
        handles["nvmeswap"].close()


if __name__ == "__main__":
    main()
