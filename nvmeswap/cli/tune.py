"""``nvmeswap tune``: the best handle settings for a folder (DeepSpeed's ``ds_nvme_tune``).

The default search walks one setting at a time from a good start (parallelism, then
block size, then queue depth, then the submit modes, then the engine: kernel AIO and
io_uring where it works, or the one ``--engine`` names), reusing one handle and one
locked buffer per configuration, widening a setting only when its edge wins, and
confirms the leaders by measuring them again, interleaved. ``--exhaustive`` measures the
full grid.
The result (JSON) goes to --json FILE, or alone to standard output; everything else goes to
standard error. Ctrl-C stops after the current configuration and keeps the best so far.
"""
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings

from ..io.engines import ENGINES, check_usable, resolve, uring_refusal
from ..units import GB, SIZE_HELP, format_size, size_argument
from . import tune_random
from .options import (
    StopOnInterrupt,
    UsageError,
    check_folder,
    check_output_path,
    check_room,
    positive_float,
    positive_int,
    torch_available,
    write_json,
)

K, M = 1 << 10, 1 << 20
BLOCK_SIZES = [128 * K, 256 * K, 1 * M, 4 * M, 8 * M]
QUEUE_DEPTHS = [4, 8, 32, 128]
JOBS = ("read", "write", "combined")


def add_arguments(parser):
    parser.add_argument("--folder", action="append", dest="folders", metavar="DIR",
                        required=True, help="folder on the device to tune for (once)")
    parser.add_argument("--io-size", "--io_size", type=size_argument, default=None,
                        metavar="SIZE", help="bytes per measured operation (default: 256M; "
                                             f"with --pattern rand, 4K; {SIZE_HELP})")
    parser.add_argument("--pattern", choices=("seq", "rand"), default="seq",
                        help="seq: the handle settings for large transfers; rand: the engine "
                             "and batch size for small random reads (--ops requests of "
                             "--io-size in a --file-size file)")
    parser.add_argument("--file-size", type=size_argument, default=None, metavar="SIZE",
                        help="with --pattern rand: the file the reads fall in (default: 1G)")
    parser.add_argument("--ops", type=positive_int, default=None, metavar="N",
                        help="with --pattern rand: reads per timed loop (default: 8192)")
    parser.add_argument("--loops", type=positive_int, default=2, metavar="N",
                        help="timed loops per configuration")
    parser.add_argument("--exhaustive", action="store_true", help="measure the whole grid")
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="tune this engine only (auto: the one aio_handle(engine='auto') "
                             "would run; default: both kernel AIO and io_uring, io_uring "
                             "where it works)")
    parser.add_argument("--budget-seconds", type=positive_float, default=None, metavar="S",
                        help="stop the search (not --exhaustive, nor --pattern rand) after "
                             "this many seconds; the confirming round comes after "
                             "(default: 50)")
    parser.add_argument("--json", metavar="FILE",
                        help="write the result to FILE (default: to standard output, alone; "
                             "everything else goes to standard error)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="heat map of GB/s over block size x queue depth, one panel per "
                             "parallelism, one colour scale, the pick marked (needs matplotlib; "
                             "default: not drawn)")


