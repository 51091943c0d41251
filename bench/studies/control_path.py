"""What the parent <-> worker control path costs per chunk.

    python bench/studies/control_path.py [--folder /dev/shm]

The file lives on a memory filesystem so that the I/O itself costs almost nothing and
what is left is the control path: building and sending a request, the worker's loop,
the response and its bookkeeping. Two figures:

- round trip: one 4 KiB async_pread + wait() at a time (two process wake-ups each),
  minus the same call run in the calling thread (sync_pread of one request does that,
  Note [small synchronous operations]), which has every cost but the control path;
- pipelined: 20000 async 4 KiB reads submitted back to back and one wait(), per chunk,
  minus the same in-thread call.
"""
import argparse
import os
import time

import torch

import nvmeswap
from nvmeswap._transfers import transfer_in_caller


def per_op(function, count):
    started = time.perf_counter()
    for i in range(count):
        function(i)
    return (time.perf_counter() - started) / count


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/dev/shm")
    parser.add_argument("--count", type=int, default=20000)
    arguments = parser.parse_args()
    path = os.path.join(arguments.folder, "nvmeswap-control-path")
    with open(path, "wb") as f:
        f.write(os.urandom(64 << 20))
    slots = (64 << 20) // 4096
    try:
        with nvmeswap.aio_handle() as h:
            buffer = h.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.uint8))
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            inline = per_op(lambda i: transfer_in_caller(i, 0, True, fd, -1, buffer.data_ptr(),
                                                         4096, (i * 7919 % slots) * 4096, 4096),
                            arguments.count)
            os.close(fd)
            round_trip = per_op(lambda i: (h.async_pread(buffer, path, (i * 7919 % slots) * 4096),
                                           h.wait()), arguments.count)
            started = time.perf_counter()
            for i in range(arguments.count):
                h.async_pread(buffer, path, (i * 7919 % slots) * 4096)
            h.wait()
            pipelined = (time.perf_counter() - started) / arguments.count
            sync_call = per_op(lambda i: h.sync_pread(buffer, path, (i * 7919 % slots) * 4096),
                               arguments.count)
    finally:
        os.unlink(path)
    print(f"engine alone, 4 KiB read in this thread:        {inline * 1e6:7.1f} us")
    print(f"sync_pread, whole call in this thread:          {sync_call * 1e6:7.1f} us")
    print(f"async_pread + wait, one at a time:              {round_trip * 1e6:7.1f} us"
          f"   control path round trip {(round_trip - sync_call) * 1e6:7.1f} us")
    print(f"async_pread x {arguments.count}, one wait (pipelined):  {pipelined * 1e6:7.1f} us"
          f"   control path per chunk  {(pipelined - sync_call) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
