"""``nvmeswap tune``: the best handle settings for a folder (DeepSpeed's ``ds_nvme_tune``).

The default search walks one setting at a time from a good start (parallelism, then
block size, then queue depth, then the submit modes), reusing one handle and one locked
buffer per configuration, widening a setting only when its edge wins, and confirms the
leaders by measuring them again, interleaved. ``--exhaustive`` measures the full grid.
"""
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

from ..units import format_size, size_argument

K, M = 1 << 10, 1 << 20
BLOCK_SIZES = [128 * K, 256 * K, 1 * M, 4 * M, 8 * M]
QUEUE_DEPTHS = [4, 8, 32, 128]
JOBS = ("read", "write", "combined")


def add_arguments(parser):
    parser.add_argument("--folder", required=True, help="folder on the device to tune for")
    parser.add_argument("--io-size", "--io_size", type=size_argument, default=256 * M,
                        help="bytes per measured operation (default 256M)")
    parser.add_argument("--loops", type=int, default=2, help="timed loops per configuration")
    parser.add_argument("--exhaustive", action="store_true", help="measure the whole grid")
    parser.add_argument("--budget-seconds", type=float, default=50.0,
                        help="stop the default search after this long (default 50)")
    parser.add_argument("--json", metavar="FILE", help="write the result to FILE")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="heat map of GB/s over block size x queue depth (needs matplotlib)")