def run(args):
    if len(args.folders) > 1:
        raise UsageError(f"--folder given {len(args.folders)} times; tune measures one folder: "
                         f"run it once per folder ({', '.join(args.folders[1:])} would never "
                         "be used)")
    folder = args.folders[0]
    check_folder(folder)
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if not torch_available():
        raise UsageError("tune needs torch (it measures the handle's locked tensors): "
                         "pip install torch")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    engines = _engines(args.engine)
    if args.pattern == "rand":
        return _run_random(args, folder, engines)
    if args.file_size is not None or args.ops is not None:
        raise UsageError("--file-size and --ops go with --pattern rand")
    if args.io_size is None:
        args.io_size = 256 * M
    check_room(folder, args.io_size, args.io_size, "lower --io-size")
    started = time.monotonic()
    tuner = Tuner(folder, args.io_size, args.loops, engines)
    planned = len(full_grid(engines)) if args.exhaustive else tuner.planned_search()
    tuner.progress = _progress_bar(planned)
    try:
        with StopOnInterrupt(tuner.stop):
            if args.exhaustive:
                tuner.measure_all(full_grid(engines))
            else:
                tuner.search(deadline=started + (args.budget_seconds or 50.0))
            if tuner.progress is not None:
                tuner.progress.total = tuner.progress.n + tuner.planned_confirm()
                tuner.progress.refresh()
            if not tuner.stop.is_set():
                tuner.confirm()
    except (OSError, RuntimeError) as error:
        # A Ctrl-C can also reach worker processes that are still starting (they ignore it
        # only once running): the configuration then fails, and the stop is what counts.
        if not tuner.stop.is_set():
            print(f"nvmeswap tune: {error}", file=sys.stderr)
            return 1
    finally:
        if tuner.progress is not None:
            tuner.progress.close()
        tuner.close()
    interrupted = tuner.stop.is_set()
    if not tuner.results:
        print("nvmeswap tune: interrupted before any configuration was measured",
              file=sys.stderr)
        return 130
    picks = tuner.picks()
    result = {
        "aio": picks["combined"]["config"],
        **{job: {**picks[job]["config"], "gb_per_s": picks[job]["gb_per_s"]} for job in JOBS},
        "units": {"gb_per_s": "10^9 bytes per second", "io_size": "bytes"},
        "io_size": args.io_size,
        "engines": list(engines),
        "seconds": time.monotonic() - started,
        "interrupted": interrupted,
        "configurations_measured": len(tuner.results),
        "measurements": [{**config_of(key), **rates} for key, rates in tuner.results.items()],
    }
    saved = write_json(args.json, result, "tune")      # first: a closed pipe loses no run
    _print_result(result)
    if args.plot:
        try:
            plot_heat_map(tuner.results, args.plot, winner=key_of(result["aio"]))
            print(f"heat map written to {args.plot}", file=sys.stderr)
        except OSError as error:
            print(f"nvmeswap tune: --plot {args.plot}: {error.strerror or error}",
                  file=sys.stderr)
            saved = False
    if interrupted:
        print("nvmeswap tune: interrupted; the best of the configurations measured so far "
              "is kept", file=sys.stderr)
        return 130
    return 0 if saved else 1


def _run_random(args, folder, engines):
    """``--pattern rand`` (cli/tune_random.py): engine x batch size for small reads."""
    if args.exhaustive or args.plot or args.budget_seconds is not None:
        raise UsageError("--exhaustive, --plot and --budget-seconds go with --pattern seq")
    io_size = args.io_size if args.io_size is not None else 4 * K
    file_size = args.file_size if args.file_size is not None else GB
    ops = args.ops if args.ops is not None else 8192
    if io_size % 4096 or file_size < io_size:
        raise UsageError(f"--pattern rand needs an --io-size that is a multiple of 4096 "
                         f"and a --file-size of at least it (got {io_size} and {file_size})")
    check_room(folder, file_size, len(engines) * tune_random.buffer_bytes(io_size),
                "lower --file-size or --io-size")
    started = time.monotonic()
    stop = threading.Event()
    with StopOnInterrupt(stop):
        rates = tune_random.measure(folder, io_size, file_size, ops, args.loops,
                                    engines, stop)
    result = tune_random.result(rates, io_size, file_size, ops, engines,
                                time.monotonic() - started, stop.is_set())
    if result["best"] is None:
        print("nvmeswap tune: interrupted before any configuration was measured",
              file=sys.stderr)
        return 130
    saved = write_json(args.json, result, "tune")
    best = result["best"]
    for m in result["measurements"]:
        print(f"{m['engine']:<6} batch {m['batch']:>4}: {m['reads_per_s']:10.0f} reads/s",
              file=sys.stderr)
    print(f"best: engine={best['engine']}, batch {best['batch']} "
          f"({best['reads_per_s']:.0f} reads of {format_size(io_size)} per second)",
          file=sys.stderr)
    return 130 if result["interrupted"] else 0 if saved else 1


