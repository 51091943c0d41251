"""The figures of an ``nvmeswap bench`` run, and the table and ds_io lines that print them.

What each figure means is in ``bench``'s docstring (the command's help).
"""
import sys

from ..units import DS_IO_GB, GB, format_size


def summarise(plan, results):
    """The figures of a run, ds_io's included (see the module docstring for their meaning)."""
    size = plan["io_size"] * plan["ops"]     # bytes per timed loop and rank
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
            "ops_per_s": plan["ops"] * sum(loops) / task_latency,
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
    if config["pattern"] == "rand":
        how = (f"in batches of {config['batch']}" if config["batch"]
               else "one async call each")
        print(f"nvmeswap bench: {config['ops']} random {format_size(config['io_size'])} "
              f"requests per loop and rank in a {format_size(config['file_size'])} file, "
              f"{how}; {config['ranks']} rank(s), buffer {_buffer_words(summary)}", file=out)
    else:
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
        print(f"{job:<7}{'all':>6}{figures['loops']:>7}{_cell(figures['gb_per_s'], 9, '.2f')}"
              f"{_cell(figures['latency_p50_s'] * 1e3, 10, '.1f')}"
              f"{_cell(figures['latency_p99_s'] * 1e3, 10, '.1f')}"
              f"{_cell(figures['cpu_seconds_per_gb'], 10, '.3f')}{figures['bytes']:>15}",
              file=out)
        if config["pattern"] == "rand":
            print(f"{job:<7}{'all':>6}{'':>7}{figures['ops_per_s']:>9.0f} requests/s", file=out)
    # The lines that scripts written for ds_io parse, with ds_io's meanings and its GB (2^30).
    print("ds_io lines (GB = 2^30 bytes; Latency = the timed loops summed; E2E adds the "
          "barrier, not set-up):", file=out)
    for job, figures in summary["jobs"].items():
        name = job.capitalize()
        print(f"Task {name} Latency = {figures['task_latency_s']} sec", file=out)
        print(f"Task {name} Speed = {figures['ds_io_task_gb_per_s']} GB/sec", file=out)
        print(f"E2E {name} Latency = {figures['e2e_latency_s']} sec", file=out)
        print(f"E2E {name} Speed = {figures['ds_io_e2e_gb_per_s']} GB/sec", file=out)


def _cell(value, width, spec):
    """``value`` right-aligned in ``width`` columns, with one space before it at least:
    in a shorter form if ``spec`` does not fit (the CPU time of a run of a few bytes is a
    scheduler tick over almost nothing)."""
    text = format(value, spec)
    if len(text) >= width:
        text = format(value, ".2g")
    return text.rjust(width)
