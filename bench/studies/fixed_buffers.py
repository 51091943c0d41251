"""Do io_uring's fixed buffers pay for a worker's engine (UringEngine.register_buffers)?

    python bench/studies/fixed_buffers.py --folder /nvme/scratch --size 1G --rounds 9

One engine alone, as a worker runs it (1 MiB requests, 128 in flight), moves a shared
locked region of ``--size`` to a fresh preallocated file, over it again, and back:
kernel AIO (``AioEngine``), io_uring (``UringEngine``), and io_uring with the region
registered as fixed buffers. Each contender in a fresh process every round, their order
rotated. Printed: median GB/s (GB = 10^9 bytes), and the median of the per-round ratios
to plain io_uring and to kernel AIO.
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

from nvmeswap.units import parse_size

CONTENDERS = ("aio", "uring", "uring, registered")
JOBS = ("fresh write", "overwrite", "read")


def contender_run(kind, path, size):
    from nvmeswap._queues import AioEngine
    from nvmeswap._uring import UringEngine
    from nvmeswap.io.regions import SharedRegion

    region = SharedRegion(size)
    ctypes.memset(region.address, 0x5A, size)
    engine = (AioEngine if kind == "aio" else UringEngine)(1 << 20, 128, False, False)
    if kind == "uring, registered":
        assert engine.register_buffers(region.address, size)
    rates = {}
    for job in JOBS:
        flags = os.O_RDONLY if job == "read" else os.O_WRONLY | os.O_CREAT
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
        if job == "fresh write":
            os.posix_fallocate(fd, 0, size)
        started = time.perf_counter()
        done = engine.transfer(1, 0, job == "read", fd, -1, region.address, size, 0, 4096)
        rates[job] = size / (time.perf_counter() - started) / 1e9
        os.close(fd)
        assert not done.failed, done
        os.sync()
    os.unlink(path)
    del engine
    region.close()
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--size", default="1G")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    path = os.path.join(args.folder, "fixed-buffers.bin")
    if args.contender:
        print(json.dumps(contender_run(args.contender, path, parse_size(args.size))))
        return
    from nvmeswap._uring import probe
    if probe() is not None:
        print(f"io_uring cannot be used here: {probe()}")
        return
    rates = {(kind, job): [] for kind in CONTENDERS for job in JOBS}
    for round_number in range(args.rounds):
        shift = round_number % len(CONTENDERS)
        for kind in CONTENDERS[shift:] + CONTENDERS[:shift]:
            out = subprocess.run([sys.executable, __file__, "--folder", args.folder, "--size",
                                  args.size, "--contender", kind],
                                 stdout=subprocess.PIPE, text=True, check=True).stdout
            for job, rate in json.loads(out).items():
                rates[kind, job].append(rate)
    print(f"one engine, {args.size} shared locked region, 1 MiB requests x 128, "
          f"{args.rounds} rounds (median GB/s; ratios: median of per-round ratios)")
    print(f"{'contender':<19}" + "".join(f"{job:>13}" for job in JOBS))
    for kind in CONTENDERS:
        print(f"{kind:<19}" + "".join(f"{statistics.median(rates[kind, job]):>13.2f}"
                                      for job in JOBS))
    for kind, base in (("uring, registered", "uring"), ("uring, registered", "aio"),
                       ("uring", "aio")):
        ratios = [statistics.median(a / b for a, b in zip(rates[kind, job], rates[base, job]))
                  for job in JOBS]
        print(f"{kind} / {base}:".ljust(31) + "  ".join(f"{job} {r:.2f}x"
                                                        for job, r in zip(JOBS, ratios)))


if __name__ == "__main__":
    main()
