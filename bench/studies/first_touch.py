"""What this machine charges for the first touch of new shared memory, now and then.

    python bench/studies/first_touch.py --samples 6 --pause 20

Each sample is a fresh process that makes a staging-sized shared region (locked page by
page as it is touched, like the staging space, Note [staging ring]) and fills it twice:
the first fill pays for allocating, zeroing and locking every page, the second is the
copy alone. Then a second region, whose pages another mapping (as a worker's would) has
already made, is filled: what is left is the locking and mapping, page by page. On bare metal the first costs a few times the second; on a virtual machine
whose host reclaims the guest's free memory it can cost far more, and it changes with
the host's state. A plain tensor's first staged operation pays this inside its own time
(bench/studies/staging_first_use.py shows how much of its gap to a locked tensor that is).
"""
import argparse
import ctypes
import subprocess
import sys
import time

from nvmeswap._memory import Mapping
from nvmeswap.io.limits import DEFAULT

STAGING_BYTES = DEFAULT.staging_bytes
from nvmeswap.io.regions import SharedRegion


def fill(address, byte):
    started = time.perf_counter()
    ctypes.memset(address, byte, STAGING_BYTES)
    return (time.perf_counter() - started) * 1e3


def sample():
    region = SharedRegion(STAGING_BYTES, lock_on_fault=True)
    first, second = fill(region.address, 1), fill(region.address, 2)
    region.close()
    region = SharedRegion(STAGING_BYTES, lock_on_fault=True)
    elsewhere = Mapping(region.arena.fd, STAGING_BYTES, region.offset)
    fill(elsewhere.address, 1)
    made_elsewhere = fill(region.address, 2)
    del elsewhere
    region.close()
    print(f"{STAGING_BYTES >> 20} MiB: first fill {first:6.1f} ms, second {second:5.1f} ms, "
          f"first fill of pages made elsewhere {made_elsewhere:5.1f} ms", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--pause", type=float, default=20.0, help="seconds between samples")
    parser.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.sample:
        sample()
        return
    for number in range(arguments.samples):
        if number:
            time.sleep(arguments.pause)
        print(time.strftime("%H:%M:%S "), end="", flush=True)
        subprocess.run([sys.executable, __file__, "--sample"], check=True)


if __name__ == "__main__":
    main()