def run(args):
    if not os.path.isdir(args.folder) or not os.access(args.folder, os.W_OK | os.X_OK):
        print(f"nvmeswap tune: folder {args.folder} does not exist or is not writable",
              file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("nvmeswap tune: --plot needs matplotlib (pip install matplotlib)",
                  file=sys.stderr)
            return 2
    started = time.monotonic()
    tuner = Tuner(args.folder, args.io_size, args.loops)
    try:
        if args.exhaustive:
            tuner.measure_all(full_grid())
        else:
            tuner.search(deadline=started + args.budget_seconds)
        picks = tuner.confirm()
    except (OSError, RuntimeError) as error:
        print(f"nvmeswap tune: {error}", file=sys.stderr)
        return 1
    finally:
        tuner.close()
    result = {
        "aio": picks["combined"]["config"],
        **{job: {**picks[job]["config"], "gb_per_s": picks[job]["gb_per_s"]} for job in JOBS},
        "io_size": args.io_size,
        "seconds": time.monotonic() - started,
        "configurations_measured": len(tuner.results),
        "measurements": [{**config_of(key), **rates} for key, rates in tuner.results.items()],
    }
    _print_result(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot_heat_map(tuner.results, args.plot)
        print(f"heat map written to {args.plot}")
    return 0


def full_grid():
    parallelism = sorted({1, 2, min(4, 2 * (os.cpu_count() or 1))})
    return list(itertools.product(BLOCK_SIZES, QUEUE_DEPTHS, parallelism,
                                  (False, True), (False, True)))


def config_of(key):
    block_size, queue_depth, parallelism, single_submit, overlap_events = key
    return {"block_size": block_size, "queue_depth": queue_depth,
            "intra_op_parallelism": parallelism, "single_submit": single_submit,
            "overlap_events": overlap_events}


class Tuner:
    """Measures configurations on one file; remembers every rate it saw."""

    def __init__(self, folder, io_size, loops):
        self.folder = tempfile.mkdtemp(prefix="nvmeswap-tune-", dir=folder)
        self.path = os.path.join(self.folder, "tune.bin")
        self.io_size = io_size
        self.loops = loops
        self.results = {}
        self.samples = {}

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
        self.results[key] = {"read": self.io_size / read / 1e9,
                             "write": self.io_size / write / 1e9,
                             "combined": 2 * self.io_size / (read + write) / 1e9}
        return self.results[key]

    def measure_all(self, keys, deadline=None):
        for key in keys:
            if deadline is not None and time.monotonic() > deadline:
                return
            if key not in self.results:
                self.measure(key)

    def best(self, job="combined", among=None):
        keys = among if among is not None else self.results
        return max(keys, key=lambda k: self.results[k][job])

    def search(self, deadline):
        """One setting at a time from a good start; widen a range only if its edge wins."""
        start = (1 * M, 32, 1, False, True)
        cpus = os.cpu_count() or 1
        steps = [
            (2, sorted({1, 2, min(4, 2 * cpus), min(8, 4 * cpus)})),
            (0, BLOCK_SIZES),
            (1, QUEUE_DEPTHS),
        ]
        current = start
        for position, values in steps:
            candidates = [current[:position] + (v,) + current[position + 1:] for v in values]
            # Measure from the middle outwards; stop walking a direction once it gets worse.
            middle = values.index(current[position]) if current[position] in values else 0
            self.measure_all([candidates[middle]], deadline)
            for direction in (-1, 1):
                index = middle + direction
                while 0 <= index < len(candidates) and time.monotonic() < deadline:
                    self.measure_all([candidates[index]], deadline)
                    previous = candidates[index - direction]
                    if self.results[candidates[index]]["combined"] < \
                            0.97 * self.results[previous]["combined"]:
                        break
                    index += direction
            current = self.best(among=[c for c in candidates if c in self.results])
        modes = [current[:3] + (single, overlap)
                 for single, overlap in itertools.product((False, True), (False, True))]
        self.measure_all(modes, deadline)

    def confirm(self, leaders=3, rounds=2):
        """Measure the leaders of each job again, interleaved; pick by all samples."""
        chosen = set()
        for job in JOBS:
            ranked = sorted(self.results, key=lambda k: self.results[k][job], reverse=True)
            chosen.update(ranked[:leaders])
        for _ in range(rounds):
            for key in sorted(chosen):
                self.measure(key, loops=1)
        return {job: {"config": config_of(self.best(job)),
                      "gb_per_s": self.results[self.best(job)][job]} for job in JOBS}

    def close(self):
        if os.path.exists(self.path):
            os.unlink(self.path)
        os.rmdir(self.folder)


def _print_result(result):
    print(f"measured {result['configurations_measured']} configurations of "
          f"{format_size(result['io_size'])} in {result['seconds']:.1f} s")
    for job in JOBS:
        pick = result[job]
        settings = ", ".join(f"{k}={pick[k]}" for k in config_of((0,) * 5))
        print(f"best {job:<9} {pick['gb_per_s']:6.2f} GB/s  {settings}")
    print(json.dumps({"aio": result["aio"]}, indent=2))


def plot_heat_map(results, filename):
    """GB/s (combined) over block size x queue depth, one panel per parallelism."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy

    parallelisms = sorted({k[2] for k in results})
    figure, axes = plt.subplots(1, len(parallelisms), figsize=(4.5 * len(parallelisms), 4),
                                squeeze=False)
    for axis, parallelism in zip(axes[0], parallelisms):
        grid = numpy.full((len(QUEUE_DEPTHS), len(BLOCK_SIZES)), numpy.nan)
        for key, rates in results.items():
            if key[2] == parallelism and key[0] in BLOCK_SIZES and key[1] in QUEUE_DEPTHS:
                row, column = QUEUE_DEPTHS.index(key[1]), BLOCK_SIZES.index(key[0])
                grid[row, column] = numpy.fmax(grid[row, column], rates["combined"])
        image = axis.imshow(grid, origin="lower", cmap="viridis")
        axis.set_xticks(range(len(BLOCK_SIZES)), [format_size(b) for b in BLOCK_SIZES])
        axis.set_yticks(range(len(QUEUE_DEPTHS)), QUEUE_DEPTHS)
        axis.set_xlabel("block size")
        axis.set_ylabel("queue depth")
        axis.set_title(f"intra_op_parallelism={parallelism}")
        for (row, column), value in numpy.ndenumerate(grid):
            if not numpy.isnan(value):
                axis.text(column, row, f"{value:.2f}", ha="center", va="center", color="w")
        figure.colorbar(image, ax=axis, label="GB/s (read+write)")
    figure.tight_layout()
    figure.savefig(filename, dpi=100)
