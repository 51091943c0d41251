"""Is ``nvmeswap tune``'s quick pick as good as the exhaustive grid's best, and how quick?

    python bench/studies/tune_quality.py --folder /nvme/scratch

Runs ``nvmeswap tune`` (default search) and ``nvmeswap tune --exhaustive`` on the same
folder, then measures both picks again, interleaved over several rounds (one-off
measurements are noisy), and prints the wall-clock times and the median ratio.
``--exhaustive-seconds S`` stops the exhaustive search with Ctrl-C after S seconds (its
pick is then the best of what it measured); ``--io-size`` and ``--budget-seconds`` are
passed to both searches.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

from nvmeswap.cli import tune


def run_tune(folder, *extra, stop_after=None):
    """``nvmeswap tune``'s JSON; Ctrl-C after ``stop_after`` seconds, as a user would."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "nvmeswap", "tune", "--folder", folder,
                   "--json", out.name, *extra]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            output, errors = process.communicate(timeout=stop_after)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)    # stops after the current configuration
            output, errors = process.communicate()
        if process.returncode not in (0, 130):
            raise subprocess.CalledProcessError(process.returncode, command, output, errors)
        return json.load(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--io-size", help="passed to nvmeswap tune (default: its own)")
    parser.add_argument("--budget-seconds", help="passed to nvmeswap tune (default: its own)")
    parser.add_argument("--exhaustive-seconds", type=float,
                        help="stop the exhaustive search after this long (default: never)")
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    extra = [f"--{name.replace('_', '-')}={value}" for name, value in vars(arguments).items()
             if name in ("io_size", "budget_seconds") and value is not None]
    quick = run_tune(arguments.folder, *extra)
    full = run_tune(arguments.folder, "--exhaustive", *extra,
                    stop_after=arguments.exhaustive_seconds)
    tuner = tune.Tuner(arguments.folder, quick["io_size"], loops=1)
    picks = {"quick": tune.key_of(quick["aio"]), "exhaustive": tune.key_of(full["aio"])}
    try:
        rates = {name: [] for name in picks}
        for _ in range(arguments.rounds):
            for name, key in picks.items():
                tuner.samples.pop(key, None)
                rates[name].append(tuner.measure(key)["combined"])
    finally:
        tuner.close()
    print(f"nvmeswap tune:              {quick['seconds']:6.1f} s, "
          f"{quick['configurations_measured']} configurations, pick {quick['aio']}")
    print(f"nvmeswap tune --exhaustive: {full['seconds']:6.1f} s, "
          f"{full['configurations_measured']} configurations, pick {full['aio']}"
          + (" (stopped before the end of the grid)" if full["interrupted"] else ""))
    for name in picks:
        print(f"{name:<11} pick, re-measured: {statistics.median(rates[name]):.2f} GB/s "
              "(read+write, median)")
    ratios = [q / e for q, e in zip(rates["quick"], rates["exhaustive"])]
    print(f"quick / exhaustive: {statistics.median(ratios):.3f} (median per-round ratio)")


if __name__ == "__main__":
    main()
