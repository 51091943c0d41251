"""What does starting a small request cost on each caller queue (CallerQueue, UringQueue)?

    python bench/studies/queue_post.py --file /nvme/scratch/f.bin --ops 40960 --rounds 7

The queue alone, without the handle's Python: 4 KiB reads at random aligned offsets of
``--file`` (made, ``--file-size``, if missing), 256 at a time, started one by one with
``post`` (a submitting thread of the queue's own), one by one with ``submit`` (from the
caller), or all at once with ``post_many``; then reaped with ``reap(wait_all=True)``.
Each contender in a fresh process every round, their order rotated. Printed: reads per
second (medians) and the median of per-round ratios to CallerQueue.post.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from nvmeswap.units import parse_size

BATCH, OP = 256, 4096
CONTENDERS = ("aio post", "aio submit", "aio post_many", "uring post", "uring submit",
              "uring post_many")


def contender_run(kind, path, ops, seed):
    import numpy as np

    from nvmeswap._queues import CallerQueue
    from nvmeswap._uring import UringQueue
    from nvmeswap.io.regions import SharedRegion

    engine, how = kind.split()
    queue = (CallerQueue if engine == "aio" else UringQueue)(2 * BATCH)
    region = SharedRegion(BATCH * OP)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    offsets = np.random.default_rng(seed).integers(0, os.path.getsize(path) // OP, ops) * OP
    addresses = [region.address + k * OP for k in range(BATCH)]
    start = queue.post if how == "post" else queue.submit
    started = time.perf_counter()
    for first in range(0, ops, BATCH):
        batch = offsets[first:first + BATCH].tolist()
        if how == "post_many":
            assert queue.post_many(first, True, fd, addresses[:len(batch)], OP, batch) == \
                len(batch)
        else:
            for k, offset in enumerate(batch):
                assert start(first, k, True, fd, addresses[k], OP, offset)
        done = queue.reap(wait_all=True)
        assert len(done) == len(batch) and not any(c.failed for c in done)
    rate = ops / (time.perf_counter() - started)
    queue.close()
    os.close(fd)
    region.close()
    return rate


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", default="nvmeswap-bench-data/queue-post.bin")
    parser.add_argument("--file-size", default="1G")
    parser.add_argument("--ops", type=int, default=40960)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        print(contender_run(args.contender, args.file, args.ops, int(time.time())))
        return
    from nvmeswap._uring import probe
    contenders = CONTENDERS if probe() is None else CONTENDERS[:3]
    if probe() is not None:
        print(f"io_uring cannot be used here ({probe()}): CallerQueue alone", file=sys.stderr)
    size = parse_size(args.file_size)
    if not (os.path.exists(args.file) and os.path.getsize(args.file) == size):
        os.makedirs(os.path.dirname(os.path.abspath(args.file)), exist_ok=True)
        with open(args.file, "wb") as f:
            f.writelines(os.urandom(min(1 << 20, size - at)) for at in range(0, size, 1 << 20))
    rates = {kind: [] for kind in contenders}
    for round_number in range(args.rounds):
        shift = round_number % len(contenders)
        for kind in contenders[shift:] + contenders[:shift]:
            out = subprocess.run([sys.executable, __file__, "--file", args.file, "--ops",
                                  str(args.ops), "--contender", kind],
                                 stdout=subprocess.PIPE, text=True, check=True).stdout
            rates[kind].append(float(out))
    print(f"4 KiB random reads, {BATCH} at a time, {args.ops} a round, {args.rounds} rounds "
          "(median reads/s; ratio: median of per-round ratios to aio post)")
    for kind in contenders:
        ratio = statistics.median(a / b for a, b in zip(rates[kind], rates["aio post"]))
        print(f"{kind:<16}{statistics.median(rates[kind]):>10.0f}/s   {ratio:.2f}x")


if __name__ == "__main__":
    main()
