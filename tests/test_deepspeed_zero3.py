"""A ZeRO-3 training run with parameters and optimizer state on NVMe through nvmeswap is
bit-identical to the same run offloading to CPU memory (examples/deepspeed_zero3_nvme.py,
each run in a fresh process, world size 1, on whichever accelerator DeepSpeed picks)."""
import importlib.util
import pathlib

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
torch = pytest.importorskip("torch")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "deepspeed_zero3_nvme.py"


def _example():
    spec = importlib.util.spec_from_file_location("deepspeed_zero3_nvme", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_zero3_nvme_offload_matches_cpu_offload_bit_for_bit(tmp_path):
    example = _example()
    assert example.compare(str(tmp_path)) is True
    nvme = torch.load(tmp_path / "nvme.pt")
    cpu = torch.load(tmp_path / "cpu.pt")
    # The NVMe run really swapped (the example also checks its swappers' handles are
    # nvmeswap's), and the CPU run did not.
    assert nvme["swap_files"] > 0 and cpu["swap_files"] == 0
    assert nvme["losses"].numel() == example.STEPS
    assert torch.equal(nvme["losses"], cpu["losses"])
    assert nvme["weights"].keys() == cpu["weights"].keys()
    for name, weight in cpu["weights"].items():
        assert torch.equal(nvme["weights"][name], weight), name
    assert not torch.equal(nvme["losses"][0], nvme["losses"][-1])     # it did train
