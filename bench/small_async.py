"""Small random async reads: the per-operation cost of the handle, against DeepSpeed and fio.

    python bench/small_async.py --folder /nvme/scratch --ops 20480 --rounds 3

Each contender runs in a fresh process: 4 KiB reads at random aligned offsets of a 1 GiB
file (``--file-size``; page cache dropped first), started with ``async_pread`` into locked buffers and
waited for every 256, as an offloading loop over small tensors would. Reported as reads
per second, the median over rounds, and as ratios to DeepSpeed's aio_handle. fio's
randread with 128 requests in flight is the device's own rate. "queue alone" is the
kernel AIO context under nvmeswap's small async operations (``_queues.CallerQueue``)
driven directly, one ``io_submit`` per read from the calling thread, without the handle's
Python: what the per-operation cost would be if the handle cost nothing. "nvmeswap
batch" starts each 256 reads in one ``async_pread_many`` call (Note [batches]). fio runs
with libaio and with io_uring (registered buffers and files); ratios are to the better. ``--peers none``
leaves DeepSpeed and fio out.
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

from nvmeswap.units import parse_size

BATCH = 256
OP = 4096


def make_file(path, size):
    """Random bytes, ``size`` of them, unless the file is already there at that size."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    with open(path, "wb") as f:
        f.writelines(os.urandom(min(1 << 20, size - start)) for start in range(0, size, 1 << 20))


def contender_run(kind, path, ops, seed):
    """In this process: ``ops`` random 4 KiB async reads; returns reads per second."""
    import numpy as np
    import torch

    if kind == "queue alone":
        return queue_alone_run(path, ops, seed)
    if kind == "nvmeswap batch":
        return batch_run(path, ops, seed)
    if kind == "deepspeed":
        from deepspeed.ops.op_builder import AsyncIOBuilder
        handle = AsyncIOBuilder().load(verbose=False).aio_handle(1048576, 128, False, False, 1)
    else:
        import nvmeswap
        handle = nvmeswap.aio_handle()
    buffer = handle.new_cpu_locked_tensor(BATCH * OP, torch.empty(0, dtype=torch.uint8))
    size = os.path.getsize(path)
    offsets = np.random.default_rng(seed).integers(0, size // OP, ops) * OP
    return timed_async_reads(handle, buffer, path, offsets)


def timed_async_reads(handle, buffer, path, offsets):
    """A 4 KiB ``async_pread`` into ``buffer`` at each of ``offsets``, waited for every
    BATCH; reads per second."""
    start = time.perf_counter()
    for first in range(0, len(offsets), BATCH):
        batch = offsets[first:first + BATCH]
        for k, offset in enumerate(batch):
            handle.async_pread(buffer[k * OP:(k + 1) * OP], path, int(offset))
        assert handle.wait() == len(batch)
    return len(offsets) / (time.perf_counter() - start)


def batch_run(path, ops, seed):
    """The same reads, each 256 started in one call (Note [batches])."""
    import numpy as np
    import torch

    import nvmeswap

    handle = nvmeswap.aio_handle()
    buffer = handle.new_cpu_locked_tensor(BATCH * OP, torch.empty(0, dtype=torch.uint8))
    offsets = (np.random.default_rng(seed).integers(0, os.path.getsize(path) // OP, ops)
               * OP).tolist()
    start = time.perf_counter()
    for first in range(0, ops, BATCH):
        batch = offsets[first:first + BATCH]
        handle.async_pread_many(buffer, path, batch, lengths=[OP] * len(batch))
        assert handle.wait() == len(batch)
    return ops / (time.perf_counter() - start)


def queue_alone_run(path, ops, seed):
    import numpy as np

    from nvmeswap._queues import CallerQueue
    from nvmeswap.io.regions import SharedRegion

    queue, region = CallerQueue(2 * BATCH), SharedRegion(BATCH * OP)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    offsets = np.random.default_rng(seed).integers(0, os.path.getsize(path) // OP, ops) * OP
    start = time.perf_counter()
    for first in range(0, ops, BATCH):
        batch = offsets[first:first + BATCH]
        for k, offset in enumerate(batch):
            assert queue.submit(first + k, 0, True, fd, region.address + k * OP, OP,
                                int(offset))
        done = []
        while len(done) < len(batch):
            done += queue.reap(True)
        # A failed or short read comes back with its errno, or with got != requested.
        assert not any(completion.failed for completion in done)
    rate = ops / (time.perf_counter() - start)
    queue.close()
    os.close(fd)
    return rate


def fio_rate(path, ops, engine="libaio"):
    """fio's 4 KiB random reads at QD128; io_uring with registered buffers and files."""
    extra = ["--fixedbufs=1", "--registerfiles=1"] if engine == "io_uring" else []
    result = subprocess.run(
        ["fio", "--name=small", f"--filename={path}", "--rw=randread", "--bs=4k",
         "--direct=1", f"--ioengine={engine}", *extra, "--iodepth=128",
         f"--number_ios={ops}", "--output-format=json", "--randrepeat=0"],
        capture_output=True, text=True, check=False)
    if result.returncode != 0:      # io_uring refused here (seccomp, sysctl)
        return None
    return json.loads(result.stdout)["jobs"][0]["read"]["iops"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/nvmeswap-small-async")
    parser.add_argument("--ops", type=int, default=20480)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--file-size", default="1G", help="the file the reads read from")
    peers.add_peers_argument(parser)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    path = os.path.join(args.folder, "small-async.bin")
    if args.contender:
        print(contender_run(args.contender, path, args.ops, int(time.time())))
        return
    make_file(path, parse_size(args.file_size))
    running = peers.peers_to_run(args.peers)
    kinds = ["nvmeswap", "nvmeswap batch", "queue alone"] + (
        ["deepspeed"] if "deepspeed" in running else [])
    rates = {kind: [] for kind in kinds + ["fio", "fio io_uring"]}
    for round_number in range(args.rounds):
        for kind in kinds[round_number % len(kinds):] + kinds[:round_number % len(kinds)]:
            peers.drop_page_cache()
            out = subprocess.run([sys.executable, __file__, "--folder", args.folder, "--ops",
                                  str(args.ops), "--contender", kind],
                                 capture_output=True, text=True, check=True).stdout
            rates[kind].append(float(out.split()[-1]))
        if "fio" in running:
            for engine, kind in (("libaio", "fio"), ("io_uring", "fio io_uring")):
                peers.drop_page_cache()
                rate = fio_rate(path, args.ops, engine)
                if rate is not None:
                    rates[kind].append(rate)
    print(f"4 KiB random async reads, wait() every {BATCH}, {args.ops} reads, "
          f"{args.rounds} rounds (median reads/s)")
    fio_best = [max(pair) for pair in zip(rates["fio"], rates["fio io_uring"])] \
        or rates["fio"]
    for kind, values in rates.items():
        if values:
            line = f"  {kind:<14} {statistics.median(values):>10.0f}"
            if not kind.startswith(("deepspeed", "fio")):
                for peer, theirs in (("DeepSpeed", rates.get("deepspeed")),
                                     ("fio's best", fio_best)):
                    if theirs:
                        ratios = [a / b for a, b in zip(values, theirs)]
                        line += f"   {statistics.median(ratios):.2f}x {peer}"
            print(line)


if __name__ == "__main__":
    main()
