"""``nvmeswap bench``: the throughput test (DeepSpeed's ``ds_io`` job).

Each rank is a process of its own with its own handle and files, as in per-rank offload.
Every timed loop is one operation of --io-size bytes per rank, then a barrier across ranks,
as in ds_io. Printed: a table (GB = 10^9 bytes) and ds_io's Task/E2E lines (GB = 2^30
bytes), with ds_io's meanings:
  Task Latency  the timed loops' operations, summed (the slowest rank's sum)
  E2E Latency   the timed loops' operations and barriers, summed (set-up and warm-up
                are not counted)
  Speed         all ranks' bytes over all timed loops / that latency
Ctrl-C stops after the current loop, removes the files and keeps the loops measured.
"""
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

from ..errors import MemoryLockWarning, ValidationError
from ..units import DS_IO_GB, GB, SIZE_HELP, format_size, human_size, size_argument
from .options import (StopOnInterrupt, UsageError, check_folder, check_output_path,
                      gpu_count, in_cli_words, non_negative_int, positive_int, torch_available,
                      write_json)

BUFFERS = ("locked", "pinned", "plain", "numpy")
SETTINGS = ("block_size", "queue_depth", "single_submit", "overlap_events",
            "intra_op_parallelism")


def add_arguments(parser):
    parser.add_argument("--folder", action="append", dest="folders", metavar="DIR",
                        help="folder for the files; repeat for several devices, one per rank "
                             "in turn (default: a fresh folder here, removed afterwards)")
    parser.add_argument("--io-size", "--io_size", default="1G", type=size_argument,
                        metavar="SIZE",
                        help=f"bytes per operation and rank ({SIZE_HELP})")
    parser.add_argument("--read", action="store_true",
                        help="measure reads (default: writes and reads)")
    parser.add_argument("--write", action="store_true",
                        help="measure writes (default: writes and reads)")
    parser.add_argument("--block-size", "--block_size", type=size_argument, default=None,
                        metavar="SIZE", help="bytes per kernel I/O request "
                                             "(default: the handle's, 1M)")
    parser.add_argument("--queue-depth", "--queue_depth", type=positive_int, default=None,
                        metavar="N", help="requests in flight per worker "
                                          "(default: the handle's, 128)")
    parser.add_argument("--single-submit", "--single_submit", action="store_true",
                        default=None, help="one io_submit call per request "
                                           "(default: batches)")
    overlap = parser.add_mutually_exclusive_group()
    overlap.add_argument("--overlap-events", "--overlap_events", action="store_true",
                         default=None, help="refill the queue as each request completes "
                                            "(default: the handle's, off)")
    overlap.add_argument("--sequential-requests", "--sequential_requests",
                         action="store_false", dest="overlap_events", default=None,
                         help="submit a batch, wait for all of it, repeat "
                              "(the opposite of --overlap-events; default: the handle's, on)")
    parser.add_argument("--intra-op-parallelism", "--io-parallel", "--io_parallel",
                        type=positive_int, dest="intra_op_parallelism", default=None,
                        metavar="N", help="worker processes that share each operation "
                                          "(default: the handle's, 1)")
    parser.add_argument("--loops", type=positive_int, default=3, metavar="N",
                        help="timed operations per job and rank")
    parser.add_argument("--warmup-loops", "--warmup_loops", type=non_negative_int, default=1,
                        metavar="N", help="untimed operations before the timed ones")
    parser.add_argument("--validate", action="store_true",
                        help="re-read and compare every transfer (counts in the timings)")
    parser.add_argument("--buffer", choices=BUFFERS, default=None,
                        help="memory the data moves from and to: locked = the handle's locked "
                             "tensor, pinned = CUDA-pinned (needs a GPU), plain = a torch "
                             "tensor, numpy = a numpy array (default: locked with torch, "
                             "numpy without)")
    parser.add_argument("--gpu", action="store_true",
                        help="use CUDA tensors (rank r on GPU r modulo the GPU count)")
    parser.add_argument("--gds", "--use_gds", action="store_true",
                        help="use gds_handle and cuFile-registered CUDA tensors (implies --gpu)")
    parser.add_argument("--ranks", type=positive_int, default=1, metavar="N",
                        help="independent rank processes, started together behind a barrier")
    parser.add_argument("--json", metavar="FILE",
                        help="write every figure and every loop's time to FILE "
                             "('-': standard output, with the table on standard error; "
                             "default: not written)")
    parser.add_argument("--config", metavar="FILE",
                        help="handle settings from a tuner result or a DeepSpeed 'aio' section; "
                             "options given here override it (default: the handle's defaults)")


