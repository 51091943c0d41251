"""What offloading optimizer state costs and saves, in one run.

    python bench/offload.py --folder /nvme/scratch

1. Overlap: Adam step time on a model with eight parameter groups (~``--state-mib`` of
   Adam state) with the state in memory, with OffloadedOptimizer (prefetch and write-back
   overlap the compute), and with the same swaps done synchronously (read a group's state,
   step, write it back, one after the other).
2. Swap bandwidth: TensorSwapper swap_out + synchronize_writes and swap_in +
   synchronize_reads of 1 GiB per rank (four tensors in the swapper's locked memory,
   overwriting their files), for 1 and 2 ranks, against ``nvmeswap bench --ranks N``
   (locked buffers) on the same folder.
3. Memory: peak resident memory of a training run with and without offload.
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--state-mib", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    print(f"1. Adam step, {arguments.state_mib} MiB of state in {LAYERS} groups (median of "
          f"{arguments.steps} steps)")
    times = overlap(arguments.folder, arguments.state_mib, arguments.steps)
    for name, seconds in times.items():
        print(f"   {name:<32} {seconds:7.3f} s  ({seconds / times['in memory']:.2f}x in memory)")
    sync = times["offloaded (synchronous swaps)"]
    print(f"   overlapped / synchronous: {times['offloaded (overlapped)'] / sync:.2f}")
    print("2. swap bandwidth, 1 GiB per rank, GB/s (ratio to nvmeswap bench --ranks N)")
    for ranks in (1, 2):
        swapped = swap_bandwidth(arguments.folder, ranks, 1 << 30)
        bench = bench_command(arguments.folder, ranks, 1 << 30)
        print(f"   {ranks} rank(s): " + "  ".join(
            f"{job} {swapped[job]:.2f} ({swapped[job] / bench[job]:.2f}x of {bench[job]:.2f})"
            for job in ("write", "read")))
    print(f"3. peak resident memory over training steps 3-4 ({arguments.state_mib} MiB of "
          "Adam state, as much again in parameters and gradients)")
    for offload in (False, True):
        rss = peak_rss_mib(os.path.join(arguments.folder, "rss"), arguments.state_mib, offload)
        print(f"   {'with' if offload else 'without'} offload: {rss:7.0f} MiB")


if __name__ == "__main__":
    main()
