"""``nvmeswap bench``: the throughput test (DeepSpeed's ``ds_io`` job).

Each rank is a process of its own with its own handle and files, as in per-rank
offload; ranks start their timed loops together behind a barrier.
"""
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time

from ..errors import ValidationError
from ..units import format_size, human_size, size_argument

BUFFERS = ("locked", "pinned", "plain", "numpy")


def add_arguments(parser):
    parser.add_argument("--folder", action="append", dest="folders", metavar="DIR",
                        help="folder to put the files in; repeat for several devices "
                             "(default: a fresh folder here, removed afterwards)")
    parser.add_argument("--io-size", "--io_size", default="1G", type=size_argument,
                        help="bytes per operation and rank, e.g. 400M (default 1G)")
    parser.add_argument("--read", action="store_true", help="measure reads")
    parser.add_argument("--write", action="store_true", help="measure writes")
    parser.add_argument("--block-size", "--block_size", type=size_argument, default=None)
    parser.add_argument("--queue-depth", "--queue_depth", type=int, default=None)
    parser.add_argument("--single-submit", "--single_submit", action="store_true", default=None)
    parser.add_argument("--overlap-events", "--overlap_events", action="store_true",
                        default=None)
    parser.add_argument("--sequential-requests", "--sequential_requests", action="store_false",
                        dest="overlap_events", help="the opposite of --overlap-events")
    parser.add_argument("--intra-op-parallelism", "--io-parallel", "--io_parallel", type=int,
                        dest="intra_op_parallelism", default=None)
    parser.add_argument("--loops", type=int, default=3, help="timed operations (default 3)")
    parser.add_argument("--warmup-loops", "--warmup_loops", type=int, default=1)
    parser.add_argument("--validate", action="store_true",
                        help="re-read and compare every transfer")
    parser.add_argument("--buffer", choices=BUFFERS, default="locked")
    parser.add_argument("--gpu", action="store_true",
                        help="use CUDA tensors (rank r on GPU r modulo the GPU count)")
    parser.add_argument("--gds", "--use_gds", action="store_true",
                        help="use gds_handle and cuFile-registered CUDA tensors (implies --gpu)")
    parser.add_argument("--ranks", type=int, default=1, help="independent rank processes")
    parser.add_argument("--json", metavar="FILE", help="write all results to FILE")
    parser.add_argument("--config", metavar="FILE", help="handle settings from a tuner result")


def run(args):
    """Run the job; return the exit status."""
    try:
        plan = _plan(args)
    except (ValueError, OSError) as error:
        print(f"nvmeswap bench: {error}", file=sys.stderr)
        return 2
    made_folder = None
    if not plan["folders"]:
        made_folder = tempfile.mkdtemp(prefix="nvmeswap-bench-", dir=os.getcwd())
        plan["folders"] = [made_folder]
    try:
        _check_space(plan)
        results = _run_ranks(plan)
    except (ValueError, OSError, RuntimeError, ValidationError) as error:
        print(f"nvmeswap bench: {error}", file=sys.stderr)
        return 1
    finally:
        if made_folder:
            shutil.rmtree(made_folder, ignore_errors=True)
    summary = _summarise(plan, results)
    _print_report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def _plan(args):
    from ..config import handle_arguments
    handle_args = {}
    if args.config:
        with open(args.config) as f:
            handle_args.update(handle_arguments(f.read()))
    for name in ("block_size", "queue_depth", "single_submit", "overlap_events",
                 "intra_op_parallelism"):
        if getattr(args, name) is not None:
            handle_args[name] = getattr(args, name)
    if (args.gpu or args.gds) and not _gpu_count():
        raise ValueError("--gpu and --gds need a CUDA GPU, and torch sees none here")
    if args.io_size <= 0 or args.loops < 1 or args.warmup_loops < 0 or args.ranks < 1:
        raise ValueError("--io-size, --loops and --ranks must be positive")
    for folder in args.folders or []:
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"folder {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"folder {folder} is not writable")
    jobs = [job for job, wanted in (("write", args.write), ("read", args.read)) if wanted]
    return {
        "folders": list(args.folders or []),
        "io_size": args.io_size,
        "jobs": jobs or ["write", "read"],
        "handle": handle_args,
        "loops": args.loops,
        "warmup_loops": args.warmup_loops,
        "validate": args.validate,
        "buffer": "cuda-pinned" if args.gds else "cuda" if args.gpu else args.buffer,
        "ranks": args.ranks,
        "progress": sys.stderr.isatty(),
    }


