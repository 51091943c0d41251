"""Run by tests/test_checkpoint_crash.py: rounds of checkpoint saves, each process killed
with SIGKILL at a random instant.

``python checkpoint_crash_child.py FOLDER ROUNDS SEED WINDOW [striped|background|one-call]``:
round r
saves generation after generation to ``FOLDER/round<r>/ckpt.pt`` (striped: to
``FOLDER/dev0/ckpt<r>.pt`` striped over ``FOLDER/dev0`` and ``FOLDER/dev1``; background: with
``async_save(..., background_snapshot=True)``, two saves in flight; one-call: with
``nvmeswap.save``, no handle: Note [saves without a handle]) in a forked process
(torch and nvmeswap already imported, so a round starts in milliseconds), which is killed
a random time after its handle is ready, up to WINDOW seconds (a few saves' time: so
that kills land both inside the first save and after some). Prints one JSON line: the
delay of each kill.
"""
import json
import os
import random
import signal
import sys
import time


def make_state(generation, mode=""):
    """The checkpoint of ``generation``: its bytes follow from the number (and the mode)
    alone. One-call saves get a larger one (16 MiB): each call's own setup would
    otherwise take most of the time, and few kills would land inside a save's writes."""
    import torch

    made = torch.Generator().manual_seed(generation)
    return {
        "generation": generation,
        "w": torch.randn(4096 if mode == "one-call" else 512, 1024, generator=made),
        "b": torch.randn(300_001, generator=made).bfloat16(),
        "steps": [torch.full((1000,), generation, dtype=torch.int64), "adam"],
    }


def _saver(path, first, ready, stripes, mode):
    import nvmeswap

    # Four states made up front, saved in turn: saves follow each other with no gap, so
    # nearly every kill lands inside one.
    states = [make_state(first + k, mode) for k in range(4)]
    if mode == "one-call":
        os.write(ready, b"r")
        while True:
            for state in states:
                nvmeswap.save(state, path)
    with nvmeswap.Checkpointer(chunk_bytes=1 << 20, chunks=2, stripe_folders=stripes,
                               stripe_bytes=256 << 10) as checkpointer:
        os.write(ready, b"r")
        pending = None
        while True:
            for state in states:
                if mode != "background":
                    checkpointer.save(state, path)
                    continue
                started = checkpointer.async_save(state, path, background_snapshot=True)
                if pending is not None:
                    pending.result()
                pending = started


def main():
    folder, rounds, seed, window = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        float(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else ""
    striped = mode == "striped"
    import torch  # noqa: F401  (imported before the forks: each round starts at once)

    import nvmeswap.checkpoint  # noqa: F401  (the top level loads it on first use only)

    chosen = random.Random(seed)
    delays = []
    for index in range(rounds):
        stripes = [os.path.join(folder, f"dev{k}") for k in range(2)] if striped else None
        path = os.path.join(stripes[0], f"ckpt{index}.pt") if striped else \
            os.path.join(folder, f"round{index}", "ckpt.pt")
        ready_read, ready_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_read)
            try:
                _saver(path, (index + 1) * 1000, ready_write, stripes, mode)
            finally:
                os._exit(1)
        os.close(ready_write)
        os.read(ready_read, 1)
        os.close(ready_read)
        delays.append(chosen.uniform(0, window))
        time.sleep(delays[-1])
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(json.dumps(delays))


if __name__ == "__main__":
    main()
