"""What the staging ring for CUDA tensors costs when the copies themselves are free.

    python bench/studies/ring_overhead.py --folder /nvme/scratch --size 1G --rounds 5

Without a GPU, a stand-in "device" tensor (host memory, copied with memcpy where the
CUDA copier would copy over PCIe) takes a CUDA tensor's road through the handle's
staging space (Note [staging ring]): pieces copied in while others are with the workers.
It is measured against a locked tensor (zero copy) and a plain tensor (staged through
the same space) in the same rounds. It answers one question: does cutting the transfer
into staged pieces lose disk bandwidth?
It says nothing about PCIe: that needs bench/gpu_roads.py on a GPU.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers
from peers import JOBS

import nvmeswap
import nvmeswap.io.operation as operation_module
import nvmeswap.io.placement as placement_module
from nvmeswap.io.buffers import IoBuffer, io_buffer
from nvmeswap.io.staging import HostCopier
from nvmeswap.units import parse_size


class StandInDevice(peers.HandleContender):
    """A plain tensor that the handle takes for device memory, reached by memcpy only."""

    def __init__(self, size, **handle_args):
        super().__init__(nvmeswap.aio_handle(**handle_args), size, "plain")
        self.tensor.stand_in_device = True

    def close(self):
        self.handle.close()


def use_stand_in_device():
    def buffer_of(obj, *, writable):
        buf = io_buffer(obj, writable=writable)
        if getattr(obj, "stand_in_device", False):
            buf = IoBuffer(buf.owner, buf.address, buf.nbytes, torch.device("cuda", 0))
        return buf

    operation_module.io_buffer = buffer_of
    placement_module.CudaCopier = lambda buffer, stream: HostCopier(buffer.address)
    placement_module.copy_stream = lambda device, streams: None
    placement_module.register_for_device_copies = lambda region: None


def main():
    parser = peers.side_by_side_arguments(__doc__.splitlines()[0])
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    size = parse_size(arguments.size)
    use_stand_in_device()
    everyone = {
        "locked": peers.NvmeswapContender(size, "locked"),
        "plain": peers.NvmeswapContender(size, "plain"),
        "ring": StandInDevice(size),
        "locked P2": peers.NvmeswapContender(size, "locked", intra_op_parallelism=2),
        "ring P2": StandInDevice(size, intra_op_parallelism=2),
    }
    try:
        seconds = peers.run_rounds(arguments.folder, size, arguments.rounds, everyone)
    finally:
        for contender in everyone.values():
            contender.close()
    print(f"\n{size / 2**30:.2f} GiB per job, {arguments.rounds} rounds, GB/s (median)")
    print(f"{'contender':<12}" + "".join(f"{job:>14}" for job in JOBS))
    for name in everyone:
        cells = [statistics.median(size / s / 1e9 for s in seconds[name, job]) for job in JOBS]
        print(f"{name:<12}" + "".join(f"{c:>14.2f}" for c in cells))
    print("\nmedian per-round ratio of the ring to")
    for ring, baseline in (("ring", "locked"), ("ring", "plain"), ("ring P2", "locked P2")):
        ratios = [statistics.median(b / a for a, b in zip(seconds[ring, job],
                                                           seconds[baseline, job]))
                  for job in JOBS]
        print(f"{ring:<8} vs {baseline:<10}" + "".join(f"{job}: {r:5.2f}x   "
                                                       for job, r in zip(JOBS, ratios)))


if __name__ == "__main__":
    main()
