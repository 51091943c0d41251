"""Copies between a GPU and locked host memory: nvmeswap's locked tensor against torch's
``pin_memory()`` and DeepSpeed's locked tensor, each in a fresh process.

    python bench/gpu_copies.py --size 256M --copies 10

The question: does a tensor from ``new_cpu_locked_tensor`` copy to and from the GPU at
pinned speed (it is ``cudaHostRegister``ed where CUDA is in use, see docs/design.md)?
Prints host-to-device and device-to-host GB/s (10^9 bytes per second, the median of
``--copies`` timed copies after one untimed) and the ratios to ``pin_memory()``'s and
DeepSpeed's. Needs a CUDA GPU; DeepSpeed's column appears where it is installed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CONTENDERS = ("nvmeswap locked", "torch pin_memory", "deepspeed locked")


def host_tensor(kind, nbytes):
    """The host tensor of ``kind`` (its handle kept alive alongside)."""
    import torch
    example = torch.empty(0, dtype=torch.uint8)
    if kind == "torch pin_memory":
        return torch.empty(nbytes, dtype=torch.uint8).pin_memory(), None
    if kind == "nvmeswap locked":
        import nvmeswap
        handle = nvmeswap.aio_handle()
    else:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        handle = AsyncIOBuilder().load(verbose=False).aio_handle()
    return handle.new_cpu_locked_tensor(nbytes, example), handle


def contender_run(kind, nbytes, copies):
    """In this process: median GB/s of host-to-device and device-to-host copies."""
    import torch
    torch.cuda.init()       # CUDA in use before the tensor is made, as in training
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host, handle = host_tensor(kind, nbytes)
    host.fill_(7)
    rates = {}
    for direction in ("h2d", "d2h"):
        seconds = []
        for copy in range(copies + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if direction == "h2d":
                device.copy_(host, non_blocking=True)
            else:
                host.copy_(device, non_blocking=True)
            end.record()
            end.synchronize()
            if copy:        # the first copy is not timed
                seconds.append(start.elapsed_time(end) / 1000)
        rates[direction] = nbytes / statistics.median(seconds) / 1e9
    rates["is_pinned"] = bool(host.is_pinned())
    del handle
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256M", help="bytes per copy (e.g. 256M)")
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    from nvmeswap.units import parse_size
    nbytes = parse_size(arguments.size)
    if arguments.contender:
        print(json.dumps(contender_run(arguments.contender, nbytes, arguments.copies)))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gpu_copies.py needs a CUDA GPU; torch sees none: not measured here",
              file=sys.stderr)
        return 2
    results = {}
    for kind in CONTENDERS:
        ran = subprocess.run([sys.executable, __file__, "--size", arguments.size, "--copies",
                              str(arguments.copies), "--contender", kind],
                             capture_output=True, text=True, check=False,
                             env=dict(os.environ, NVMESWAP_DEEPSPEED="0"))
        if ran.returncode != 0:
            print(f"{kind}: not measured ({ran.stderr.strip().splitlines()[-1:]})",
                  file=sys.stderr)
            continue
        results[kind] = json.loads(ran.stdout.splitlines()[-1])
    print(f"{'contender':<18} {'H2D GB/s':>9} {'D2H GB/s':>9}  is_pinned")
    for kind, rates in results.items():
        print(f"{kind:<18} {rates['h2d']:9.1f} {rates['d2h']:9.1f}  {rates['is_pinned']}")
    ours = results.get("nvmeswap locked")
    for baseline in ("torch pin_memory", "deepspeed locked"):
        if ours and baseline in results:
            theirs = results[baseline]
            print(f"nvmeswap locked / {baseline}: H2D {ours['h2d'] / theirs['h2d']:.2f}x, "
                  f"D2H {ours['d2h'] / theirs['d2h']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
