"""What offloading optimizer state costs and saves, in one run.

    python bench/offload.py --folder /nvme/scratch

1. Overlap: Adam step time on a model with eight parameter groups (~``--state-mib`` of
   Adam state) with the state in memory, with OffloadedOptimizer (prefetch and write-back
   overlap the compute), and with the same swaps done synchronously (read a group's state,
   step, write it back, one after the other).
2. Swap bandwidth: TensorSwapper swap_out + synchronize_writes and swap_in +
   synchronize_reads of 1 GiB per rank (``--swap-size``; four tensors in the swapper's locked memory,
   overwriting their files), for 1 and 2 ranks (``--ranks``), against ``nvmeswap bench --ranks N``
   (locked buffers) on the same folder.
3. Memory: peak resident memory of a training run with and without offload.
4. Step overhead at scale: the Adam step of a ``--params``-parameter model (default 100M,
   eight layers, one group each) offloaded / in memory, and the disk bandwidth the
   offloaded step reaches (its state read and written once per step) as a ratio to
   ``nvmeswap bench`` on the same folder with one group's state per operation:
   (bytes read / bench read GB/s + bytes written / bench write GB/s) / step time, the
   share of the step the device would need at the bench's speed.

``--parts`` picks some of them (``--parts step`` runs only 4).
"""
import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from nvmeswap.training import OffloadedOptimizer, TensorSwapper
from nvmeswap.units import parse_size

LAYERS = 8


def make_model(state_mib):
    """Eight linear layers holding ``state_mib / 2`` MiB of parameters (Adam keeps 2x)."""
    width = int((state_mib / 2 * (1 << 20) / 4 / LAYERS) ** 0.5)
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                 for _ in range(LAYERS)])


def make_optimizer(model):
    return torch.optim.Adam([{"params": [p]} for p in model.parameters()], lr=1e-4)


def step_seconds(model, optimizer, steps, before_step=None):
    x = torch.randn(8, model[0].in_features)
    times = []
    for _ in range(steps + 1):              # the first step creates the state: not timed
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        started = time.perf_counter()
        (before_step or (lambda: None))()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


class SynchronousSwaps:
    """The same swaps as OffloadedOptimizer, each waited for before the next thing."""

    def __init__(self, optimizer, folder):
        self.optimizer = optimizer
        self.swapper = TensorSwapper(folder)
        self.keys = {}

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        everything = self.optimizer.param_groups
        for index, group in enumerate(everything):
            for (i, param, name), key in self.keys.items():
                if i == index:
                    self.optimizer.state[param][name] = self.swapper.swap_in(key,
                                                                             async_op=False)
            self.optimizer.param_groups = [group]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = everything
            for param in group["params"]:
                for name, value in list(self.optimizer.state[param].items()):
                    if value.numel() > 1:
                        key = f"g{index}.{name}"
                        self.swapper.swap_out(key, value, async_op=False)
                        self.keys[index, param, name] = key
                        del self.optimizer.state[param][name]

    def close(self):
        self.swapper.close()


def overlap(folder, state_mib, steps):
    results = {}
    model = make_model(state_mib)
    results["in memory"] = step_seconds(model, make_optimizer(model), steps)
    model = make_model(state_mib)
    offloaded = OffloadedOptimizer(make_optimizer(model), os.path.join(folder, "async"))
    results["offloaded (overlapped)"] = step_seconds(model, offloaded, steps)
    offloaded.close()
    model = make_model(state_mib)
    synchronous = SynchronousSwaps(make_optimizer(model), os.path.join(folder, "sync"))
    results["offloaded (synchronous swaps)"] = step_seconds(model, synchronous, steps)
    synchronous.close()
    return results


def swap_rank(rank, folder, nbytes, barrier, queue):
    """Swap four tensors (nbytes in all) out and in, from the swapper's locked memory."""
    with TensorSwapper(os.path.join(folder, f"rank{rank}")) as swapper:
        tensors = [swapper.new_locked_tensor(nbytes // 4) for _ in range(4)]
        for t in tensors:
            t.random_(0, 255)
        timings = []
        for _ in range(2):                      # the first round creates the files
            barrier.wait()
            started = time.perf_counter()
            for i, t in enumerate(tensors):
                swapper.swap_out(i, t)
            swapper.synchronize_writes()
            written = time.perf_counter() - started
            barrier.wait()
            started = time.perf_counter()
            for i, t in enumerate(tensors):
                swapper.swap_in(i, out=t)
            swapper.synchronize_reads()
            timings.append((written, time.perf_counter() - started))
        for t in tensors:
            swapper.free_locked_tensor(t)
    queue.put((rank, *timings[-1]))


def swap_bandwidth(folder, ranks, nbytes):
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(ranks), context.Queue()
    processes = [context.Process(target=swap_rank, args=(r, folder, nbytes, barrier, queue))
                 for r in range(ranks)]
    for p in processes:
        p.start()
    timings = [queue.get() for _ in processes]
    for p in processes:
        p.join()
    return {"write": ranks * nbytes / max(t[1] for t in timings) / 1e9,
            "read": ranks * nbytes / max(t[2] for t in timings) / 1e9}


def bench_command(folder, ranks, nbytes):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "nvmeswap", "bench", "--folder", folder,
                        "--io-size", str(nbytes), "--ranks", str(ranks),
                        "--loops", "2", "--json", out.name], check=True, capture_output=True)
        jobs = json.load(out)["jobs"]
    return {job: jobs[job]["gb_per_s"] for job in ("write", "read")}