def _check_space(plan):
    for index, folder in enumerate(plan["folders"]):
        ranks_here = len(range(index, plan["ranks"], len(plan["folders"])))
        need = ranks_here * plan["io_size"]
        free = shutil.disk_usage(folder).free
        if need > free:
            raise OSError(f"folder {folder} has {human_size(free)} free; the job "
                          f"needs {human_size(need)} ({ranks_here} rank(s) x --io-size)")


def _run_ranks(plan):
    if plan["ranks"] == 1:
        return [_rank_job(0, plan, None)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(plan["ranks"])
    results = context.Queue()
    ranks = [context.Process(target=_rank_main, args=(rank, {**plan, "progress": False},
                                                      barrier, results))
             for rank in range(plan["ranks"])]
    for process in ranks:
        process.start()
    try:
        collected = [results.get() for _ in ranks]
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    failures = [r["error"] for r in collected if "error" in r]
    if failures:
        raise RuntimeError(failures[0])
    return sorted(collected, key=lambda r: r["rank"])


def _rank_main(rank, plan, barrier, results):
    try:
        results.put(_rank_job(rank, plan, barrier))
    except BaseException as error:
        barrier.abort()
        results.put({"rank": rank, "error": f"rank {rank}: {type(error).__name__}: {error}"})


def _rank_job(rank, plan, barrier):
    """One rank: its own handle, buffer and file; returns seconds per loop and CPU time."""
    import psutil

    from ..aio import aio_handle
    from ..gds import gds_handle

    folder = plan["folders"][rank % len(plan["folders"])]
    path = os.path.join(folder, f"nvmeswap-bench-rank{rank}.bin")
    result = {"rank": rank, "file": path, "jobs": {}}
    setup_started = time.perf_counter()
    make_handle = gds_handle if plan["buffer"] == "cuda-pinned" else aio_handle
    with make_handle(**plan["handle"]) as handle:
        buffer = _make_buffer(handle, plan["buffer"], plan["io_size"], rank)
        _fill(buffer)
        setup_seconds = time.perf_counter() - setup_started
        if "write" not in plan["jobs"]:
            handle.sync_pwrite(buffer, path)         # something to read
        if barrier is not None:
            barrier.wait()
        try:
            for job in plan["jobs"]:
                job_started = time.perf_counter()
                call = handle.pread if job == "read" else handle.pwrite
                for _ in range(plan["warmup_loops"]):
                    call(buffer, path, plan["validate"], False, 0)
                cpu_before = _cpu_seconds(psutil.Process())
                seconds = []
                for loop in range(plan["loops"]):
                    loop_started = time.perf_counter()
                    call(buffer, path, plan["validate"], False, 0)
                    seconds.append(time.perf_counter() - loop_started)
                    if plan["progress"]:
                        print(f"\r{job}: loop {loop + 1}/{plan['loops']}", end="",
                              file=sys.stderr, flush=True)
                if plan["progress"]:
                    print(file=sys.stderr)
                result["jobs"][job] = {
                    "seconds": seconds,
                    "cpu_seconds": _cpu_seconds(psutil.Process()) - cpu_before,
                    # Setup, warm-up and timed loops, per timed loop (ds_io's "E2E").
                    "e2e_seconds": (setup_seconds + time.perf_counter() - job_started)
                                   / plan["loops"],
                }
        finally:
            if os.path.exists(path):
                os.unlink(path)
    return result


def _make_buffer(handle, kind, nbytes, rank):
    import torch
    if kind.startswith("cuda"):
        device = torch.device("cuda", rank % torch.cuda.device_count())
        if kind == "cuda-pinned":
            return handle.new_pinned_device_tensor(nbytes, torch.empty(0, dtype=torch.uint8,
                                                                       device=device))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if kind == "locked":
        return handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    if kind == "pinned":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if kind == "numpy":
        import numpy
        return numpy.empty(nbytes, dtype=numpy.uint8)
    return torch.empty(nbytes, dtype=torch.uint8)


def _fill(buffer):
    """Random bytes (a repeated 1 MiB pattern), so that nothing compresses or dedupes."""
    import numpy
    if not isinstance(buffer, numpy.ndarray) and buffer.is_cuda:
        import torch
        pattern = torch.frombuffer(bytearray(os.urandom(1 << 20)), dtype=torch.uint8)
        for start in range(0, buffer.numel(), pattern.numel()):
            piece = buffer[start:start + pattern.numel()]
            piece.copy_(pattern[: piece.numel()])
        return
    view = buffer if isinstance(buffer, numpy.ndarray) else buffer.numpy()
    pattern = numpy.frombuffer(os.urandom(1 << 20), dtype=numpy.uint8)
    for start in range(0, view.size, pattern.size):
        view[start:start + pattern.size] = pattern[: view.size - start]


def _gpu_count():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cpu_seconds(process):
    """CPU time of this process and its live children (the workers)."""
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except Exception:
            pass
    return total


def _summarise(plan, results):
    size = plan["io_size"]
    summary = {"config": {k: v for k, v in plan.items() if k != "progress"}, "ranks": results,
               "jobs": {}}
    for job in plan["jobs"]:
        per_rank = [r["jobs"][job] for r in results]
        all_seconds = sorted(s for r in per_rank for s in r["seconds"])
        task_seconds = max(statistics.mean(r["seconds"]) for r in per_rank)
        e2e_seconds = max(r["e2e_seconds"] for r in per_rank)
        moved = size * len(results)
        summary["jobs"][job] = {
            "bytes_per_loop": moved,
            "gb_per_s": moved / task_seconds / 1e9,
            "per_rank_gb_per_s": [size / statistics.mean(r["seconds"]) / 1e9 for r in per_rank],
            "latency_p50_s": _percentile(all_seconds, 50),
            "latency_p99_s": _percentile(all_seconds, 99),
            "cpu_seconds_per_gb": sum(r["cpu_seconds"] for r in per_rank)
                                  / (moved * plan["loops"] / 1e9),
            "task_seconds": task_seconds,
            "e2e_seconds": e2e_seconds,
        }
    return summary


def _percentile(sorted_values, p):
    index = min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1)))
    return sorted_values[index]


