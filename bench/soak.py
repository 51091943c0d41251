"""Soak: mixed random traffic with periodic worker kills; nothing lost, nothing leaked.

    python bench/soak.py --folder /nvme/scratch --minutes 10

Random reads and writes (sizes 1 B to 4 MiB, any offset, sync and async, locked and
plain buffers) against a model of the files, checking every byte read. Every few
seconds a worker is killed with SIGKILL: the operations it had fail with WorkerDied and
are written again, the handle recovers. Every 30 s it prints operations, faults, bytes
verified, and the process's RSS, descriptors and shared mappings, which must stay flat;
at the end it checks that nothing is left once the handle is closed.
"""
import argparse
import os
import random
import signal
import time

import numpy as np
import psutil
import torch

import nvmeswap

FILE_LIMIT = 64 << 20     # files stop growing here, so the models' memory stays flat


def shared_mappings():
    with open("/proc/self/maps") as maps:
        return sum("memfd:nvmeswap" in line for line in maps)


def snapshot(process):
    return {"rss_mib": process.memory_info().rss >> 20, "fds": process.num_fds(),
            "children": len(process.children()), "shared_mappings": shared_mappings()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=5.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    rng = np.random.default_rng(arguments.seed)
    me = psutil.Process()
    before = snapshot(me)
    paths = [os.path.join(arguments.folder, f"soak{i}.bin") for i in range(4)]
    models = [bytearray() for _ in paths]
    counts = {"operations": 0, "faults injected": 0, "operations failed by a fault": 0,
              "bytes verified": 0}
    started = last_kill = last_report = time.monotonic()
    deadline = started + arguments.minutes * 60
    with nvmeswap.aio_handle(intra_op_parallelism=2, overlap_events=True) as h:
        locked = h.new_cpu_locked_tensor(4 << 20, torch.empty(0, dtype=torch.uint8))
        while time.monotonic() < deadline:
            i = int(rng.integers(len(paths)))
            model = models[i]
            size = int(rng.integers(1, 4 << 20))
            buffer = locked[:size] if rng.random() < 0.5 else torch.empty(size, dtype=torch.uint8)
            if len(model) >= size and rng.random() < 0.5:
                offset = int(rng.integers(0, len(model) - size + 1))
                done = _attempt(counts, h.sync_pread, buffer, paths[i], offset)
                if done:
                    assert buffer.numpy().tobytes() == model[offset:offset + size], "corrupt read"
                    counts["bytes verified"] += size
            else:
                offset = int(rng.integers(0, min(len(model) + 65536, FILE_LIMIT - size) + 1))
                data = rng.integers(0, 256, size, dtype=np.uint8)
                buffer.numpy()[:] = data
                use_async = rng.random() < 0.5
                while not _attempt(counts, _write, h, buffer, paths[i], offset, use_async):
                    pass            # a write that failed with its worker is written again
                model.extend(bytes(max(0, offset + size - len(model))))
                model[offset:offset + size] = data.tobytes()
            counts["operations"] += 1
            now = time.monotonic()
            if now - last_kill > arguments.kill_every:
                workers = me.children()
                if workers:
                    random.choice(workers).send_signal(signal.SIGKILL)
                    counts["faults injected"] += 1
                last_kill = now
            if now - last_report > 30:
                print(f"{now - started:6.0f} s  {counts}  {snapshot(me)}", flush=True)
                last_report = now
        for path, model in zip(paths, models):
            with open(path, "rb") as f:
                assert f.read() == model, f"{path} differs from its model"
            counts["bytes verified"] += len(model)
        locked = buffer = None     # the locked memory goes with its last tensor
    after = snapshot(me)
    for path in paths:
        os.unlink(path)
    leaks = {k: (before[k], after[k]) for k in ("children", "shared_mappings", "fds")
             if after[k] != before[k]}
    print(f"done: {counts}")
    print(f"before: {before}  after close: {after}  leaks: {leaks or 0}")


def _write(h, buffer, path, offset, use_async):
    if use_async:
        h.async_pwrite(buffer, path, offset)
        h.wait()
    else:
        h.sync_pwrite(buffer, path, offset)


def _attempt(counts, operation, *args):
    try:
        operation(*args)
        return True
    except nvmeswap.WorkerDied:
        counts["operations failed by a fault"] += 1
        return False


if __name__ == "__main__":
    main()
