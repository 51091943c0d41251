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
from .options import UsageError, check_folder

JOBS = ("write", "read")


def stripe_folders(text):
    folders = [part for part in text.split(",") if part]
    if len(folders) < 1:
        raise UsageError("--stripe needs at least one folder: --stripe DIR1,DIR2,...")
    if len(set(folders)) != len(folders):
        raise UsageError(f"--stripe names a folder twice: {text}")
    for folder in folders:
        check_folder(folder, "--stripe")
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


def _measure(handle, buffer, path, loops, warmup):
    nbytes = buffer.numel()
    rates = {}
    rates["write"] = nbytes / _time(loops, warmup, lambda: handle.sync_pwrite(buffer, path)) / GB
    rates["read"] = nbytes / _time(loops, warmup, lambda: handle.sync_pread(buffer, path)) / GB
    return rates


def run_stripes(args, handle_args, stripe_bytes):
    """Run the striped measurement; return the exit status."""
    try:
        import torch
    except ImportError:
        raise UsageError("--stripe needs torch (pip install torch)") from None
    from ..aio import aio_handle
    from ..checkpoint.stripes import StripedHandle

    folders = stripe_folders(args.stripe)
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
                                         args.loops, args.warmup_loops)
                    rows.append((folder, rates))
                logical = os.path.join(work[0], "striped.bin")
                striped_rates = _measure(striped, buffer, logical, args.loops,
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
    total = {job: sum(rates[job] for _, rates in rows) for job in JOBS}
    print(f"striped over {len(folders)} folders, {human_size(stripe_bytes)} a stripe, "
          f"{human_size(args.io_size)} per operation, best of {args.loops} loops (GB/s, "
          "GB = 10^9 bytes)")
    width = max(len("striped / sum"), *(len(f) for f in folders))
    print(f"{'device':<{width}}  {'write':>7}  {'read':>7}")
    for folder, rates in rows:
        print(f"{folder:<{width}}  {rates['write']:7.2f}  {rates['read']:7.2f}")
    print(f"{'sum of devices':<{width}}  {total['write']:7.2f}  {total['read']:7.2f}")
    print(f"{'striped':<{width}}  {striped_rates['write']:7.2f}  {striped_rates['read']:7.2f}")
    print(f"{'striped / sum':<{width}}  {striped_rates['write'] / total['write']:7.2f}  "
          f"{striped_rates['read'] / total['read']:7.2f}")
    return 0