def run(args):
    """Run the job; return the exit status."""
    plan = _plan(args)
    made_folder = None
    if not plan["folders"]:
        try:
            made_folder = tempfile.mkdtemp(prefix="nvmeswap-bench-", dir=os.getcwd())
        except PermissionError:
            raise UsageError(f"cannot create a folder in {os.getcwd()} (not writable); "
                             "give --folder DIR on the device to measure") from None
        plan["folders"] = [made_folder]
    try:
        _check_resources(plan)
        stop = StopOnInterrupt()
        with stop:
            results = _run_ranks(plan, stop)
    except (ValueError, OSError, RuntimeError, ValidationError) as error:
        print(f"nvmeswap bench: {in_cli_words(str(error))}", file=sys.stderr)
        return 1
    finally:
        if made_folder:
            shutil.rmtree(made_folder, ignore_errors=True)
    summary = summarise(plan, results)
    summary["interrupted"] = stop.interrupted
    # The JSON first: a closed pipe on the table must not lose the run.
    if args.json:
        write_json(args.json, summary)
    table = sys.stderr if args.json == "-" else sys.stdout
    print_report(summary, table)
    if stop.interrupted:
        loops = {job: f["loops"] for job, f in summary["jobs"].items()}
        print(f"nvmeswap bench: interrupted; timed loops kept: {loops or 'none'}",
              file=sys.stderr)
        return 130
    return 0


def _plan(args):
    from ..config import handle_arguments
    handle_args = {}
    if args.config:
        try:
            with open(args.config) as f:
                handle_args.update(handle_arguments(f.read()))
        except OSError as error:
            raise UsageError(f"--config {args.config}: {error.strerror}") from None
        except (ValueError, TypeError) as error:
            raise UsageError(f"--config {args.config}: {error}") from None
    for name in SETTINGS:
        if getattr(args, name) is not None:
            handle_args[name] = getattr(args, name)
    # Only what was asked for: importing torch to count GPUs takes seconds.
    gpus = gpu_count() if (args.gpu or args.gds or args.buffer == "pinned") else 0
    if args.gpu or args.gds:
        if not gpus:
            raise UsageError("--gpu and --gds need a CUDA GPU, and torch sees none here")
        if args.buffer is not None:
            raise UsageError(f"--buffer {args.buffer} contradicts --gpu/--gds (which use CUDA "
                             "tensors); give one or the other")
    if args.buffer == "pinned" and not gpus:
        raise UsageError("--buffer pinned needs a CUDA GPU (CUDA-pinned host memory), and "
                         "there is none here; use --buffer locked")
    has_torch = torch_available()
    buffer = args.buffer or ("locked" if has_torch else "numpy")
    if buffer in ("locked", "pinned", "plain") and not has_torch:
        raise UsageError(f"--buffer {buffer} needs torch (pip install torch); "
                         "--buffer numpy works without it")
    folders = list(args.folders or [])
    if len(folders) > args.ranks:
        raise UsageError(f"--folder given {len(folders)} times for {args.ranks} rank(s): "
                         f"{', '.join(folders[args.ranks:])} would never be used; "
                         f"add --ranks {len(folders)} or drop it")
    for folder in folders:
        check_folder(folder)
    check_output_path(args.json, "--json")
    jobs = [job for job, wanted in (("write", args.write), ("read", args.read)) if wanted]
    return {
        "folders": folders,
        "io_size": args.io_size,
        "jobs": jobs or ["write", "read"],
        "handle": handle_args,
        "loops": args.loops,
        "warmup_loops": args.warmup_loops,
        "validate": args.validate,
        "buffer": "cuda-pinned" if args.gds else "cuda" if args.gpu else buffer,
        "ranks": args.ranks,
        "progress": sys.stderr.isatty(),
    }


