"""CPU seconds per GB moved: nvmeswap against DeepSpeed's aio_handle, in one run.

    python bench/cpu_per_byte.py --folder /nvme/scratch --size 1G --rounds 3

Each contender runs in a fresh process with one locked tensor of --size bytes: a first
write (the tensor's first transfer: a worker maps its pages now), then --repeats times
each of a fresh write (file removed first), an overwrite, and a cold read (page cache
dropped), as an offloading loop moves the same buffers again and again. The CPU time of
the process and its children (workers included, every thread, from /proc's schedstat
in nanoseconds) is counted per job, per GB (10^9 bytes), the workers' from the end of
the previous job (so that what they do between jobs counts); a job's figure in a process is
the median of its repeats (one-time costs of the second transfer, such as io_uring's
registration of the buffer, show in the first repeat and in "fresh write, 1st").
Last, "locking": the CPU of making another locked tensor of --size bytes
(``new_cpu_locked_tensor``: what it faults in, locks and, on io_uring, registers), per GB.
Printed per job: each contender's median over rounds and DeepSpeed's over ours (> 1:
nvmeswap needs less CPU per byte).
"""
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

import peers

JOBS = ("locking", "first write", "fresh write, 1st", "fresh write", "overwrite", "cold read")
GB = 10**9


def cpu_ns(pid):
    """Nanoseconds on a CPU of every thread of ``pid``, and of its live children: (own,
    children)."""
    import psutil

    totals = []
    for processes in ([psutil.Process(pid)], psutil.Process(pid).children(recursive=True)):
        total = 0
        for process in processes:
            try:
                for tid in os.listdir(f"/proc/{process.pid}/task"):
                    with open(f"/proc/{process.pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
            except (OSError, psutil.Error):
                pass
        totals.append(total)
    return tuple(totals)


def locking_cpu_per_gb(handle, size):
    """CPU-s per GB of ``new_cpu_locked_tensor`` (what it pins, faults in and registers)."""
    import torch

    me = os.getpid()
    before = sum(cpu_ns(me))
    tensor = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    used = sum(cpu_ns(me)) - before
    handle.free_cpu_locked_tensor(tensor)
    return used / 1e9 / (size / GB)


def contender_run(kind, folder, size, repeats):
    """In this process: CPU-s per GB of each job for ``kind``."""
    if kind == "deepspeed":
        contender = peers.DeepSpeedContender(size, "locked")
    else:
        contender = peers.NvmeswapContender(size, "locked", **({"engine": kind.split()[1]}
                                                                 if " " in kind else {}))
    path = os.path.join(folder, "cpu-per-byte.bin")
    me = os.getpid()
    # Children (workers) are counted from the end of the previous job on: what they do
    # between jobs (io_uring's registration of a region when idle) is charged to the next.
    children_since = [None]

    def cpu_per_gb(job):
        if job in ("first write", "fresh write"):
            peers.fresh(contender, path)
        elif job == "cold read":
            peers.drop_page_cache()
        else:
            os.sync()
        own_before, children_before = cpu_ns(me)
        if children_since[0] is None:
            children_since[0] = children_before
        if job == "cold read":
            contender.read(path)
        else:
            contender.write(path)
        own, children = cpu_ns(me)
        used = own - own_before + children - children_since[0]
        children_since[0] = children
        return used / 1e9 / (size / GB)

    try:
        figures = {"first write": cpu_per_gb("first write")}
        repeated = {job: [] for job in JOBS[2:]}
        for _ in range(repeats):
            for job, values in repeated.items():
                values.append(cpu_per_gb(job))
        figures["fresh write, 1st"] = repeated["fresh write"][0]
        figures.update((job, statistics.median(values)) for job, values in repeated.items())
        figures["locking"] = locking_cpu_per_gb(contender.handle, size)
    finally:
        contender.remove(path)
        contender.close()
    return figures


def main():
    parser = peers.side_by_side_arguments(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each job after the first write runs in a process")
    parser.add_argument("--engines", default="aio",
                        help="comma-separated nvmeswap engines to run (aio, uring)")
    peers.add_peers_argument(parser, peers=("deepspeed",))
    parser.add_argument("--child", nargs=2, help=argparse_hidden())
    args = parser.parse_args()
    from nvmeswap.units import parse_size

    size = parse_size(args.size)
    if args.child:
        print(json.dumps(contender_run(args.child[0], args.child[1], size, args.repeats)))
        return
    os.makedirs(args.folder, exist_ok=True)
    kinds = [f"nvmeswap {engine}" if engine != "aio" else "nvmeswap"
             for engine in args.engines.split(",")]
    kinds += sorted(peers.peers_to_run(args.peers))
    results = {kind: {job: [] for job in JOBS} for kind in kinds}
    for round_number in range(args.rounds):
        for kind in kinds[round_number % len(kinds):] + kinds[:round_number % len(kinds)]:
            out = subprocess.run([sys.executable, __file__, "--size", args.size, "--repeats",
                                  str(args.repeats), "--child", kind, args.folder], capture_output=True, text=True,
                                 check=True)
            for job, value in json.loads(out.stdout.splitlines()[-1]).items():
                results[kind][job].append(value)
        print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    print(f"CPU seconds per GB, {args.size} locked, median of {args.rounds} rounds x "
          f"{args.repeats} repeats (fresh process per contender and round)")
    print(f"{'job':<17}" + "".join(f"{kind:>16}" for kind in kinds)
          + ("   deepspeed / nvmeswap" if "deepspeed" in kinds else ""))
    for job in JOBS:
        medians = {kind: statistics.median(results[kind][job]) for kind in kinds}
        line = f"{job:<17}" + "".join(f"{medians[kind]:>16.4f}" for kind in kinds)
        if "deepspeed" in kinds:
            line += "   " + "  ".join(f"{medians['deepspeed'] / medians[kind]:.2f}"
                                      for kind in kinds if kind != "deepspeed")
        print(line)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
