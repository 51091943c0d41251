"""Slices of locked buffers at addresses that are not 4 KiB-aligned, as ZeRO-Infinity's
swappers make them: DeepSpeed's compiled op against nvmeswap, bytes compared.

DeepSpeed pads each partition to a multiple of 512 x intra_op_parallelism bytes (its
get_alignment()) and packs them one after another into a locked buffer, so with
partition sizes that are not 4 KiB multiples most slices start inside a page. Each
(padded) slice is written to its own file and read back into the cleared buffer, as the
swappers do (all started, then one wait); files and slices are compared. Each engine runs in its own process,
so that an abort in one is reported rather than ending the comparison.

    python bench/studies/deepspeed_unaligned_slices.py            # both, where DeepSpeed's op loads
    python bench/studies/deepspeed_unaligned_slices.py --engine nvmeswap

DeepSpeed's op is JIT-compiled on its first load (minutes, then cached).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

SIZES = (1000, 3001, 7777, 255, 12_000, 270_001, 4096, 65_537)     # float32 partitions


def load_handle_class(engine: str):
    if engine == "nvmeswap":
        from nvmeswap.deepspeed import AsyncIOBuilder
    else:
        import nvmeswap.deepspeed
        nvmeswap.deepspeed.uninstall()
        from deepspeed.ops.op_builder import AsyncIOBuilder
    return AsyncIOBuilder().load(verbose=False).aio_handle


def run(engine: str, folder: str, parallelism: int, block_size: int) -> tuple[int, int]:
    """Return (slices whose file or read-back differs, slices)."""
    handle = load_handle_class(engine)(block_size, 8, False, False, parallelism)
    alignment = handle.get_alignment() // 4          # in float32 elements, as DeepSpeed
    aligned = [-(-n // alignment) * alignment for n in SIZES]
    buffer = handle.new_cpu_locked_tensor(sum(aligned), torch.empty(0))
    generator = torch.Generator().manual_seed(0)
    slices, offset = [], 0
    for step in aligned:
        slices.append(buffer.narrow(0, offset, step))
        offset += step
    # As the swappers do: every slice written with one wait, the buffer cleared, every
    # slice read back with one wait, then each compared (so a read that spills into a
    # neighbouring slice shows there).
    expected, paths = [], []
    for index, piece in enumerate(slices):
        piece.copy_(torch.randn(piece.numel(), generator=generator))
        expected.append(piece.clone())
        paths.append(os.path.join(folder, f"{engine}-{index}.swp"))
        handle.async_pwrite(piece, paths[-1])
    handle.wait()
    buffer.zero_()
    for piece, path in zip(slices, paths):
        handle.async_pread(piece, path)
    handle.wait()
    bad = 0
    for index, (piece, want, path) in enumerate(zip(slices, expected, paths)):
        with open(path, "rb") as written:
            file_ok = written.read() == want.numpy().tobytes()
        read_ok = torch.equal(piece, want)
        print(f"{engine:9s} slice {index}: {piece.numel():7d} floats at page offset "
              f"{piece.data_ptr() % 4096:4d}: file {'ok' if file_ok else 'WRONG'}, "
              f"read back {'ok' if read_ok else 'WRONG'}")
        bad += not (file_ok and read_ok)
    handle.free_cpu_locked_tensor(buffer)
    if hasattr(handle, "close"):
        handle.close()
    return bad, len(slices)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("both", "deepspeed", "nvmeswap"), default="both")
    parser.add_argument("--folder", default=None, help="where the files go (default: a "
                        "temporary folder on the current filesystem)")
    parser.add_argument("--intra-op-parallelism", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=1 << 20)
    args = parser.parse_args()
    if args.engine == "both":
        codes = {}
        for engine in ("deepspeed", "nvmeswap"):
            command = [sys.executable, __file__, "--engine", engine, "--intra-op-parallelism",
                       str(args.intra_op_parallelism), "--block-size", str(args.block_size)]
            if args.folder:
                command += ["--folder", args.folder]
            codes[engine] = subprocess.run(command, check=False).returncode
            if codes[engine] < 0:
                print(f"{engine}: the process died of signal {-codes[engine]}")
        return 0 if codes["nvmeswap"] == 0 else 1
    with tempfile.TemporaryDirectory(dir=args.folder or ".") as folder:
        bad, total = run(args.engine, folder, args.intra_op_parallelism, args.block_size)
    print(f"{args.engine}: {total - bad} of {total} slices bit-exact")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
