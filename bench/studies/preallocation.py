"""Does preallocating help a write into a fresh file? (Note [preallocation] in files.py)

    python bench/studies/preallocation.py --folder /nvme/scratch --size 1G --rounds 4

Interleaves, round by round: nvmeswap writing a fresh file (it preallocates), the same
with preallocation switched off, and an overwrite of an existing file (the ceiling).
"""
import argparse
import os
import statistics
import time

import torch

import nvmeswap
from nvmeswap.io.limits import Limits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--size", type=int, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=4)
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    path = os.path.join(arguments.folder, "preallocation.bin")
    seconds = {"fresh, preallocated": [], "fresh, not preallocated": [], "overwrite": []}
    # Locked tensors belong to the process: both handles move this one without a copy.
    with nvmeswap.aio_handle() as h, \
            nvmeswap.aio_handle(_limits=Limits(preallocate_min=1 << 62)) as never:
        tensor = h.new_cpu_locked_tensor(arguments.size, torch.empty(0, dtype=torch.uint8))
        tensor.random_(0, 255)
        for _ in range(arguments.rounds):
            for case, times in seconds.items():
                if case != "overwrite" and os.path.exists(path):
                    os.unlink(path)
                os.sync()
                handle = never if case == "fresh, not preallocated" else h
                started = time.perf_counter()
                handle.sync_pwrite(tensor, path)
                times.append(time.perf_counter() - started)
    os.unlink(path)
    for case, values in seconds.items():
        print(f"{case:<26} {arguments.size / statistics.median(values) / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
