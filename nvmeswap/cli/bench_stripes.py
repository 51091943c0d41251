"""``nvmeswap bench --stripe DIR1,DIR2,...``: each device alone, then all of them at once
through one striped transfer (Note [stripes] in checkpoint/stripes.py).

For every folder, --io-size bytes are written and read back with a handle of its own
(the device's own bandwidth); then the same bytes go striped over all the folders. The
table gives GB/s (GB = 10^9 bytes), best of --loops timed loops after --warmup-loops, and
the striped figure over the sum of the devices' own.
"""
import os
import shutil
import sys
import tempfile
import time

from ..units import GB, human_size
from .options import UsageError, check_folder, check_room, write_json

JOBS = ("write", "read")


def stripe_folders(text):
    from ..checkpoint.stripes import folder_named_twice

    folders = [part for part in text.split(",") if part]
    if len(folders) < 1:
        raise UsageError("--stripe needs at least one folder: --stripe DIR1,DIR2,...")
    for folder in folders:
        check_folder(folder, "--stripe")
    twice = folder_named_twice(folders)
    if twice is not None:
        raise UsageError(f"--stripe names a folder twice: {twice[0]} and {twice[1]} are one "
                         "folder")
    return folders


def _time(loops, warmup, move):
    """The best of ``loops`` timings of ``move()``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        move()
    best = None
    for _ in range(loops):
        start = time.perf_counter()
        move()
        elapsed = time.perf_counter() - start
        best = elapsed if best is None else min(best, elapsed)
    return best


def _measure(handle, buffer, path, jobs, loops, warmup):
    """GB/s of each of ``jobs``; a read alone reads a file written untimed first."""
    nbytes = buffer.numel()
    rates = {}
    if "write" in jobs:
        rates["write"] = nbytes / _time(loops, warmup,
                                        lambda: handle.sync_pwrite(buffer, path)) / GB
    else:
        handle.sync_pwrite(buffer, path)
    if "read" in jobs:
        rates["read"] = nbytes / _time(loops, warmup,
                                       lambda: handle.sync_pread(buffer, path)) / GB
    return rates


def run_stripes(args, plan, stripe_bytes):
    """Run the striped measurement of ``plan`` (bench's); return the exit status."""
    try:
        import torch
    except ImportError:
        raise UsageError("--stripe needs torch (pip install torch)") from None
    from ..aio import aio_handle
    from ..checkpoint.stripes import StripedHandle

    folders = stripe_folders(args.stripe)
    for folder in folders:      # its own file, its part of the striped one; three buffers
        check_room(folder, args.io_size + args.io_size // len(folders) + stripe_bytes,
                   3 * args.io_size, "lower --io-size")
    handle_args, jobs = plan["handle"], [job for job in JOBS if job in plan["jobs"]]
    work = [tempfile.mkdtemp(prefix="nvmeswap-stripe-", dir=folder) for folder in folders]
    rows = []
    try:
        with StripedHandle(work, stripe_bytes=stripe_bytes, **handle_args) as striped:
            buffer = striped.new_cpu_locked_tensor(args.io_size, torch.empty(0, dtype=torch.uint8))
            buffer.copy_(torch.randint(0, 256, (args.io_size,), dtype=torch.uint8))
            try:
                for folder, own in zip(folders, work):
                    with aio_handle(**handle_args) as alone:
                        rates = _measure(alone, buffer, os.path.join(own, "alone.bin"),
                                         jobs, args.loops, args.warmup_loops)
                    rows.append((folder, rates))
                logical = os.path.join(work[0], "striped.bin")
                striped_rates = _measure(striped, buffer, logical, jobs, args.loops,
                                         args.warmup_loops)
                check = torch.empty_like(buffer)
                striped.sync_pread(check, logical)
                if not torch.equal(check, buffer):
                    print("nvmeswap bench: the striped read did not return the bytes written",
                          file=sys.stderr)
                    return 1
            finally:
                striped.free_cpu_locked_tensor(buffer)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"nvmeswap bench: {error}", file=sys.stderr)
        return 1
    finally:
        for own in work:
            shutil.rmtree(own, ignore_errors=True)
    total = {job: sum(rates[job] for _, rates in rows) for job in jobs}
    summary = {
        "stripe_bytes": stripe_bytes, "io_size": args.io_size, "loops": args.loops,
        "warmup_loops": args.warmup_loops, "handle": handle_args, "gb_per_s": "best loop",
        "devices": [{"folder": folder, **rates} for folder, rates in rows],
        "sum_of_devices": total, "striped": striped_rates,
        "striped_over_sum": {job: striped_rates[job] / total[job] for job in jobs},
    }
    # The JSON first: a closed pipe on the table must not lose the run.
    saved = not args.json or write_json(args.json, summary, "bench")
    _print_table(summary, folders, jobs, sys.stderr if args.json == "-" else sys.stdout)
    return 0 if saved else 1


def _print_table(summary, folders, jobs, out):
    print(f"striped over {len(folders)} folders, {human_size(summary['stripe_bytes'])} a "
          f"stripe, {human_size(summary['io_size'])} per operation, best of "
          f"{summary['loops']} loops (GB/s, GB = 10^9 bytes)", file=out)
    width = max(len("striped / sum"), *(len(f) for f in folders))
    rows = [(device["folder"], device) for device in summary["devices"]]
    rows += [("sum of devices", summary["sum_of_devices"]), ("striped", summary["striped"]),
             ("striped / sum", summary["striped_over_sum"])]
    print(f"{'device':<{width}}" + "".join(f"  {job:>7}" for job in jobs), file=out)
    for name, rates in rows:
        print(f"{name:<{width}}" + "".join(f"  {rates[job]:7.2f}" for job in jobs), file=out)