def _print_report(summary):
    config = summary["config"]
    print(f"nvmeswap bench: {format_size(config['io_size'])} per operation, "
          f"{config['ranks']} rank(s), buffer {config['buffer']}, "
          f"handle {config['handle'] or 'defaults'}")
    print(f"{'job':<7}{'rank':>6}{'GB/s':>9}{'p50 ms':>10}{'p99 ms':>10}{'CPU s/GB':>10}"
          f"{'bytes':>15}")
    for job, figures in summary["jobs"].items():
        for rank, rate in enumerate(figures["per_rank_gb_per_s"]):
            if len(figures["per_rank_gb_per_s"]) > 1:
                print(f"{job:<7}{rank:>6}{rate:>9.2f}")
        print(f"{job:<7}{'all':>6}{figures['gb_per_s']:>9.2f}"
              f"{figures['latency_p50_s'] * 1e3:>10.1f}{figures['latency_p99_s'] * 1e3:>10.1f}"
              f"{figures['cpu_seconds_per_gb']:>10.3f}{figures['bytes_per_loop']:>15}")
    # The lines scripts written for ds_io parse (ds_io's GB is 2**30 bytes).
    for job, figures in summary["jobs"].items():
        name = job.capitalize()
        moved = figures["bytes_per_loop"]
        print(f"Task {name} Latency = {figures['task_seconds']} sec")
        print(f"Task {name} Speed = {moved / figures['task_seconds'] / 2**30} GB/sec")
        print(f"E2E {name} Latency = {figures['e2e_seconds']} sec")
        print(f"E2E {name} Speed = {moved / figures['e2e_seconds'] / 2**30} GB/sec")
