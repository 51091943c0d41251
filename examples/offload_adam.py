"""Train a small model with its Adam state offloaded to NVMe (ZeRO-Infinity style) and
print the memory that saves.

    python examples/offload_adam.py --folder /nvme/swap
    python examples/offload_adam.py --folder /nvme/swap --layers 16 --width 2048

The same training runs twice, each in a fresh process: with the Adam state in memory,
and with it in files under ``--folder`` (an ``OffloadedOptimizer``: during ``step()``
each layer's state is read back while the previous layer computes, and written back
while the next one does). Each run prints its losses, its peak resident memory and the
memory it holds after the last step; the losses are the same, bit for bit, and the
offloaded run holds less by the size of the Adam state less three layers' worth of swap
buffers (its peak is lower by about as much, give or take the tens of MiB by which a
torch process's peak varies from run to run). The folder is left as it was found.
"""
import argparse
import os
import resource
import subprocess
import sys

import torch

from nvmeswap.training import OffloadedOptimizer


def make_model(layers, width):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))


def train(folder, offload, layers, width, steps):
    """Train; return the losses. One parameter group per layer, so that one layer's
    state is swapped while another's is stepped."""
    torch.set_num_threads(1)        # bit-identical runs: see tests/test_swap.py one_thread
    model = make_model(layers, width)
    groups = [{"params": list(m.parameters())} for m in model if list(m.parameters())]
    optimizer = torch.optim.Adam(groups, lr=1e-4)
    if offload:
        optimizer = OffloadedOptimizer(optimizer, folder)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            inputs = torch.randn(16, width, generator=generator)
            loss = torch.nn.functional.mse_loss(model(inputs), inputs[:, :1].sin())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        held = held_mib()
    finally:
        if offload:
            optimizer.close()
    return losses, held


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # KiB on Linux


def held_mib():
    """The memory this process holds of its own now (anonymous and shared, so locked
    swap buffers count; not the pages of its libraries, which the page cache may take
    back at any time and which make peak RSS vary between runs by tens of MiB)."""
    import ctypes
    ctypes.CDLL(None).malloc_trim(0)    # what malloc keeps of freed memory is not held
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return sum(int(fields[name].split()[0]) for name in ("RssAnon", "RssShmem")) / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-offload")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--run", choices=["plain", "offload"], help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.run:           # one of the two child runs
        losses, held = train(arguments.folder, arguments.run == "offload", arguments.layers,
                             arguments.width, arguments.steps)
        print(" ".join(f"{loss:.9g}" for loss in losses))
        print(f"{peak_rss_mib():.0f} {held:.0f}")
        return
    parameters = sum(p.numel() for p in make_model(arguments.layers, arguments.width)
                     .parameters())
    print(f"{parameters / 1e6:.1f}M parameters, {2 * parameters * 4 / 2**20:.0f} MiB of "
          f"Adam state, {arguments.steps} steps")
    results = {}
    for run in ("plain", "offload"):
        output = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--run", run,
             "--folder", arguments.folder, "--layers", str(arguments.layers),
             "--width", str(arguments.width), "--steps", str(arguments.steps)],
            check=True, capture_output=True, text=True).stdout.split("\n")
        peak, held = map(float, output[1].split())
        results[run] = (output[0], peak, held)
        label = "state in memory" if run == "plain" else "state offloaded"
        print(f"{label}: losses {output[0]}")
        print(f"{' ' * len(label)}  peak RSS {peak:.0f} MiB, held after the last step "
              f"{held:.0f} MiB")
    same = "the same" if results["plain"][0] == results["offload"][0] else "DIFFERENT"
    print(f"losses {same}; offloading saved "
          f"{results['plain'][1] - results['offload'][1]:.0f} MiB of peak RSS, "
          f"{results['plain'][2] - results['offload'][2]:.0f} MiB held between steps")


if __name__ == "__main__":
    main()
