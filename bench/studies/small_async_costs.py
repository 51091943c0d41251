"""Where the caller's time goes in small async reads: the steps of the handle, timed in place.

    python bench/studies/small_async_costs.py --file /nvme/scratch/small-async.bin --ops 20480
    python bench/studies/small_async_costs.py --file /dev/shm/small-async.bin   # no device

The loop of bench/small_async.py (4 KiB random ``async_pread`` into a locked buffer,
``wait()`` every 256), with timers wrapped around the handle's steps. Prints the reads
per second, how the loop's time splits between starting reads and waiting for them, the
calling thread's CPU time per read (user and system), and the time per read inside each
timed step (a step includes the steps it calls; each timer adds ~0.3 us). A file on
tmpfs (O_DIRECT works there since Linux 6.6) shows the handle's cost without a device:
no device interrupts, no waking an idle virtual disk. ``--cpu N`` pins the calling
thread to CPU N after warming up (the queue's submitting thread keeps every CPU), to see
what the device's interrupts cost when they arrive on the caller's CPU
(/proc/interrupts says where they go).
"""
import argparse
import collections
import os
import resource
import time

import numpy as np

from nvmeswap.units import parse_size

OP, BATCH = 4096, 256


class _Timers:
    def __init__(self):
        self.total = collections.Counter()
        self.labels = []

    def wrap(self, owner, name, label):
        self.labels.append(label)
        real = getattr(owner, name)
        total = self.total

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return real(*args, **kwargs)
            finally:
                total[label] += time.perf_counter_ns() - start
        setattr(owner, name, timed)


class _TimedQueue:
    """The caller queue, with ``post`` timed (a C method cannot be wrapped in place)."""

    def __init__(self, queue, total):
        self.__dict__.update(_queue=queue, _total=total)

    def __getattr__(self, name):
        return getattr(self._queue, name)

    def post(self, *args):
        start = time.perf_counter_ns()
        try:
            return self._queue.post(*args)
        finally:
            self._total["  CallerQueue.post"] += time.perf_counter_ns() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", default="/tmp/sa/small-async.bin",
                        help="read from this file (made, --file-size, if missing)")
    parser.add_argument("--file-size", type=parse_size, default="1G")
    parser.add_argument("--ops", type=int, default=20480)
    parser.add_argument("--cpu", type=int, help="pin the calling thread to this CPU")
    args = parser.parse_args()
    import torch

    import nvmeswap
    from nvmeswap.io import quick, scheduler
    from nvmeswap.io.books import Books

    if not os.path.exists(args.file):
        os.makedirs(os.path.dirname(os.path.abspath(args.file)), exist_ok=True)
        with open(args.file, "wb") as f:
            f.writelines(os.urandom(min(1 << 20, args.file_size - start))
                         for start in range(0, args.file_size, 1 << 20))
    timers = _Timers()
    timers.wrap(scheduler.Scheduler, "submit", "Scheduler.submit (all of starting)")
    timers.wrap(scheduler.Scheduler, "_try_quick", "  the quick road (check, route, book)")
    timers.wrap(quick, "io_buffer", "    io_buffer (the tensor's checks)")
    timers.wrap(scheduler, "route", "    route (Note [roads])")
    timers.wrap(quick.ReadDescriptors, "take", "    ReadDescriptors.take (stat, or open)")
    timers.wrap(Books, "book", "    Books.book (and the post)")
    timers.wrap(scheduler.Scheduler, "_begin", "  the ordinary road")
    timers.labels.append("  CallerQueue.post")
    timers.wrap(scheduler.Scheduler, "collect", "Scheduler.collect (wait)")
    handle = nvmeswap.aio_handle()
    buffer = handle.new_cpu_locked_tensor(BATCH * OP, torch.empty(0, dtype=torch.uint8))
    pages = os.path.getsize(args.file) // OP
    offsets = [int(o) * OP for o in np.random.default_rng(1).integers(0, pages, args.ops + 2560)]
    starting = waiting = 0.0

    def run(first_op, ops):
        nonlocal starting, waiting
        for first in range(first_op, first_op + ops, BATCH):
            begin = time.perf_counter()
            for k in range(BATCH):
                handle.async_pread(buffer[k * OP:(k + 1) * OP], args.file, offsets[first + k])
            started = time.perf_counter()
            assert handle.wait() == BATCH
            starting += started - begin
            waiting += time.perf_counter() - started

    run(0, 2560)    # the workers, the caller queue and its thread are up
    scheduler_ = handle._scheduler
    scheduler_.workers.queue = _TimedQueue(scheduler_.workers.queue, timers.total)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    timers.total.clear()
    starting = waiting = 0.0
    before = resource.getrusage(resource.RUSAGE_THREAD)
    begin = time.perf_counter()
    run(2560, args.ops)
    elapsed = time.perf_counter() - begin
    after = resource.getrusage(resource.RUSAGE_THREAD)
    scheduler_.workers.queue = scheduler_.workers.queue._queue
    handle.close()
    per_op = 1e6 / args.ops
    user = (after.ru_utime - before.ru_utime) * per_op
    system = (after.ru_stime - before.ru_stime) * per_op
    print(f"{args.ops / elapsed:,.0f} reads/s, {elapsed * per_op:.1f} us a read: starting "
          f"{starting * per_op:.1f}, waiting {waiting * per_op:.1f}; calling thread's CPU "
          f"{user + system:.1f} (user {user:.1f}, system {system:.1f})")
    for label in timers.labels:
        print(f"  {label:<44} {timers.total[label] / 1e3 / args.ops:6.1f} us a read")


if __name__ == "__main__":
    main()
