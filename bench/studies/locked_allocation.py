"""What locking a fresh shared mapping costs: mlock(2) alone against Note [parallel
population] (locked on fault, then faulted in from one thread per CPU).

    python bench/studies/locked_allocation.py --size 1G --rounds 3

Each round maps a fresh memfd of ``--size`` and locks all of it three ways: ``mlock(2)``
(what ``Mapping.lock`` did before), ``Mapping.lock`` with the process pinned to one CPU
(one populating thread), and ``Mapping.lock`` on every CPU the process may use. Prints
seconds per GiB, the best of the rounds, and checks that each way leaves every page
locked (VmLck).
"""
import argparse
import ctypes
import os
import time

from nvmeswap._memory import Mapping
from nvmeswap.units import parse_size

libc = ctypes.CDLL(None, use_errno=True)


def locked_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmLck"))


def timed(size, way, cpus):
    fd = os.memfd_create("locked-allocation")
    os.ftruncate(fd, size)
    mapping = Mapping(fd, size)
    before = locked_kib()
    all_cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        start = time.perf_counter()
        if way == "mlock(2)":
            if libc.mlock(ctypes.c_void_p(mapping.address), ctypes.c_size_t(size)) != 0:
                raise OSError(ctypes.get_errno(), "mlock")
        else:
            mapping.lock()
        seconds = time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, all_cpus)
    assert locked_kib() - before == size // 1024, f"{way}: not all of it locked"
    del mapping
    os.close(fd)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()
    size = parse_size(arguments.size)
    cpus = sorted(os.sched_getaffinity(0))
    ways = {"mlock(2)": set(cpus), "Mapping.lock, 1 CPU": {cpus[0]},
            f"Mapping.lock, every CPU ({len(cpus)})": set(cpus)}
    best = {way: float("inf") for way in ways}
    for _ in range(arguments.rounds):
        for way, allowed in ways.items():
            best[way] = min(best[way], timed(size, way, allowed))
    gib = size / (1 << 30)
    for way, seconds in best.items():
        print(f"{way:<28} {seconds / gib:6.3f} s a GiB "
              f"({best['mlock(2)'] / seconds:4.2f}x mlock(2))")


if __name__ == "__main__":
    main()