def available_memory():
    """Bytes this process may still allocate: MemAvailable, or less where a cgroup says so."""
    import psutil
    free = psutil.virtual_memory().available
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return free
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":                          # cgroup v2
            base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            limit_file, usage_file = "memory.max", "memory.current"
        elif "memory" in controllers.split(","):       # cgroup v1
            base = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        try:
            with open(os.path.join(base, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(base, usage_file)) as f:
                usage = int(f.read())
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            free = min(free, int(limit) - usage)
    return free


def _check_resources(plan):
    """Free disk per folder and free memory for every rank's buffer, before any work."""
    for index, folder in enumerate(plan["folders"]):
        ranks_here = len(range(index, plan["ranks"], len(plan["folders"])))
        need = ranks_here * plan["io_size"]
        free = shutil.disk_usage(folder).free
        if need > free:
            raise UsageError(f"--folder {folder} has {human_size(free)} free; the run needs "
                             f"{human_size(need)} ({ranks_here} rank(s) x --io-size): "
                             "lower --io-size or free some space")
    if not plan["buffer"].startswith("cuda"):
        need = plan["ranks"] * plan["io_size"]
        free = available_memory()
        if need > free:
            raise UsageError(f"the run needs {human_size(need)} of memory (--ranks x "
                             f"--io-size) and {human_size(max(free, 0))} is available: "
                             "lower --io-size or --ranks")


def _run_ranks(plan, stop):
    if plan["ranks"] == 1:
        return [_rank_job(0, plan, None, stop.event)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(plan["ranks"])
    rank_stop = context.Event()
    results = context.Queue()
    ranks = [context.Process(target=_rank_main,
                             args=(rank, {**plan, "progress": plan["progress"] and rank == 0},
                                   barrier, rank_stop, results))
             for rank in range(plan["ranks"])]
    # Started with SIGINT blocked (the mask is inherited): a Ctrl-C while a rank is still
    # starting must not kill it before it ignores SIGINT; the parent decides, below.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for process in ranks:
            process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    collected = []
    try:
        while len(collected) < len(ranks):
            if stop.event.is_set() and not rank_stop.is_set():
                rank_stop.set()
                barrier.abort()          # ranks waiting at the barrier stop there
            try:
                collected.append(results.get(timeout=0.1))
            except queue.Empty:
                if not any(p.is_alive() for p in ranks) and results.empty():
                    raise RuntimeError("a rank process died without a result") from None
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


def _rank_main(rank, plan, barrier, stop, results):
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent decides; see _run_ranks
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        results.put(_rank_job(rank, plan, barrier, stop))
    except BaseException as error:
        barrier.abort()
        results.put({"rank": rank, "error": f"rank {rank}: {type(error).__name__}: {error}"})


def _rank_job(rank, plan, barrier, stop):
    """One rank: its own handle, buffer and file; per timed loop, the operation's seconds
    ("task") and the operation's and the barrier's ("e2e"), as ds_io times them."""
    from ..aio import aio_handle
    from ..gds import gds_handle

    folder = plan["folders"][rank % len(plan["folders"])]
    path = os.path.join(folder, f"nvmeswap-bench-rank{rank}.bin")
    result = {"rank": rank, "file": path, "jobs": {}, "page_locked": None}
    make_handle = gds_handle if plan["buffer"] == "cuda-pinned" else aio_handle
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MemoryLockWarning)
        handle = make_handle(**plan["handle"])
        with handle:
            result["settings"] = {"block_size": handle.get_block_size(),
                                  "queue_depth": handle.get_queue_depth(),
                                  "single_submit": handle.get_single_submit(),
                                  "overlap_events": handle.get_overlap_events(),
                                  "intra_op_parallelism": handle.get_intra_op_parallelism()}
            buffer = _make_buffer(handle, plan["buffer"], plan["io_size"], rank)
            _fill(buffer)
            try:
                if "write" not in plan["jobs"]:
                    handle.sync_pwrite(buffer, path)         # something to read
                for job in plan["jobs"]:
                    if stop.is_set():
                        break
                    result["jobs"][job] = _timed_loops(handle, job, buffer, path, plan,
                                                       barrier, stop)
            finally:
                if os.path.exists(path):
                    os.unlink(path)
        result["page_locked"] = not any(issubclass(w.category, MemoryLockWarning)
                                        for w in caught)
    for w in caught:
        if not issubclass(w.category, MemoryLockWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result


def _timed_loops(handle, job, buffer, path, plan, barrier, stop):
    import psutil

    operation = handle.pread if job == "read" else handle.pwrite

    def call():
        try:
            operation(buffer, path, plan["validate"], False, 0)
        except (OSError, RuntimeError):
            # A Ctrl-C also reaches worker processes still starting; then the stop counts.
            if stop.is_set():
                return False
            raise
        return True

    def barrier_wait():
        """False when Ctrl-C broke the barrier (the loop in hand is not whole)."""
        if barrier is None:
            return True
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            if stop.is_set():
                return False
            raise
        return True

    for _ in range(plan["warmup_loops"]):
        if stop.is_set() or not call():
            break
    # Ranks start the timed loops together, whatever their set-up and warm-up took.
    if stop.is_set() or not barrier_wait():
        return {"task_seconds": [], "e2e_seconds": [], "cpu_seconds": 0.0}
    progress = _progress_bar(job, plan)
    task, e2e = [], []
    cpu_before = _cpu_seconds(psutil.Process())
    try:
        for _ in range(plan["loops"]):
            if stop.is_set():
                break
            started = time.perf_counter()
            if not call():
                break
            done = time.perf_counter()
            if not barrier_wait():
                break
            task.append(done - started)
            e2e.append(time.perf_counter() - started)
            if progress is not None:
                progress.set_postfix_str(f"{plan['io_size'] / task[-1] / GB:.2f} GB/s")
                progress.update(1)
    finally:
        if progress is not None:
            progress.close()
    return {"task_seconds": task, "e2e_seconds": e2e,
            "cpu_seconds": _cpu_seconds(psutil.Process()) - cpu_before}


def _progress_bar(job, plan):
    """A tqdm bar on a terminal; nothing when standard error is a pipe or a file."""
    if not plan["progress"]:
        return None
    from tqdm import tqdm
    return tqdm(total=plan["loops"], desc=f"{job} {format_size(plan['io_size'])}",
                unit="loop", file=sys.stderr, leave=False, dynamic_ncols=True)


def _make_buffer(handle, kind, nbytes, rank):
    if kind == "numpy":
        import numpy
        return numpy.empty(nbytes, dtype=numpy.uint8)
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


def summarise(plan, results):
    """The figures of a run, ds_io's included (see the module docstring for their meaning)."""
    size = plan["io_size"]
    summary = {"config": {k: v for k, v in plan.items() if k != "progress"},
               "units": {"gb_per_s": "10^9 bytes per second",
                         "ds_io_gb_per_s": "2^30 bytes per second (ds_io's GB)",
                         "seconds": "seconds"},
               "page_locked": all(r["page_locked"] for r in results)
               if plan["buffer"] == "locked" else None,
               "ranks": results, "jobs": {}}
    for job in plan["jobs"]:
        per_rank = [r["jobs"].get(job, {"task_seconds": [], "e2e_seconds": [],
                                        "cpu_seconds": 0.0}) for r in results]
        loops = [len(r["task_seconds"]) for r in per_rank]
        if not any(loops):
            continue
        moved = size * sum(loops)
        task_latency = max(sum(r["task_seconds"]) for r in per_rank)
        e2e_latency = max(sum(r["e2e_seconds"]) for r in per_rank)
        all_task = sorted(s for r in per_rank for s in r["task_seconds"])
        summary["jobs"][job] = {
            "loops": min(loops),
            "bytes": moved,
            "bytes_per_loop": size * len(results),
            "task_latency_s": task_latency,
            "e2e_latency_s": e2e_latency,
            "gb_per_s": moved / task_latency / GB,
            "e2e_gb_per_s": moved / e2e_latency / GB,
            "ds_io_task_gb_per_s": moved / task_latency / DS_IO_GB,
            "ds_io_e2e_gb_per_s": moved / e2e_latency / DS_IO_GB,
            "per_rank_gb_per_s": [size * len(r["task_seconds"]) / sum(r["task_seconds"]) / GB
                                  if r["task_seconds"] else 0.0 for r in per_rank],
            "latency_p50_s": _percentile(all_task, 50),
            "latency_p99_s": _percentile(all_task, 99),
            "cpu_seconds_per_gb": sum(r["cpu_seconds"] for r in per_rank) / (moved / GB),
        }
    return summary


def _percentile(sorted_values, p):
    index = min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1)))
    return sorted_values[index]


