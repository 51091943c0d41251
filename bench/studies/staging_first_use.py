"""What the first use of the staging space costs a plain tensor's first operation.

    python bench/studies/staging_first_use.py --folder /nvme/scratch --size 1G --rounds 6

Each contender runs in a fresh process, every round, in rotated order: a locked tensor,
a plain tensor, and a plain tensor whose (default) handle has already staged one operation as
large as its staging space, as any handle has after its first large operation. Each
writes a fresh file, overwrites it and reads it back cold. The gap between the two plain rows is the staging space's first
touch (page allocation, zeroing and locking of up to ``staging_bytes``, Note [staging
ring]), which the first staged operation of a handle pays inside its own time; a locked
tensor paid for its pages when it was made. ``--staging-sizes 16M,32M`` adds plain
contenders with smaller staging spaces, whose first touch is smaller.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers

from nvmeswap.io.limits import DEFAULT

STAGING_BYTES = DEFAULT.staging_bytes
from nvmeswap.units import parse_size

CONTENDERS = ("locked", "plain", "plain, staging used")
JOBS = ("fresh write", "overwrite", "cold read")


def child(folder, size, name):
    """One contender's three jobs, in this (fresh) process; prints their seconds."""
    handle_args = {}
    if name.endswith(" staging"):
        handle_args["staging_bytes"] = parse_size(name.split()[1])
    contender = peers.NvmeswapContender(size, "locked" if name == "locked" else "plain",
                                        **handle_args)
    path = os.path.join(folder, "first-use-" + name.replace(" ", "-").replace(",", ""))
    try:
        if name == "plain, staging used":
            scratch = path + ".scratch"
            contender.handle.sync_pwrite(torch.ones(STAGING_BYTES, dtype=torch.uint8), scratch)
            os.unlink(scratch)
        peers.fresh(contender, path)
        seconds = [contender.write(path)]
        os.sync()
        seconds.append(contender.write(path))
        peers.drop_page_cache()
        seconds.append(contender.read(path))
    finally:
        contender.close()
        contender.remove(path)
    print(json.dumps(seconds))


def main():
    parser = peers.side_by_side_arguments(__doc__.splitlines()[0])
    parser.add_argument("--staging-sizes", default="",
                        help="comma-separated staging_bytes for more plain contenders")
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    size = parse_size(arguments.size)
    if arguments.contender:
        child(arguments.folder, size, arguments.contender)
        return
    contenders = CONTENDERS + tuple(f"plain, {staging} staging" for staging
                                    in filter(None, arguments.staging_sizes.split(",")))
    seconds = {name: [] for name in contenders}
    for round_number in range(arguments.rounds):
        shift = round_number % len(contenders)
        for name in contenders[shift:] + contenders[:shift]:
            done = subprocess.run([sys.executable, __file__, "--folder", arguments.folder,
                                   "--size", str(size), "--contender", name],
                                  capture_output=True, text=True, check=True)
            seconds[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {round_number + 1}/{arguments.rounds}: " + ", ".join(
            f"{name} " + "/".join(f"{size / s / 1e9:.2f}" for s in seconds[name][-1])
            for name in contenders) + " GB/s", file=sys.stderr)
    print(f"{size / 2**30:.2f} GiB, {arguments.rounds} rounds, fresh process per contender; "
          "GB/s (median), and the median per-round ratio to the locked tensor")
    print(f"{'contender':<22}" + "".join(f"{job:>22}" for job in JOBS))
    for name in contenders:
        cells = []
        for k in range(len(JOBS)):
            rate = statistics.median(size / s[k] / 1e9 for s in seconds[name])
            ratio = statistics.median(locked[k] / ours[k] for ours, locked
                                      in zip(seconds[name], seconds["locked"]))
            cells.append(f"{rate:.2f} GB/s {ratio:.2f}x")
        print(f"{name:<22}" + "".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
    main()
