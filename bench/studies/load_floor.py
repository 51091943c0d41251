"""What the device leaves a checkpoint load: one large O_DIRECT stream read against
``torch.load`` and ``nvmeswap.load`` of the same file.

    python bench/studies/load_floor.py --folder /nvme/scratch --size 1G --rounds 3

Writes one ``torch.save`` archive of ``--size`` bytes (one fp32 tensor), then reads it
cold (the page cache dropped before each read; root, or the table says warm) in a fresh
process per contender and round: ``torch.load``; ``nvmeswap.load``; and "O_DIRECT
stream": the whole file read by the process's own kernel AIO context (1 MiB requests,
64 in flight) into fresh plain memory, nothing else (no checks, no pickle, no handle).
The stream is about as fast as the device gets from one process; a load can be no
faster. Prints each one's median seconds and the time 3x ``torch.load`` would need.
"""
import argparse
import json
import os
import select
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers

from nvmeswap.units import parse_size

CONTENDERS = ["torch.load", "nvmeswap.load", "O_DIRECT stream"]
REQUEST = 1 << 20
IN_FLIGHT = 64


def stream(path):
    """Read all of ``path`` with O_DIRECT into fresh memory; the bytes, as a tensor."""
    import torch

    from nvmeswap._queues import CallerQueue

    size = os.path.getsize(path)
    aligned = -(-size // 4096) * 4096
    raw = torch.empty(aligned + 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    memory = raw[start:start + aligned]
    queue = CallerQueue(IN_FLIGHT)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offset = got = in_flight = 0
        while offset < aligned or in_flight:
            while in_flight < IN_FLIGHT and offset < aligned:
                length = min(REQUEST, aligned - offset)
                assert queue.submit(0, 0, True, fd, memory.data_ptr() + offset, length, offset)
                offset += length
                in_flight += 1
            done = queue.reap(False)
            if not done:
                select.select([queue.eventfd], [], [])
            for completion in done:
                assert completion.err == 0, completion     # the last one is short
                got += completion.got
                in_flight -= 1
    finally:
        os.close(fd)
        queue.close()
    assert got == size, (got, size)
    return memory[:size]


def child(contender, path, expected_sum):
    import torch

    import nvmeswap

    started = time.perf_counter()
    if contender in ("torch.load", "nvmeswap.load"):
        loaded = (torch.load if contender == "torch.load" else nvmeswap.load)(path)
        seconds = time.perf_counter() - started
        total = loaded["w"].double().sum().item()
    else:
        data = stream(path)
        seconds = time.perf_counter() - started
        total = None        # raw archive bytes: checked by their length
        assert data.numel() == os.path.getsize(path)
    assert total is None or total == expected_sum, (contender, total, expected_sum)
    print(json.dumps({"seconds": seconds}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None)
    parser.add_argument("--size", default="1G")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        contender, path, expected = arguments.child
        child(contender, path, float(expected))
        return
    import torch

    size = parse_size(arguments.size)
    with tempfile.TemporaryDirectory(prefix="nvmeswap-load-floor-",
                                     dir=arguments.folder) as folder:
        path = os.path.join(folder, "state.pt")
        weights = torch.randn(size // 4, generator=torch.Generator().manual_seed(0))
        torch.save({"w": weights}, path)
        expected = weights.double().sum().item()
        del weights
        times = {name: [] for name in CONTENDERS}
        cold = True
        for round_number in range(arguments.rounds):
            for name in peers.rotated(CONTENDERS, round_number):   # none always first
                cold &= peers.drop_page_cache()
                times[name].append(peers.child_result(
                    [sys.executable, __file__, "--child", name, path, repr(expected)],
                    name)["seconds"])
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"{size / (1 << 30):.2f} GiB archive, {'cold' if cold else 'WARM'} reads, median of "
          f"{arguments.rounds} round(s), seconds")
    for name in CONTENDERS:
        print(f"{name:<18} {median[name]:7.3f}")
    print(f"3x torch.load would take {median['torch.load'] / 3:.3f} s; the stream alone "
          f"is {median['torch.load'] / median['O_DIRECT stream']:.2f}x torch.load")


if __name__ == "__main__":
    main()