def peak_rss_mib(folder, state_mib, offload):
    """Peak RSS over steps 3 and 4 (step 1 creates the state in memory either way)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import offload as b;"
            f"m = b.make_model({state_mib}); o = b.make_optimizer(m);"
            f"o = b.OffloadedOptimizer(o, {folder!r}) if {offload} else o;"
            f"b.step_seconds(m, o, 1); print(b.sampled_peak_rss(lambda: b.step_seconds(m, o, 1)))")
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True).stdout
    return float(output.split()[-1])


def sampled_peak_rss(work):
    """Run ``work`` while sampling this process's RSS every 2 ms; return the peak in MiB."""
    import threading

    import psutil
    me, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return peak[0] / (1 << 20)


def step_overhead(folder, params, steps):
    """Part 4: offloaded / in-memory Adam step time and the bandwidth the step reaches."""
    state_mib = 2 * params * 4 / (1 << 20)
    results = overlap_steps(folder, state_mib, steps)
    state_bytes = 2 * results["parameters"] * 4
    group_bytes = state_bytes // LAYERS
    bench = bench_command(folder, 1, group_bytes)
    seconds = results["offloaded"]
    device_seconds = state_bytes / (bench["read"] * 1e9) + state_bytes / (bench["write"] * 1e9)
    return {"parameters": results["parameters"], "state_bytes": state_bytes,
            "in memory": results["in memory"], "offloaded": seconds,
            "reached_gb_per_s": 2 * state_bytes / seconds / 1e9,
            "bench": bench, "device_share": device_seconds / seconds,
            "threads": torch.get_num_threads()}


def overlap_steps(folder, state_mib, steps):
    results = {}
    model = make_model(state_mib)
    results["parameters"] = sum(p.numel() for p in model.parameters())
    results["in memory"] = step_seconds(model, make_optimizer(model), steps)
    del model
    model = make_model(state_mib)
    with OffloadedOptimizer(make_optimizer(model), os.path.join(folder, "step")) as offloaded:
        results["offloaded"] = step_seconds(model, offloaded, steps)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--state-mib", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--params", type=float, default=100e6,
                        help="parameters of part 4's model (default 100M)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in part 4")
    parser.add_argument("--swap-size", type=parse_size, default="1G",
                        help="bytes swapped per rank in part 2")
    parser.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")],
                        default="1,2", help="comma-separated rank counts of part 2")
    parser.add_argument("--parts", nargs="+", default=["overlap", "bandwidth", "memory", "step"],
                        choices=["overlap", "bandwidth", "memory", "step"])
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    if "overlap" in arguments.parts:
        part_overlap(arguments)
    if "bandwidth" in arguments.parts:
        part_bandwidth(arguments)
    if "memory" in arguments.parts:
        part_memory(arguments)
    if "step" in arguments.parts:
        part_step(arguments)


def part_overlap(arguments):
    print(f"1. Adam step, {arguments.state_mib} MiB of state in {LAYERS} groups (median of "
          f"{arguments.steps} steps)")
    times = overlap(arguments.folder, arguments.state_mib, arguments.steps)
    for name, seconds in times.items():
        print(f"   {name:<32} {seconds:7.3f} s  ({seconds / times['in memory']:.2f}x in memory)")
    sync = times["offloaded (synchronous swaps)"]
    print(f"   overlapped / synchronous: {times['offloaded (overlapped)'] / sync:.2f}")


def part_bandwidth(arguments):
    size = arguments.swap_size
    print(f"2. swap bandwidth, {size / 2**30:g} GiB per rank, GB/s (ratio to nvmeswap bench "
          "--ranks N)")
    for ranks in arguments.ranks:
        swapped = swap_bandwidth(arguments.folder, ranks, size)
        bench = bench_command(arguments.folder, ranks, size)
        print(f"   {ranks} rank(s): " + "  ".join(
            f"{job} {swapped[job]:.2f} ({swapped[job] / bench[job]:.2f}x of {bench[job]:.2f})"
            for job in ("write", "read")))


def part_memory(arguments):
    print(f"3. peak resident memory over training steps 3-4 ({arguments.state_mib} MiB of "
          "Adam state, as much again in parameters and gradients)")
    for offload in (False, True):
        rss = peak_rss_mib(os.path.join(arguments.folder, "rss"), arguments.state_mib, offload)
        print(f"   {'with' if offload else 'without'} offload: {rss:7.0f} MiB")


def part_step(arguments):
    # One torch thread: on a machine whose cores the I/O workers share, more threads make
    # the in-memory step itself several times slower and noisier.
    torch.set_num_threads(arguments.threads)
    r = step_overhead(arguments.folder, int(arguments.params), arguments.steps)
    print(f"4. Adam step, {r['parameters'] / 1e6:.1f}M parameters in {LAYERS} groups, "
          f"{r['state_bytes'] / 2**20:.0f} MiB of state (median of {arguments.steps} steps, "
          f"{r['threads']} torch threads)")
    print(f"   in memory {r['in memory']:.3f} s, offloaded {r['offloaded']:.3f} s: "
          f"{r['offloaded'] / r['in memory']:.2f}x")
    print(f"   disk traffic during the offloaded step: {r['reached_gb_per_s']:.2f} GB/s "
          f"(read + written); nvmeswap bench, {r['state_bytes'] // LAYERS / 2**20:.0f} MiB "
          f"per operation: write {r['bench']['write']:.2f} GB/s, read "
          f"{r['bench']['read']:.2f} GB/s")
    print(f"   the step moves what the device moves at bench speed in "
          f"{r['device_share']:.2f} of its time (1.00: the step is as fast as the disk)")


if __name__ == "__main__":
    main()
