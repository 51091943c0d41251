"""Every DeepSpeed accelerator hands out nvmeswap's builders once routed (on the CUDA
accelerator ``get_op_builder`` used to answer with DeepSpeed's own, compiled ones)."""
import subprocess
import sys

import pytest
from conftest import package_env

pytest.importorskip("deepspeed")

_ASK = r"""
import sys
import nvmeswap.deepspeed as routing
if sys.argv[1] == "nvmeswap first":     # routed by the finder as the modules load
    routing.install()
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
import nvmeswap.deepspeed

def answers():
    out = []
    for kind in (CUDA_Accelerator, CPU_Accelerator):
        accelerator = object.__new__(kind)   # no device needed: the builders are looked up
        accelerator.class_dict = None
        for name in ("AsyncIOBuilder", "GDSBuilder", "PinMemoryBuilder"):
            found = accelerator.get_op_builder(name)
            made = accelerator.create_op_builder(name)
            out.append((kind.__name__, name, found is not None and found.__module__,
                        made is not None and type(made).__module__))
    return out

before = [] if routing.installed() else answers()
routing.install()
during = answers()
routing.uninstall()
after = answers()
print(all(f == m == "nvmeswap.deepspeed" for _, _, f, m in during))
print(any(f == "nvmeswap.deepspeed" or m == "nvmeswap.deepspeed" for _, _, f, m in before + after))
print([(k, n) for k, n, f, m in before if f and f.startswith("deepspeed")])
"""


@pytest.mark.parametrize("order", ["deepspeed first", "nvmeswap first"])
def test_every_accelerator_hands_out_our_builders_once_routed(order):
    result = subprocess.run([sys.executable, "-c", _ASK, order], capture_output=True, text=True,
                            timeout=300, check=False,
                            env=package_env())
    assert result.returncode == 0, result.stderr
    routed, leaked, theirs_before = result.stdout.splitlines()[-3:]
    assert routed == "True"
    assert leaked == "False"
    if order == "deepspeed first":  # before routing, CUDA's answered with DeepSpeed's own
        assert "('CUDA_Accelerator', 'AsyncIOBuilder')" in theirs_before
