"""Every side-by-side figure against DeepSpeed and fio, in one table, from one run.

    python bench/peers_table.py --folder /nvme/scratch --sizes 64M,1G,4G --rounds 3

Each measurement runs in a fresh process of this script, one per contender and round, in
an order rotated each round, so that no contender always follows the same neighbour and a
fresh write (file removed, os.sync first) is also the first operation of its process.
After it come an overwrite and a cold read (page cache dropped); another process then does
nothing but a cold read of that file, the first read of a fresh process.

Bandwidth is in GB/s (1e9 bytes), the median over rounds; ratios are medians of the
per-round ratios, nvmeswap's rate over the peer's (the column "rounds" gives the
lowest and highest of them). fio's figure is its best over bs 1M, 4M,
8M x numjobs 1, 2, 4 (O_DIRECT libaio; the size is split between the jobs, one file each;
iodepth keeps 64 MiB in flight per job, fewer if the job is smaller, at most 128). Small
reads: 4 KiB random ``async_pread`` waited for every 256 (as bench/small_async.py, beside
fio randread at iodepth 128), and synchronous 4 KiB and 64 KiB random reads per second. A
peer that is not installed, or left out with ``--peers``, is printed as missing (``--peers
none`` measures nvmeswap alone).
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import peers
import small_async

from nvmeswap.units import parse_size

JOBS = ("fresh write", "overwrite", "cold read", "first read")
CONTENDERS = ("nvmeswap locked", "nvmeswap plain", "deepspeed locked", "deepspeed plain")
FIO_GRID = [(bs, jobs) for bs in (1 << 20, 4 << 20, 8 << 20) for jobs in (1, 2, 4)]
FIO_IN_FLIGHT = 64 << 20
SECTIONS = ("bandwidth", "small-async", "sync-small", "fio")


def grid_fio(size, numjobs, bs):
    """fio with ``bs`` blocks; iodepth follows from FIO_IN_FLIGHT."""
    return peers.FioContender(size, numjobs=numjobs, bs=bs,
                              iodepth=max(1, min(128, min(FIO_IN_FLIGHT, size) // bs)))


def data_path(folder, name):
    return os.path.join(folder, "table-" + name.replace(" ", "-"))


def rotated(items, round_number):
    shift = round_number % len(items)
    return items[shift:] + items[:shift]


# -- in the child process: one contender, one measurement, one JSON line ---------------
def bandwidth_child(args):
    name, size = args.contender, parse_size(args.size)
    make = peers.NvmeswapContender if name.startswith("nvmeswap") else peers.DeepSpeedContender
    contender = make(size, name.split()[1])
    path = data_path(args.folder, name)
    try:
        if args.worker == "first-read":
            # The parent dropped the page cache: this read is the process's only operation.
            figures = {"first read": contender.read(path)}
        else:
            peers.fresh(contender, path)
            figures = {"fresh write": contender.write(path)}
            os.sync()
            figures["overwrite"] = contender.write(path)
            peers.drop_page_cache()
            figures["cold read"] = contender.read(path)
        if name.startswith("nvmeswap"):
            figures["staging"] = contender.handle.memory_in_use
    finally:
        contender.close()
    return figures


def sync_small_child(args):
    """Synchronous small reads per second through a default handle."""
    import torch
    if args.contender == "deepspeed":
        from deepspeed.ops.op_builder import AsyncIOBuilder
        handle = AsyncIOBuilder().load(verbose=False).aio_handle()
    else:
        import nvmeswap
        handle = nvmeswap.aio_handle()
    buffer = handle.new_cpu_locked_tensor(args.op_size, torch.empty(0, dtype=torch.uint8))
    rates = peers.small_reads(args.folder, {args.contender: (handle, buffer)}, args.op_size,
                        args.small_seconds)
    if hasattr(handle, "close"):
        handle.close()
    return rates[args.contender]


def child(args, *extra):
    """Run this script in a fresh process and return the JSON line it printed."""
    command = [sys.executable, __file__, "--folder", args.folder, *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{shlex.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- in the parent: the rounds ---------------------------------------------------------
def bandwidth(args, size, names, with_fio):
    seconds = {name: {job: [] for job in JOBS + ("staging",)} for name in names}
    fio = {f"{bs >> 20}M x{jobs}": {job: [] for job in JOBS[:3]}
           for bs, jobs in FIO_GRID if size // jobs % bs == 0} if with_fio else {}
    for round_number in range(args.rounds):
        for name in rotated(list(names) + (["fio"] if fio else []), round_number):
            if name == "fio":
                fio_round(args.folder, size, fio)
                continue
            figures = child(args, "--contender", name, "--size", str(size))
            peers.drop_page_cache()
            first = child(args, "--worker", "first-read", "--contender", name,
                          "--size", str(size))
            os.unlink(data_path(args.folder, name))
            if "staging" in figures:  # the peak of both processes
                first["staging"] = max(figures["staging"], first["staging"])
            for key, value in {**figures, **first}.items():
                seconds[name][key].append(value)
        print(f"{size >> 20} MiB: round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    return seconds, fio


def fio_round(folder, size, fio):
    """One round of fio's grid, each (bs, numjobs) with the same three jobs as a contender."""
    for bs, jobs in FIO_GRID:
        if size // jobs % bs:
            continue  # a job smaller than (or not a multiple of) its block size
        contender, path = grid_fio(size // jobs, jobs, bs), data_path(folder, "fio")
        peers.fresh(contender, path)
        figures = fio[f"{bs >> 20}M x{jobs}"]
        figures["fresh write"].append(contender.write(path))
        os.sync()
        figures["overwrite"].append(contender.write(path))
        peers.drop_page_cache()
        figures["cold read"].append(contender.read(path))
        contender.remove(path)


def small_async_rounds(args, kinds, with_fio):
    path = os.path.join(args.folder, "small-async.bin")
    # Once: later runs reuse it, as small_async.py does.
    small_async.make_file(path, parse_size(args.small_file_size))
    rates = {kind: [] for kind in kinds + ([] if "fio" in args.skip else ["fio"])}
    for round_number in range(args.rounds):
        for kind in rotated(kinds, round_number):
            peers.drop_page_cache()
            # Same offsets for every contender of a round, new ones each round.
            rates[kind].append(child(args, "--worker", "small-async", "--contender", kind,
                                     "--seed", str(round_number),
                                     "--small-ops", str(args.small_ops)))
        if with_fio:
            peers.drop_page_cache()
            rates["fio"].append(small_async.fio_rate(path, args.small_ops))
    return rates


def sync_small_rounds(args, kinds):
    rates = {}
    for op_size in (4096, 65536):
        rates[op_size] = {kind: [] for kind in kinds}
        for round_number in range(args.rounds):
            for kind in rotated(kinds, round_number):
                rates[op_size][kind].append(child(args, "--worker", "sync-small", "--contender",
                                                  kind, "--op-size", str(op_size),
                                                  "--small-seconds", str(args.small_seconds)))
    return rates


# -- the table -------------------------------------------------------------------------
def row(measurement, ours, peer, ratios=None, goal=None):
    """One line of the table; ``peer`` None means the peer is missing, not zero.

    The ratio is the median of the per-round ``ratios``; beside it, their lowest and
    highest, so that a goal missed by a round's noise reads apart from one missed by all.
    """
    wanted = "-" if goal is None else f">= {goal}"
    if peer is None:
        return [measurement, ours, "missing", "missing", "-", wanted, "-"]
    ratio = statistics.median(ratios)
    met = "-" if goal is None else ("yes" if ratio >= goal else "no")
    return [measurement, ours, peer, f"{ratio:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}",
            wanted, met]


def per_round_ratios(ours, theirs, seconds=True):
    """nvmeswap's rate over the peer's, round by round."""
    return [t / o if seconds else o / t for o, t in zip(ours, theirs)]


def bandwidth_rows(label, size, seconds, fio):
    def gbs(values):
        return f"{statistics.median(size / s for s in values) / 1e9:.2f} GB/s"

    rows = []
    for job in JOBS:
        locked, plain = seconds["nvmeswap locked"][job], seconds["nvmeswap plain"][job]
        for ours, peer, goal in ((locked, "deepspeed locked", 1.0),
                                 (plain, "deepspeed plain", 1.3 if job == "fresh write" else None)):
            theirs = seconds.get(peer, {}).get(job)
            rows.append(row(f"{label} {job}: {peer.replace('deepspeed', 'nvmeswap')} "
                            f"/ {peer}", gbs(ours), theirs and gbs(theirs),
                            theirs and per_round_ratios(ours, theirs), goal))
        rows.append(row(f"{label} {job}: nvmeswap plain / nvmeswap locked", gbs(plain),
                        gbs(locked), per_round_ratios(plain, locked), 0.8))
        if job in JOBS[:3] and fio is not None:  # None: skipped; empty: not installed
            best = max(fio, key=lambda c: statistics.median(size / s for s in fio[c][job]),
                       default=None)
            rows.append(row(f"{label} {job}: nvmeswap locked / fio best", gbs(locked),
                            best and f"{gbs(fio[best][job])} ({best})",
                            best and per_round_ratios(locked, fio[best][job])))
    staging = max(seconds["nvmeswap plain"]["staging"])
    rows.append([f"{label}: nvmeswap plain staging held", f"{staging / 2**20:.0f} MiB", "-",
                 "-", "-", "<= 64 MiB", "yes" if staging <= 64 << 20 else "no"])
    return rows


def small_rows(async_rates, sync_rates):
    def per_second(values):
        return f"{statistics.median(values):.0f}/s"

    rows = []
    if async_rates:
        ours = async_rates["nvmeswap"]
        for peer, goal in [("deepspeed", 1.0)] + ([("fio", None)] if "fio" in async_rates
                                                  else []):
            theirs = async_rates.get(peer) or None
            label = "fio randread QD128" if peer == "fio" else peer
            rows.append(row(f"4 KiB async random reads: nvmeswap / {label}", per_second(ours),
                            theirs and per_second(theirs),
                            theirs and per_round_ratios(ours, theirs, seconds=False), goal))
    for op_size, rates in (sync_rates or {}).items():
        ours, theirs = rates["nvmeswap"], rates.get("deepspeed")
        rows.append(row(f"sync {op_size >> 10} KiB random reads: nvmeswap / deepspeed",
                        per_second(ours), theirs and per_second(theirs),
                        theirs and per_round_ratios(ours, theirs, seconds=False), 1.2))
    return rows


def print_table(rows):
    header = ["measurement", "nvmeswap", "peer", "ratio", "rounds", "goal", "met"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for line in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}"
                        for i, (cell, w) in enumerate(zip(line, widths))))


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--sizes", default="64M,1G,4G")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small-ops", type=int, default=10240,
                        help="4 KiB async reads per contender and round")
    parser.add_argument("--small-file-size", default="1G",
                        help="the file the 4 KiB async reads read from")
    parser.add_argument("--small-seconds", type=float, default=2.0,
                        help="seconds per synchronous small-read contender and round")
    parser.add_argument("--skip", default="", help="comma-separated: " + ",".join(SECTIONS))
    parser.add_argument("--json", help="also save every raw figure to this file")
    peers.add_peers_argument(parser)
    for hidden in ("--contender", "--size", "--worker", "--seed", "--op-size"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.skip = {s for s in args.skip.split(",") if s}
    if args.skip - set(SECTIONS):
        parser.error(f"--skip takes {','.join(SECTIONS)}")
    if "fio" not in args.peers:
        args.skip.add("fio")
    return args


def main():
    args = arguments()
    os.makedirs(args.folder, exist_ok=True)
    if args.worker == "small-async":
        path = os.path.join(args.folder, "small-async.bin")
        print(json.dumps(small_async.contender_run(args.contender, path, args.small_ops,
                                                   int(args.seed))))
        return
    if args.worker == "sync-small":
        args.op_size = int(args.op_size)
        print(json.dumps(sync_small_child(args)))
        return
    if args.contender:
        print(json.dumps(bandwidth_child(args)))
        return
    running = peers.peers_to_run(p for p in args.peers if p not in args.skip)
    with_deepspeed, with_fio = "deepspeed" in running, "fio" in running
    names = [n for n in CONTENDERS if with_deepspeed or not n.startswith("deepspeed")]
    kinds = ["nvmeswap"] + (["deepspeed"] if with_deepspeed else [])
    raw, rows = {}, []
    if "bandwidth" not in args.skip:
        for label in args.sizes.split(","):
            size = parse_size(label)
            seconds, fio = bandwidth(args, size, names, with_fio)
            raw[f"bandwidth {label}"] = {"seconds": seconds, "fio seconds": fio}
            rows += bandwidth_rows(label, size, seconds, None if "fio" in args.skip else fio)
    async_rates = sync_rates = None
    if "small-async" not in args.skip:
        async_rates = small_async_rounds(args, kinds, with_fio)
        raw["small async reads/s"] = async_rates
    if "sync-small" not in args.skip:
        sync_rates = sync_small_rounds(args, kinds)
        raw["sync small reads/s"] = sync_rates
    rows += small_rows(async_rates, sync_rates)
    context = {"command": shlex.join(sys.orig_argv),
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "kernel": platform.release()}
    print("\n".join(f"{key}: {value}" for key, value in context.items()))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**context, "raw": raw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