def _buffer_words(summary):
    kind = summary["config"]["buffer"]
    if kind == "locked" and summary["page_locked"] is False:
        return "shared, NOT page-locked (locking refused: see nvmeswap report, ulimit -l)"
    if kind == "locked":
        return "locked"
    return kind


def print_report(summary, out=None):
    out = out or sys.stdout
    config = summary["config"]
    print(f"nvmeswap bench: {format_size(config['io_size'])} per operation and rank, "
          f"{config['ranks']} rank(s), buffer {_buffer_words(summary)}", file=out)
    settings = summary["ranks"][0].get("settings") or config["handle"]
    print("handle: " + ", ".join(f"{k}={v}" for k, v in settings.items()), file=out)
    print(f"{'job':<7}{'rank':>6}{'loops':>7}{'GB/s':>9}{'p50 ms':>10}{'p99 ms':>10}"
          f"{'CPU s/GB':>10}{'bytes':>15}   (GB = 10^9 bytes; GB/s over the operations)",
          file=out)
    for job, figures in summary["jobs"].items():
        if len(figures["per_rank_gb_per_s"]) > 1:
            for rank, rate in enumerate(figures["per_rank_gb_per_s"]):
                print(f"{job:<7}{rank:>6}{'':>7}{rate:>9.2f}", file=out)
        print(f"{job:<7}{'all':>6}{figures['loops']:>7}{figures['gb_per_s']:>9.2f}"
              f"{figures['latency_p50_s'] * 1e3:>10.1f}{figures['latency_p99_s'] * 1e3:>10.1f}"
              f"{figures['cpu_seconds_per_gb']:>10.3f}{figures['bytes']:>15}", file=out)
    # The lines that scripts written for ds_io parse, with ds_io's meanings and its GB (2^30).
    print("ds_io lines (GB = 2^30 bytes; Latency = the timed loops summed; E2E adds the "
          "barrier, not set-up):", file=out)
    for job, figures in summary["jobs"].items():
        name = job.capitalize()
        print(f"Task {name} Latency = {figures['task_latency_s']} sec", file=out)
        print(f"Task {name} Speed = {figures['ds_io_task_gb_per_s']} GB/sec", file=out)
        print(f"E2E {name} Latency = {figures['e2e_latency_s']} sec", file=out)
        print(f"E2E {name} Speed = {figures['ds_io_e2e_gb_per_s']} GB/sec", file=out)
