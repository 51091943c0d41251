"""Kernel AIO against io_uring: the same handle on each engine, side by side (Note [engines]).

    python bench/engines.py --folder /nvme/scratch --size 1G --rounds 3

Each engine runs in a fresh process every round (their order rotated): a locked tensor of
``--size`` written to a fresh file, overwritten, read back twice (page cache dropped
before each read; the second is what a swap buffer's later transfers cost), then
``--ops`` 4 KiB reads at random aligned offsets of that file, started with
``async_pread`` into locked memory and waited for every 256. Default handle settings but
``engine``; ``--parallelism`` sets intra_op_parallelism. Printed: each engine's median
rate and the median of the per-round ratios uring / aio. Where io_uring is refused it
says why and measures kernel AIO alone.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import peers
import small_async
from small_async import BATCH, OP

from nvmeswap.units import parse_size

ENGINES = ("aio", "uring")
SEQUENTIAL = ("fresh write", "overwrite", "read", "read again")
MEASUREMENTS = (*SEQUENTIAL, "4 KiB async reads")


def contender_run(engine, path, size, ops, parallelism, seed):
    """In this process: every measurement on ``engine``; GB/s, and reads per second for the
    small reads (GB = 10^9 bytes)."""
    import numpy as np
    import torch

    import nvmeswap

    rates = {}
    with nvmeswap.aio_handle(intra_op_parallelism=parallelism, engine=engine) as handle:
        assert handle.get_engine() == engine
        tensor = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        if os.path.exists(path):
            os.unlink(path)
        for job in SEQUENTIAL:
            is_read = job.startswith("read")
            if is_read:
                peers.drop_page_cache()
            call = handle.sync_pread if is_read else handle.sync_pwrite
            started = time.perf_counter()
            call(tensor, path)
            rates[job] = size / (time.perf_counter() - started) / 1e9
            if job == "fresh write":
                os.sync()
        buffer = handle.new_cpu_locked_tensor(BATCH * OP, torch.empty(0, dtype=torch.uint8))
        offsets = np.random.default_rng(seed).integers(0, size // OP, ops) * OP
        peers.drop_page_cache()
        rates["4 KiB async reads"] = small_async.timed_async_reads(handle, buffer, path, offsets)
        assert handle.free_cpu_locked_tensor(buffer) and handle.free_cpu_locked_tensor(tensor)
    os.unlink(path)
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--size", default="1G", help="the tensor and the file (1024-based)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=20480, help="4 KiB random reads per round")
    parser.add_argument("--parallelism", type=int, default=1,
                        help="the handles' intra_op_parallelism")
    parser.add_argument("--contender", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    size = parse_size(args.size)
    if size < BATCH * OP:
        parser.error(f"--size must be at least {BATCH * OP // 1024} KiB (the random reads' "
                     "batch)")
    path = os.path.join(args.folder, "bench-engines.bin")
    if args.contender:
        print(json.dumps(contender_run(args.contender, path, size, args.ops, args.parallelism,
                                       int(time.time()))))
        return
    from nvmeswap._uring import probe
    refused = probe()
    engines = ENGINES if refused is None else ("aio",)
    if refused is not None:
        print(f"io_uring cannot be used here ({refused}): kernel AIO alone", file=sys.stderr)
    rates = {(engine, m): [] for engine in engines for m in MEASUREMENTS}
    for round_number in range(args.rounds):
        shift = round_number % len(engines)
        for engine in engines[shift:] + engines[:shift]:
            out = subprocess.run([sys.executable, __file__, "--folder", args.folder, "--size",
                                  args.size, "--ops", str(args.ops), "--parallelism",
                                  str(args.parallelism), "--contender", engine],
                                 stdout=subprocess.PIPE, text=True, check=True).stdout
            for measurement, rate in json.loads(out.splitlines()[-1]).items():
                rates[engine, measurement].append(rate)
        print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    print(f"engines: {args.size} locked tensor, intra_op_parallelism={args.parallelism}, "
          f"{args.ops} random 4 KiB reads, {args.rounds} rounds (medians; GB = 10^9 bytes)")
    print(f"{'measurement':<19}{'aio':>14}{'uring':>14}   uring / aio")
    for measurement in MEASUREMENTS:
        unit = "/s" if measurement.endswith("reads") else " GB/s"
        line = f"{measurement:<19}"
        for engine in ENGINES:
            values = rates.get((engine, measurement))
            if not values:
                line += f"{'-':>14}"
            elif unit == "/s":
                line += f"{statistics.median(values):>12.0f}{unit}"
            else:
                line += f"{statistics.median(values):>9.2f}{unit}"
        if refused is None:
            ratios = [u / a for u, a in zip(rates["uring", measurement], rates["aio", measurement])]
            line += (f"   {statistics.median(ratios):.2f}x ({min(ratios):.2f}-"
                     f"{max(ratios):.2f})")
        print(line)


if __name__ == "__main__":
    main()
