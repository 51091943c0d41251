"""What does laying a state of many small tensors out cost, against torch.save's own
pickle and zip records?

    python bench/studies/layout_cost.py [--rounds 21] [--tensors 2000]

Times, in this one process, nvmeswap's layout of a state (``layout()`` in
checkpoint/torch_zip.py: the pickle, the zip records around a hole per storage, the file
image with its CRC places: Note [laying out many tensors]) and ``torch.save`` of the same
state into memory (``io.BytesIO``: its pickle, records and the tensors' bytes with their
CRCs, no disk). Two states: ``--tensors`` small tensors (a weight of 32 KiB and a bias
of 512 bytes for each layer, as bench/checkpoint.py's ``--layers``) and the model's
state of bench/studies/model_state.py (758 tensors). Prints the median and the fastest
of ``--rounds`` calls each, after three unmeasured ones. To compare two versions of
nvmeswap, run it with ``PYTHONPATH`` at each checkout in turn.
"""
import argparse
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_state import make_state


def small_tensors(count):
    import torch

    made = torch.Generator().manual_seed(0)
    return {f"layer{index // 2}.{'bias' if index % 2 else 'weight'}":
            torch.randn(128 if index % 2 else 8192, generator=made) for index in range(count)}


def timed(call, rounds):
    for _ in range(3):
        call()
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), min(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--tensors", type=int, default=2000)
    args = parser.parse_args()

    import torch

    import nvmeswap
    from nvmeswap.checkpoint.torch_zip import layout

    print(f"nvmeswap from {os.path.dirname(nvmeswap.__file__)}, torch {torch.__version__}; "
          f"median and fastest of {args.rounds} calls, milliseconds")
    for name, state in [(f"{args.tensors} small tensors", small_tensors(args.tensors)),
                        ("model state", make_state(1))]:
        ours = timed(lambda state=state: layout(state), args.rounds)
        torch_s = timed(lambda state=state: torch.save(state, io.BytesIO()), args.rounds)
        print(f"{name}: layout {ours[0] * 1e3:.1f} / {ours[1] * 1e3:.1f}; torch.save into "
              f"memory {torch_s[0] * 1e3:.1f} / {torch_s[1] * 1e3:.1f}; layout / torch.save "
              f"{ours[0] / torch_s[0]:.2f}")


if __name__ == "__main__":
    main()
