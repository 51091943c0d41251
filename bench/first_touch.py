"""What this machine charges for the first touch of new shared memory, now and then.

    python bench/first_touch.py --samples 6 --pause 20

Each sample is a fresh process that makes a staging-sized shared region (locked page by
page as it is touched, like the staging space, Note [staging ring]) and fills it twice:
the first fill pays for allocating, zeroing and locking every page, the second is the
copy alone. On bare metal the first costs a few times the second; on a virtual machine
whose host reclaims the guest's free memory it can cost far more, and it changes with
the host's state. A plain tensor's first staged operation pays this inside its own time
(bench/staging_first_use.py shows how much of its gap to a locked tensor that is).
"""
import argparse
import ctypes
import subprocess
import sys
import time

from nvmeswap.io.placement import STAGING_BYTES
from nvmeswap.io.regions import SharedRegion


def sample():
    region = SharedRegion(STAGING_BYTES, lock_on_fault=True)
    fills = []
    for byte in (1, 2):
        started = time.perf_counter()
        ctypes.memset(region.address, byte, region.size)
        fills.append(time.perf_counter() - started)
    region.close()
    print(f"{STAGING_BYTES >> 20} MiB: first fill {fills[0] * 1e3:6.1f} ms, "
          f"second {fills[1] * 1e3:5.1f} ms", flush=True)


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
