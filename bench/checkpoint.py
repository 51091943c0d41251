"""Checkpoints: nvmeswap against torch.save/torch.load and DCP's FileSystemWriter/Reader.

    python bench/checkpoint.py --folder /nvme/scratch [--size 1G] [--rounds 1] [--layers 16]

A state dict of about ``--size`` bytes (a model's ``--layers`` layers, fp32 weights and
bf16 copies, as a mixed-precision trainer keeps them: two tensors a layer) is saved and loaded by each contender in a
fresh process of its own; before every load the page cache is dropped (needs root; the
table says if it could not), so loads read the device. Each load is checked byte for byte
against the state saved. Times are what a training script waits for: the call, from
start to return. ``torch.save`` does not fsync, so its time ends before the bytes are on
the device; "torch.save + fsync" adds the fsync, as every other contender durably
writes. nvmeswap's calls include starting their handle (``nvmeswap.save`` makes one).
Every save writes a fresh file, and the page cache is synced before and after each, so
no contender pays for another's write-back.

"(kept)": the same call on a Checkpointer that a training loop keeps (its handle started
and its ring allocated by an earlier small checkpoint; that is not timed).

Async: in one process, ``Checkpointer.save`` (synchronous) and then
``Checkpointer.async_save`` of the same state; the blocked time is how long the
caller's thread waits before ``async_save`` returns (the snapshot): the median of calls
2 to 6 (the first allocates the snapshot buffer), against the synchronous save's time;
then one ``nvmeswap.async_save`` (the one-call form: its own handle and snapshot).
Then ``background_snapshot=True`` (Note [snapshot in the background]): the call, then a
stand-in for the next forward and backward pass (matrix products on other tensors, as
long as the synchronous save alone), then ``snapshot_taken.result()``; blocked is the
call plus that last wait, and "slowed" is how much longer the stand-in took than alone
(the copy's CPU time, taken from the computation beside it); medians of calls 2 to 6.

``--device cuda``: the state lives on the GPU (saves copy it to the host, loads put it
back, load_into and DCP's readers fill tensors on the GPU); every time ends after a
``torch.cuda.synchronize()``, and the async part's stand-in computation runs on the GPU.

Striping: ``--stripe DIR1,DIR2,...`` adds a striped nvmeswap save and load over those
folders, against the plain one, each also on a kept striping Checkpointer (its handle
per folder started once).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import peers
import torch

from nvmeswap.units import GB, parse_size

SAVERS = ["torch.save", "torch.save + fsync", "nvmeswap.save", "nvmeswap.save (kept)",
          "dcp FileSystemWriter", "dcp NvmeFileSystemWriter"]
LOADERS = ["torch.load", "nvmeswap.load", "nvmeswap.load (kept)", "nvmeswap.load_into",
           "dcp FileSystemReader", "dcp NvmeFileSystemReader"]


def make_state(nbytes, device="cpu", layers=16):
    """``layers`` layers of fp32 weights (4 bytes a value) each with a bf16 copy (2
    bytes): about ``nbytes`` in all, deterministic, on ``device``."""
    made = torch.Generator().manual_seed(0)
    per_layer = nbytes // layers // 6          # values per layer: 4 + 2 bytes each
    state = {}
    for layer in range(layers):
        weight = torch.randn(max(1, per_layer // 1024), 1024, generator=made)
        state[f"layers.{layer}.weight"] = weight.to(device)
        state[f"layers.{layer}.weight_bf16"] = weight.bfloat16().to(device)
    state["step"] = 1000
    return state


def state_bytes(state):
    return sum(v.numel() * v.element_size() for v in state.values()
               if isinstance(v, torch.Tensor))


def same(a, b):
    """Every tensor of ``a`` is in ``b`` with the same bytes (load_into leaves the
    non-tensor values of its target alone)."""
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
               for k in a if isinstance(a[k], torch.Tensor))


def child(args):
    """One contender, one job, in this (fresh) process: print its JSON."""
    import torch.distributed.checkpoint as dcp

    import nvmeswap
    from nvmeswap.checkpoint.dcp import NvmeFileSystemReader, NvmeFileSystemWriter

    state = make_state(args.size, args.device, args.layers)
    where = args.path

    def finished():
        if args.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter()

    result = {"contender": args.contender}
    kept = None
    if "(kept)" in args.contender:
        # A training loop keeps its Checkpointer: started, its workers warm, its ring
        # allocated by an earlier (small) checkpoint.
        kept = (nvmeswap.Checkpointer(stripe_folders=args.stripe.split(","))
                if "striped" in args.contender else nvmeswap.Checkpointer())
        warm = os.path.join(os.path.dirname(where), "warm-up.pt")
        kept.save({"w": torch.ones(1 << 20)}, warm)
        kept.free(kept.load(warm))
        os.unlink(warm)
    if args.job == "save":
        started = time.perf_counter()
        if args.contender.startswith("torch.save"):
            torch.save(state, where)
            if "fsync" in args.contender:
                fd = os.open(where, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        elif args.contender == "nvmeswap.save":
            nvmeswap.save(state, where)
        elif args.contender in ("nvmeswap.save (kept)", "nvmeswap.save striped (kept)"):
            kept.save(state, where)
        elif args.contender == "nvmeswap.save striped":
            with nvmeswap.Checkpointer(stripe_folders=args.stripe.split(",")) as saver:
                saver.save(state, where)
        elif args.contender == "dcp FileSystemWriter":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(where))
        elif args.contender == "dcp NvmeFileSystemWriter":
            dcp.save(state, storage_writer=NvmeFileSystemWriter(where))
        result["seconds"] = finished() - started
    elif args.job == "load":
        result["cold"] = peers.drop_page_cache()
        into = None
        if args.contender in ("nvmeswap.load_into", "dcp FileSystemReader",
                              "dcp NvmeFileSystemReader"):
            into = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0
                    for k, v in state.items()}
            for value in into.values():        # the model's memory exists already
                if isinstance(value, torch.Tensor):
                    value.view(torch.uint8).fill_(0)
        started = time.perf_counter()
        if args.contender == "torch.load":
            loaded = torch.load(where)
        elif args.contender in ("nvmeswap.load", "nvmeswap.load striped"):
            loaded = nvmeswap.load(where)
        elif args.contender in ("nvmeswap.load (kept)", "nvmeswap.load striped (kept)"):
            loaded = kept.load(where)
        elif args.contender == "nvmeswap.load_into":
            loaded = nvmeswap.load_into(where, into)
        elif args.contender == "dcp FileSystemReader":
            dcp.load(into, storage_reader=dcp.FileSystemReader(where))
            loaded = into
        elif args.contender == "dcp NvmeFileSystemReader":
            dcp.load(into, storage_reader=NvmeFileSystemReader(where))
            loaded = into
        result["seconds"] = finished() - started
        result["identical"] = same(state, loaded)
        if kept is not None:
            kept.free(loaded)
    elif args.job == "async":
        with nvmeswap.Checkpointer() as saver:
            started = time.perf_counter()
            saver.save(state, where)
            result["sync_seconds"] = finished() - started
            blocked = []
            totals = []
            for _ in range(6):
                started = time.perf_counter()
                future = saver.async_save(state, where)
                blocked.append(time.perf_counter() - started)
                future.result()
                totals.append(finished() - started)
            result["first_blocked_seconds"] = blocked[0]
            result["blocked_seconds"] = statistics.median(blocked[1:])
            result["async_total_seconds"] = statistics.median(totals[1:])
            result["identical"] = same(state, torch.load(where))
            result.update(background_snapshots(saver, state, where, result["sync_seconds"],
                                               args.device))
            result["identical"] = result["identical"] and same(state, torch.load(where))
        started = time.perf_counter()
        future = nvmeswap.async_save(state, where)      # one call: a snapshot of its own
        result["one_call_blocked_seconds"] = time.perf_counter() - started
        future.result()
        result["one_call_total_seconds"] = finished() - started
        result["identical"] = result["identical"] and same(state, torch.load(where))
    if kept is not None:
        kept.close()
    print(json.dumps(result))


def background_snapshots(saver, state, where, seconds, device):
    """Saves with ``background_snapshot=True`` around a stand-in computation of about
    ``seconds`` alone on ``device``: what the caller waited for, and how much the
    computation slowed."""
    size = 512 if device == "cpu" else 4096
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)

    def step(count):
        started = time.perf_counter()
        for _ in range(count):
            torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    step(5)                                     # warm: the first products are slower
    count = max(1, round(seconds / (step(20) / 20)))
    alone = statistics.median(step(count) for _ in range(3))
    blocked, slowed = [], []
    for _ in range(6):
        started = time.perf_counter()
        future = saver.async_save(state, where, background_snapshot=True)
        call = time.perf_counter() - started
        worked = step(count)
        started = time.perf_counter()
        future.snapshot_taken.result()
        blocked.append(call + time.perf_counter() - started)
        slowed.append(worked - alone)
        future.result()
    return {"step_seconds": alone, "background_blocked_seconds": statistics.median(blocked[1:]),
            "background_slowed_seconds": statistics.median(slowed[1:])}


def run_child(args, contender, job, path):
    command = [sys.executable, __file__, "--child", "--contender", contender, "--job", job,
               "--path", path, "--size", str(args.size), "--device", args.device,
               "--layers", str(args.layers)]
    if args.stripe:
        command += ["--stripe", args.stripe]
    return peers.child_result(command, f"{contender} {job}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="where the checkpoints go")
    parser.add_argument("--size", default="1G", type=parse_size)
    parser.add_argument("--rounds", default=1, type=int)
    parser.add_argument("--layers", default=16, type=int,
                        help="layers of the state, two tensors each (default 16)")
    parser.add_argument("--stripe", default=None, metavar="DIR1,DIR2,...")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the state lives (cuda: on the GPU)")
    parser.add_argument("--only", default=None, metavar="NAME,...",
                        help="run only the contenders whose names start with one of these "
                             "(say 'nvmeswap'); the async part only if one starts with "
                             "'nvmeswap.async'")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.folder:
        os.makedirs(args.folder, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="nvmeswap-ckpt-", dir=args.folder or os.getcwd())
    savers, loaders = list(SAVERS), list(LOADERS)
    stripe_work = []
    if args.stripe:
        for d in args.stripe.split(","):
            os.makedirs(d, exist_ok=True)
        stripe_work = [tempfile.mkdtemp(prefix="nvmeswap-ckpt-", dir=d)
                       for d in args.stripe.split(",")]
        args.stripe = ",".join(stripe_work)
        savers += ["nvmeswap.save striped", "nvmeswap.save striped (kept)"]
        loaders += ["nvmeswap.load striped", "nvmeswap.load striped (kept)"]
    paths = {
        "torch.save": "torch.pt", "torch.save + fsync": "torch.pt", "nvmeswap.save": "ours.pt",
        "nvmeswap.save (kept)": "ours.pt", "nvmeswap.load (kept)": "ours.pt",
        "dcp FileSystemWriter": "dcp", "dcp NvmeFileSystemWriter": "dcp-nvme",
        "torch.load": "torch.pt", "nvmeswap.load": "ours.pt", "nvmeswap.load_into": "ours.pt",
        "dcp FileSystemReader": "dcp", "dcp NvmeFileSystemReader": "dcp-nvme",
    }
    if args.only:
        wanted = tuple(args.only.split(","))
        savers = [name for name in savers if name.startswith(wanted)]
        loaders = [name for name in loaders if name.startswith(wanted)]
        if loaders and not savers:
            parser.error("--only: the loads read what the saves wrote; name a save too "
                         "(nvmeswap.save, torch.save, ...)")
    times = {name: [] for name in savers + loaders}
    cold = True
    identical = True
    try:
        nbytes = state_bytes(make_state(args.size, layers=args.layers))
        for round_number in range(args.rounds):
            # Each round starts with the next contender: none always goes first.
            for name in peers.rotated(savers, round_number):
                path = os.path.join(stripe_work[0], "striped.pt") if "striped" in name \
                    else os.path.join(folder, paths[name])
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.unlink(path)
                os.sync()       # nobody's dirty pages are written back during the next one
                times[name].append(run_child(args, name, "save", path)["seconds"])
                os.sync()
            for name in peers.rotated(loaders, round_number):
                path = os.path.join(stripe_work[0], "striped.pt") if "striped" in name \
                    else os.path.join(folder, paths[name])
                got = run_child(args, name, "load", path)
                times[name].append(got["seconds"])
                cold &= got["cold"]
                if not got["identical"]:
                    identical = False
                    print(f"{name}: the bytes loaded differ from those saved", file=sys.stderr)
        for name in os.listdir(folder):     # the loads are done: room for the async saves
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        run_async = not args.only or any(name.startswith("nvmeswap.async")
                                         for name in args.only.split(","))
        asynchronous = None if not run_async else run_child(
            args, "nvmeswap.async_save", "async", os.path.join(folder, "async.pt"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        for work in stripe_work:
            shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"state: {nbytes / (1 << 30):.2f} GiB (fp32 + bf16, {2 * args.layers} tensors) "
          f"on {args.device}, "
          f"{args.rounds} round(s), "
          f"median seconds; loads {'cold (page cache dropped)' if cold else 'WARM'}; "
          f"every load byte-identical: {identical}")
    print(f"{'contender':<28} {'seconds':>8} {'GB/s':>6}")
    for name in savers + loaders:
        print(f"{name:<28} {median[name]:8.3f} {nbytes / median[name] / GB:6.2f}")
    ratios = [
        ("nvmeswap.save vs torch.save", "torch.save", "nvmeswap.save"),
        ("nvmeswap.save vs torch.save + fsync", "torch.save + fsync", "nvmeswap.save"),
        ("nvmeswap.save vs dcp FileSystemWriter", "dcp FileSystemWriter", "nvmeswap.save"),
        ("kept Checkpointer.save vs torch.save", "torch.save", "nvmeswap.save (kept)"),
        ("kept Checkpointer.save vs torch.save + fsync", "torch.save + fsync",
         "nvmeswap.save (kept)"),
        ("dcp Nvme vs dcp FileSystemWriter", "dcp FileSystemWriter",
         "dcp NvmeFileSystemWriter"),
        ("nvmeswap.load vs torch.load", "torch.load", "nvmeswap.load"),
        ("kept Checkpointer.load vs torch.load", "torch.load", "nvmeswap.load (kept)"),
        ("nvmeswap.load_into vs torch.load", "torch.load", "nvmeswap.load_into"),
        ("nvmeswap.load vs dcp FileSystemReader", "dcp FileSystemReader", "nvmeswap.load"),
        ("dcp Nvme vs dcp FileSystemReader", "dcp FileSystemReader",
         "dcp NvmeFileSystemReader"),
    ]
    if args.stripe:
        ratios += [("striped save vs nvmeswap.save", "nvmeswap.save", "nvmeswap.save striped"),
                   ("striped load vs nvmeswap.load", "nvmeswap.load", "nvmeswap.load striped"),
                   ("kept striped save vs kept save", "nvmeswap.save (kept)",
                    "nvmeswap.save striped (kept)"),
                   ("kept striped load vs kept load", "nvmeswap.load (kept)",
                    "nvmeswap.load striped (kept)")]
    print("speed-ups (the peer's time / nvmeswap's):")
    for label, peer, ours in ratios:
        if peer in median and ours in median:
            print(f"  {label:<42} {median[peer] / median[ours]:5.2f}x")
    if asynchronous is None:
        return
    sync, blocked = asynchronous["sync_seconds"], asynchronous["blocked_seconds"]
    print(f"async_save: caller blocked {blocked:.3f} s (first call, allocating the snapshot: "
          f"{asynchronous['first_blocked_seconds']:.3f} s), whole save "
          f"{asynchronous['async_total_seconds']:.3f} s; synchronous save {sync:.3f} s; "
          f"blocked / synchronous = {blocked / sync:.2f}; byte-identical: "
          f"{asynchronous['identical']}")
    background = asynchronous["background_blocked_seconds"]
    slowed = asynchronous["background_slowed_seconds"]
    print(f"background snapshot: caller blocked {background:.3f} s, a "
          f"{asynchronous['step_seconds']:.3f} s computation beside the copy slowed "
          f"{slowed:.3f} s; blocked / synchronous = {background / sync:.2f}, (blocked + "
          f"slowed) / synchronous = {(background + slowed) / sync:.2f}")
    one_call = asynchronous["one_call_blocked_seconds"]
    print(f"one-call nvmeswap.async_save: caller blocked {one_call:.3f} s, whole save "
          f"{asynchronous['one_call_total_seconds']:.3f} s; blocked / synchronous = "
          f"{one_call / sync:.2f}")


if __name__ == "__main__":
    main()