def _progress_bar(total):
    """A tqdm bar with an ETA on a terminal; nothing when standard error is not one."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="tune", unit="config", file=sys.stderr, leave=False,
                dynamic_ncols=True)


def _engines(asked):
    """The engines to tune: the one asked for (refused before any work if it cannot run
    here), else kernel AIO and io_uring where it works (saying why not, if not)."""
    if asked is not None:
        try:
            check_usable(asked)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # said below, in tune's words
                engine = resolve(asked)
        except OSError as error:
            raise UsageError(f"--engine {asked}: {error}") from None
        if engine != asked and asked == "auto":
            print(f"--engine auto: {uring_refusal()[1]}; tuning aio", file=sys.stderr)
        return (engine,)
    refused = uring_refusal()
    if refused is not None:
        print(f"io_uring cannot be used here ({refused[1]}): tuning aio only", file=sys.stderr)
        return ("aio",)
    return ("aio", "uring")


def full_grid(engines=("aio",)):
    parallelism = sorted({1, 2, min(4, 2 * (os.cpu_count() or 1))})
    return list(itertools.product(BLOCK_SIZES, QUEUE_DEPTHS, parallelism,
                                  (False, True), (False, True), engines))


def config_of(key):
    """A configuration's handle arguments; ``key``: (block size, queue depth, parallelism,
    single submit, overlap events, engine)."""
    block_size, queue_depth, parallelism, single_submit, overlap_events, engine = key
    return {"block_size": block_size, "queue_depth": queue_depth,
            "intra_op_parallelism": parallelism, "single_submit": single_submit,
            "overlap_events": overlap_events, "engine": engine}


def key_of(config):
    return (config["block_size"], config["queue_depth"], config["intra_op_parallelism"],
            config["single_submit"], config["overlap_events"], config.get("engine", "aio"))


def _parallelisms():
    cpus = os.cpu_count() or 1
    return sorted({1, 2, min(4, 2 * cpus), min(8, 4 * cpus)})


class Tuner:
    """Measures configurations on one file; remembers every rate it saw.

    ``stop`` (an Event) ends the measuring between configurations; ``progress`` (a tqdm
    bar or None) advances once per configuration measured.
    """

    def __init__(self, folder, io_size, loops, engines=("aio",)):
        self.engines = tuple(engines)
        self.folder = tempfile.mkdtemp(prefix="nvmeswap-tune-", dir=folder)
        self.path = os.path.join(self.folder, "tune.bin")
        self.io_size = io_size
        self.loops = loops
        self.results = {}
        self.samples = {}
        self.stop = threading.Event()
        self.progress = None

    def measure(self, key, loops=None):
        """Write and read ``io_size`` bytes ``loops`` times; record median GB/s per job."""
        import torch

        from ..aio import aio_handle
        with aio_handle(**config_of(key)) as handle:
            tensor = handle.new_cpu_locked_tensor(self.io_size, torch.empty(0, dtype=torch.uint8))
            tensor.fill_(0x5A)
            if not os.path.exists(self.path):
                handle.sync_pwrite(tensor, self.path)     # overwrites are what swapping does
            samples = self.samples.setdefault(key, {"read": [], "write": []})
            for _ in range(loops or self.loops):
                for job, call in (("write", handle.sync_pwrite), ("read", handle.sync_pread)):
                    started = time.perf_counter()
                    call(tensor, self.path)
                    samples[job].append(time.perf_counter() - started)
            handle.free_cpu_locked_tensor(tensor)
        read = statistics.median(samples["read"])
        write = statistics.median(samples["write"])
        self.results[key] = {"read": self.io_size / read / GB,
                             "write": self.io_size / write / GB,
                             "combined": 2 * self.io_size / (read + write) / GB}
        if self.progress is not None:
            best = max(r["combined"] for r in self.results.values())
            self.progress.set_postfix_str(f"best {best:.2f} GB/s")
            self.progress.update(1)
        return self.results[key]

    def measure_all(self, keys, deadline=None):
        for key in keys:
            if self.stop.is_set() or (deadline is not None and time.monotonic() > deadline):
                return
            if key not in self.results:
                self.measure(key)

    def best(self, job="combined", among=None):
        keys = among if among is not None else self.results
        return max(keys, key=lambda k: self.results[k][job])

    def planned_search(self):
        """The most configurations :meth:`search` measures (for the progress bar)."""
        return len(_parallelisms()) + len(BLOCK_SIZES) + len(QUEUE_DEPTHS) + 4

    def planned_confirm(self, leaders=3, rounds=2):
        rivals = self.engine_rivals()
        return len(rivals) + len(self.leaders(leaders) | set(rivals)) * rounds

    def leaders(self, leaders=3):
        chosen = set()
        for job in JOBS:
            chosen.update(sorted(self.results, key=lambda k: self.results[k][job],
                                 reverse=True)[:leaders])
        return chosen

    def engine_rivals(self):
        """The best configuration so far on each other engine, where not yet measured:
        every engine is tried, whatever the budget left for the search."""
        if not self.results:
            return []
        best = self.best()
        return [best[:5] + (engine,) for engine in self.engines
                if best[:5] + (engine,) not in self.results]

    def search(self, deadline):
        """One setting at a time from a good start, on the first engine; widen a range only
        if its edge wins. (The other engines are tried in ``confirm``.)"""
        start = (1 * M, 32, 1, False, True, self.engines[0])
        steps = [(2, _parallelisms()), (0, BLOCK_SIZES), (1, QUEUE_DEPTHS)]
        current = start
        for position, values in steps:
            candidates = [current[:position] + (v,) + current[position + 1:] for v in values]
            # Measure from the middle outwards; stop walking a direction once it gets worse.
            middle = values.index(current[position]) if current[position] in values else 0
            self.measure_all([candidates[middle]], deadline)
            for direction in (-1, 1):
                index = middle + direction
                while 0 <= index < len(candidates) and time.monotonic() < deadline \
                        and not self.stop.is_set():
                    self.measure_all([candidates[index]], deadline)
                    previous = candidates[index - direction]
                    if candidates[index] not in self.results or \
                            self.results[candidates[index]]["combined"] < \
                            0.97 * self.results[previous]["combined"]:
                        break
                    index += direction
            measured = [c for c in candidates if c in self.results]
            if not measured:
                return
            current = self.best(among=measured)
        modes = [current[:3] + (single, overlap) + current[5:]
                 for single, overlap in itertools.product((False, True), (False, True))]
        self.measure_all(modes, deadline)

    def confirm(self, leaders=3, rounds=2):
        """Measure the best so far on every other engine, then the leaders of each job
        and those again, interleaved; the picks use all samples."""
        rivals = self.engine_rivals()
        self.measure_all(rivals)
        chosen = self.leaders(leaders) | {key for key in rivals if key in self.results}
        for _ in range(rounds):
            for key in sorted(chosen):
                if self.stop.is_set():
                    return
                self.measure(key, loops=1)

    def picks(self):
        """The best configuration so far for each job, with its GB/s."""
        return {job: {"config": config_of(self.best(job)),
                      "gb_per_s": self.results[self.best(job)][job]} for job in JOBS}

    def close(self):
        if os.path.exists(self.path):
            os.unlink(self.path)
        os.rmdir(self.folder)


def _print_result(result):
    """The prose, on standard error: standard output carries the JSON alone."""
    out = sys.stderr
    print(f"measured {result['configurations_measured']} configurations of "
          f"{format_size(result['io_size'])} in {result['seconds']:.1f} s "
          "(GB = 10^9 bytes)", file=out)
    for job in JOBS:
        pick = result[job]
        settings = ", ".join(f"{k}={pick[k]}" for k in config_of((0,) * 6))
        print(f"best {job:<9} {pick['gb_per_s']:6.2f} GB/s  {settings}", file=out)


def heat_map_grids(results):
    """Per parallelism, the best combined GB/s over queue depth (rows) x block size
    (columns); and the one colour scale (low, high) that every panel shares."""
    import numpy
    grids = {}
    for parallelism in sorted({k[2] for k in results}):
        grid = numpy.full((len(QUEUE_DEPTHS), len(BLOCK_SIZES)), numpy.nan)
        for key, rates in results.items():
            if key[2] == parallelism and key[0] in BLOCK_SIZES and key[1] in QUEUE_DEPTHS:
                row, column = QUEUE_DEPTHS.index(key[1]), BLOCK_SIZES.index(key[0])
                grid[row, column] = numpy.fmax(grid[row, column], rates["combined"])
        grids[parallelism] = grid
    values = [v for grid in grids.values() for v in grid.ravel() if not numpy.isnan(v)]
    scale = (min(values), max(values)) if values else (0.0, 1.0)
    return grids, scale


def plot_heat_map(results, filename, winner=None):
    """GB/s (combined) over block size x queue depth, one panel per parallelism, all on one
    colour scale; the ``winner`` configuration's cell is outlined in red."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy
    from matplotlib.patches import Rectangle

    grids, (low, high) = heat_map_grids(results)
    figure, axes = plt.subplots(1, len(grids), figsize=(4.5 * len(grids) + 1, 4),
                                squeeze=False)
    image = None
    for axis, (parallelism, grid) in zip(axes[0], grids.items()):
        image = axis.imshow(grid, origin="lower", cmap="viridis", vmin=low, vmax=high)
        axis.set_xticks(range(len(BLOCK_SIZES)), [format_size(b) for b in BLOCK_SIZES])
        axis.set_yticks(range(len(QUEUE_DEPTHS)), QUEUE_DEPTHS)
        axis.set_xlabel("block size")
        axis.set_ylabel("queue depth")
        axis.set_title(f"intra_op_parallelism={parallelism}")
        for (row, column), value in numpy.ndenumerate(grid):
            if not numpy.isnan(value):
                axis.text(column, row, f"{value:.2f}", ha="center", va="center", color="w")
        if winner is not None and winner[2] == parallelism \
                and winner[0] in BLOCK_SIZES and winner[1] in QUEUE_DEPTHS:
            row, column = QUEUE_DEPTHS.index(winner[1]), BLOCK_SIZES.index(winner[0])
            axis.add_patch(Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False,
                                     edgecolor="red", linewidth=3, label="pick"))
            axis.set_title(f"intra_op_parallelism={parallelism} (pick outlined)")
    figure.colorbar(image, ax=list(axes[0]), label="GB/s, read+write (GB = 10^9 bytes)")
    try:
        figure.savefig(filename, dpi=100)
    finally:
        plt.close(figure)
