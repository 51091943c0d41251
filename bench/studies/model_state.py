"""A model's checkpoint of many small tensors: nvmeswap's one-call save and load against
torch's.

    python bench/studies/model_state.py --folder /nvme/scratch [--rounds 5] [--scale 1]

The state is a ResNet-50-like model's (50 convolutions, each with its batch norm's four
vectors and counter, and a classifier: ``--scale`` multiplies the channels) with Adam's
state for it: 758 tensors, 174 MiB at scale 1, most of them small. Each contender runs
in a fresh process of its own, rounds rotating which goes first; loads are cold (the
page cache dropped, root; the table says if not) and checked value for value against
the state saved. The asynchronous saves' seconds are the caller's, until the call returns
(each file is then checked once written). Prints the median seconds and nvmeswap's
speed-ups.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers

SAVERS = ["torch.save", "torch.save + fsync", "nvmeswap.save"]
#: Their seconds are the caller's: until the call returns (the save goes on after).
ASYNC_SAVERS = ["nvmeswap.async_save", "nvmeswap.async_save, background snapshot"]
LOADERS = ["torch.load", "nvmeswap.load"]


def make_state(scale):
    """The model's state dict and Adam's, as a training script checkpoints them."""
    import torch

    made = torch.Generator().manual_seed(0)
    model = {}
    before = 3
    for layer, width in enumerate([64] * 10 + [128] * 12 + [256] * 18 + [512] * 10):
        width *= scale
        kernel = 3 if layer % 3 == 1 else 1
        model[f"layer{layer}.conv.weight"] = torch.randn(width, before, kernel, kernel,
                                                         generator=made)
        for name in ("weight", "bias", "running_mean", "running_var"):
            model[f"layer{layer}.bn.{name}"] = torch.randn(width, generator=made)
        model[f"layer{layer}.bn.num_batches_tracked"] = torch.tensor(100)
        before = width
    model["fc.weight"] = torch.randn(1000, before, generator=made)
    model["fc.bias"] = torch.randn(1000, generator=made)
    trained = [name for name, value in model.items()
               if value.is_floating_point() and "running" not in name]
    optimizer = {
        "state": {index: {"step": torch.tensor(10.0),
                          "exp_avg": torch.randn(model[name].shape, generator=made),
                          "exp_avg_sq": torch.rand(model[name].shape, generator=made)}
                  for index, name in enumerate(trained)},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0,
                          "amsgrad": False, "params": list(range(len(trained)))}]}
    return {"model": model, "optimizer": optimizer, "epoch": 3}


def same(a, b):
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def child(contender, path, scale):
    import torch

    import nvmeswap

    state = make_state(scale)
    started = time.perf_counter()
    if contender.startswith("torch.save"):
        torch.save(state, path)
        if "fsync" in contender:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    elif contender == "nvmeswap.save":
        nvmeswap.save(state, path)
    elif contender in ASYNC_SAVERS:
        future = nvmeswap.async_save(state, path,
                                     background_snapshot=contender.endswith("snapshot"))
        blocked = time.perf_counter() - started
        future.result()
        print(json.dumps({"seconds": blocked, "cold": True,
                          "same": same(state, torch.load(path))}))
        return
    else:
        cold = peers.drop_page_cache()
        started = time.perf_counter()
        loaded = (torch.load if contender == "torch.load" else nvmeswap.load)(path)
        seconds = time.perf_counter() - started
        print(json.dumps({"seconds": seconds, "cold": cold, "same": same(state, loaded)}))
        return
    print(json.dumps({"seconds": time.perf_counter() - started, "cold": True, "same": True}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=int, default=1, help="channels times this")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        contender, path, scale = arguments.child
        child(contender, path, int(scale))
        return
    times = {name: [] for name in SAVERS + ASYNC_SAVERS + LOADERS}
    cold = identical = True
    with tempfile.TemporaryDirectory(prefix="nvmeswap-model-", dir=arguments.folder) as folder:
        paths = {"torch": os.path.join(folder, "torch.pt"),
                 "nvmeswap": os.path.join(folder, "nvmeswap.pt")}
        for round_number in range(arguments.rounds):
            for names in (SAVERS + ASYNC_SAVERS, LOADERS):
                for name in peers.rotated(names, round_number):   # none always first
                    path = paths[name.split(".")[0]]
                    if name not in LOADERS and os.path.exists(path):
                        os.unlink(path)
                    os.sync()
                    got = peers.child_result([sys.executable, __file__, "--child", name, path,
                                              str(arguments.scale)], name)
                    times[name].append(got["seconds"])
                    cold &= got["cold"]
                    identical &= got["same"]
    median = {name: statistics.median(values) for name, values in times.items()}
    from nvmeswap.checkpoint.state import state_tensors

    tensors = [tensor for _, tensor in state_tensors(make_state(arguments.scale))]
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    print(f"model state: {len(tensors)} tensors, {nbytes / (1 << 20):.0f} MiB; median of "
          f"{arguments.rounds} round(s), seconds; loads {'cold' if cold else 'WARM'}; "
          f"every load the same values: {identical}")
    for name in SAVERS + ASYNC_SAVERS + LOADERS:
        print(f"{name + (' (blocked)' if name in ASYNC_SAVERS else ''):<50} "
              f"{median[name]:7.3f}")
    for peer, ours in (("torch.save", "nvmeswap.save"), ("torch.save + fsync", "nvmeswap.save"),
                       ("torch.load", "nvmeswap.load")):
        print(f"{ours} vs {peer}: {median[peer] / median[ours]:.2f}x")
    for name in ASYNC_SAVERS:
        print(f"{name} blocked / nvmeswap.save: "
              f"{median[name] / median['nvmeswap.save']:.2f}")


if __name__ == "__main__":
    main()
