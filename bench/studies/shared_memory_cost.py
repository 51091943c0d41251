"""Does direct I/O from shared memory (memfd, what workers can map) cost more than from
private anonymous memory (what an in-process library like DeepSpeed uses)?

    python bench/studies/shared_memory_cost.py --folder /nvme/scratch

The same engine in one process writes (overwrites) and reads 1 GiB from a locked memfd
mapping and from a locked anonymous mapping, alternating over several rounds.
"""
import argparse
import ctypes
import mmap
import os
import statistics
import time

from nvmeswap._memory import Mapping, buffer_address
from nvmeswap._queues import AioEngine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--size", type=int, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=6)
    arguments = parser.parse_args()
    n = arguments.size
    os.makedirs(arguments.folder, exist_ok=True)
    memfd = os.memfd_create("shared-memory-cost")
    os.ftruncate(memfd, n)
    shared = Mapping(memfd, n)
    shared.lock()
    private = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    private_address = buffer_address(private, True)[0]
    libc = ctypes.CDLL(None)
    libc.mlock(ctypes.c_void_p(private_address), ctypes.c_size_t(n))
    addresses = {"shared (memfd)": shared.address, "private (anonymous)": private_address}
    for address in addresses.values():
        ctypes.memset(address, 7, n)
    engine = AioEngine(1 << 20, 128, False, False)
    path = os.path.join(arguments.folder, "shared-memory-cost.bin")
    seconds = {(name, job): [] for name in addresses for job in ("write", "read")}
    fds = {"write": os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)}
    engine.transfer(0, 0, False, fds["write"], -1, shared.address, n, 0, 4096)
    fds["read"] = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for job in ("write", "read"):
            for round_number in range(arguments.rounds):
                order = list(addresses) if round_number % 2 else list(addresses)[::-1]
                for name in order:
                    started = time.perf_counter()
                    done = engine.transfer(0, 0, job == "read", fds[job], -1, addresses[name],
                                           n, 0, 4096)
                    assert not done.failed, done
                    seconds[name, job].append(time.perf_counter() - started)
    finally:
        for fd in fds.values():
            os.close(fd)
        os.unlink(path)
    for job in ("write", "read"):
        rates = {name: n / statistics.median(seconds[name, job]) / 1e9 for name in addresses}
        ratio = rates["shared (memfd)"] / rates["private (anonymous)"]
        print(f"{job:<6}" + "  ".join(f"{name}: {rate:.2f} GB/s" for name, rate in rates.items())
              + f"  shared/private: {ratio:.2f}")


if __name__ == "__main__":
    main()
