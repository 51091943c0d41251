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
import argparse
import os
import shutil
import sys
import tempfile

from ..errors import ValidationError
from ..io.engines import ENGINES, check_usable
from ..units import SIZE_HELP, human_size, size_argument
from .bench_ranks import buffer_bytes, run_ranks
from .bench_summary import print_report, summarise
from .options import (
    StopOnInterrupt,
    UsageError,
    check_folder,
    check_output_path,
    gpu_count,
    in_cli_words,
    non_negative_int,
    positive_int,
    torch_available,
    write_json,
)

BUFFERS = ("locked", "pinned", "plain", "numpy")
SETTINGS = ("block_size", "queue_depth", "single_submit", "overlap_events",
            "intra_op_parallelism", "engine")


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
    parser.add_argument("--single-submit", "--single_submit",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="one io_submit call per request; the no- form: batches "
                             "(default: the handle's, batches)")
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
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="how requests reach the kernel: aio (kernel AIO), uring (io_uring), "
                             "auto (io_uring where it works) (default: $NVMESWAP_ENGINE, "
                             "else aio)")
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
    parser.add_argument("--pattern", choices=("seq", "rand"), default="seq",
                        help="seq: each timed loop is one operation of --io-size; rand: "
                             "--ops requests of --io-size at random aligned offsets of a "
                             "--file-size file, started asynchronously")
    parser.add_argument("--file-size", type=size_argument, default=None, metavar="SIZE",
                        help="with --pattern rand: the file the requests fall in "
                             "(default: 1G)")
    parser.add_argument("--ops", type=positive_int, default=None, metavar="N",
                        help="with --pattern rand: requests per timed loop and rank "
                             "(default: 4096)")
    parser.add_argument("--batch", type=non_negative_int, default=0, metavar="N",
                        help="with --pattern rand: start N requests in one call "
                             "(async_pread_many / async_pwrite_many) and wait for them; 0: "
                             "one async call per request, waiting every 256 (default: 0)")
    parser.add_argument("--stripe", metavar="DIR1,DIR2,...", default=None,
                        help="measure each folder's device alone, then one transfer striped "
                             "over all of them (per-device and aggregate GB/s; default: no "
                             "striping, the usual test)")
    parser.add_argument("--stripe-size", type=size_argument, default=None, metavar="SIZE",
                        help="bytes per stripe with --stripe, a multiple of 4096 "
                             "(default: 4M)")
    parser.add_argument("--config", metavar="FILE",
                        help="handle settings from a tuner result or a DeepSpeed 'aio' section; "
                             "options given here override it, and what it leaves out is "
                             "DeepSpeed's default, as its swappers run (default: no file, "
                             "the handle's defaults)")


def run(args):
    """Run the job; return the exit status."""
    plan = _plan(args)
    if args.stripe is not None:
        from .bench_stripes import run_stripes
        _check_stripe_options(args)
        return run_stripes(args, plan, args.stripe_size or 4 << 20)
    if args.stripe_size is not None:
        raise UsageError("--stripe-size goes with --stripe")
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
            results = run_ranks(plan, stop)
    except (ValueError, OSError, RuntimeError, ValidationError) as error:
        print(f"nvmeswap bench: {in_cli_words(str(error))}", file=sys.stderr)
        return 1
    finally:
        if made_folder:
            shutil.rmtree(made_folder, ignore_errors=True)
    summary = summarise(plan, results)
    summary["interrupted"] = stop.interrupted
    # The JSON first: a closed pipe on the table must not lose the run.
    saved = not args.json or write_json(args.json, summary, "bench")
    table = sys.stderr if args.json == "-" else sys.stdout
    print_report(summary, table)
    if stop.interrupted:
        loops = {job: f["loops"] for job, f in summary["jobs"].items()}
        print(f"nvmeswap bench: interrupted; timed loops kept: {loops or 'none'}",
              file=sys.stderr)
        return 130
    return 0 if saved else 1


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
    _check_settings(handle_args, args)
    _check_engine(handle_args.get("engine"),
                  "--engine" if args.engine is not None or not args.config
                  else f"--config {args.config}: engine")
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
    random = args.pattern == "rand"
    if not random and (args.file_size is not None or args.batch or args.ops is not None):
        raise UsageError("--file-size, --batch and --ops go with --pattern rand")
    if random:
        if args.validate or args.gpu or args.gds:
            raise UsageError("--pattern rand moves host memory without --validate; "
                             "drop --validate, --gpu and --gds")
        if args.io_size % 4096:
            raise UsageError(f"--pattern rand needs an --io-size that is a multiple of "
                             f"4096, got {args.io_size}")
    file_size = args.file_size or (1 << 30)
    if random and file_size < args.io_size:
        raise UsageError(f"--file-size {file_size} is smaller than --io-size {args.io_size}")
    if random and args.batch > file_size // args.io_size:
        raise UsageError(f"--batch {args.batch} requests of --io-size {args.io_size} do not "
                         f"fit in --file-size {file_size} apart (a batch's writes may not "
                         "overlap): lower --batch")
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
        "pattern": args.pattern,
        "file_size": file_size if random else args.io_size,
        "ops": (args.ops or 4096) if random else 1,
        "batch": args.batch,
    }


def _check_settings(handle_args, args):
    """Refuse, before the run, a setting out of the handle's range, naming its option
    or the --config file it came from."""
    from ..aio import setting_bounds
    from ..io.operation import checked_int
    for name, (low, high) in setting_bounds().items():
        if name in handle_args:
            try:
                checked_int(name, handle_args[name], low, high)
            except (TypeError, ValueError) as error:
                given = f"--{name.replace('_', '-')}" if getattr(args, name, None) \
                    is not None else f"--config {args.config}"
                raise UsageError(f"{given}: {error}") from None


def _check_stripe_options(args):
    """--stripe measures one host buffer on one rank, its folders its own: refuse what it
    would not do, before any work."""
    if args.stripe_size is not None and args.stripe_size % 4096:
        raise UsageError(f"--stripe-size must be a multiple of 4096, got {args.stripe_size}")
    unused = [option for option, given in (
        ("--folder", args.folders), ("--ranks", args.ranks != 1), ("--buffer", args.buffer),
        ("--gpu", args.gpu), ("--gds", args.gds), ("--validate", args.validate),
        ("--pattern rand", args.pattern != "seq")) if given]
    if unused:
        raise UsageError(f"--stripe measures its own folders on one rank from locked host "
                         f"memory, and checks the striped bytes itself; drop "
                         f"{', '.join(unused)}")


def _check_engine(engine, option):
    """Refuse, before the run, an engine that cannot run here (io_uring refused, or a
    bad NVMESWAP_ENGINE)."""
    try:
        check_usable(engine)
    except (ValueError, TypeError, OSError) as error:
        raise UsageError(f"{option} {engine}: {error}" if engine else str(error)) from None


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
        need = ranks_here * plan["file_size"]
        free = shutil.disk_usage(folder).free
        if need > free:
            raise UsageError(f"--folder {folder} has {human_size(free)} free; the run needs "
                             f"{human_size(need)} ({ranks_here} rank(s) x the file size): "
                             "lower --io-size (or --file-size) or free some space")
    if not plan["buffer"].startswith("cuda"):
        need = plan["ranks"] * buffer_bytes(plan)
        free = available_memory()
        if need > free:
            raise UsageError(f"the run needs {human_size(need)} of memory (--ranks x "
                             f"--io-size) and {human_size(max(free, 0))} is available: "
                             "lower --io-size or --ranks")
