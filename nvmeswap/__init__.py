"""nvmeswap: move tensors between memory and files on fast SSDs at the speed of the device.

A drop-in for DeepSpeed DeepNVMe's ``aio_handle`` and ``gds_handle``, built on kernel AIO and
cuFile in Cython and a pool of worker processes. Importing it loads neither torch nor CUDA.
"""
import importlib
from typing import TYPE_CHECKING

from .errors import (
    BufferedIOWarning,
    CudaError,
    CuFileError,
    EngineFallbackWarning,
    GdsFallbackWarning,
    MemoryBudgetError,
    MemoryLockWarning,
    ShortFileError,
    ValidationError,
    WorkerDied,
)

# Note [lazy top level]: the handles and the checkpoint functions load their modules on
# first use, not at ``import nvmeswap``: the ``nvmeswap`` command (whose script imports
# the package before any code of ours runs) answers a Ctrl-C while they load, inside its
# own ``try``, and a script that needs one handle does not wait for every module.
_LAZY = {
    "aio_handle": ".aio",
    "gds_handle": ".gds",
    "gds_available": ".gpu.discovery",
    "gds_unavailable_reason": ".gpu.discovery",
    **{name: ".checkpoint" for name in (
        "Checkpointer", "async_save", "load", "load_into", "load_safetensors",
        "load_safetensors_into", "save", "save_safetensors")},
}

if TYPE_CHECKING:   # what the names are, for type checkers
    from .aio import aio_handle
    from .checkpoint import (
        Checkpointer,
        async_save,
        load,
        load_into,
        load_safetensors,
        load_safetensors_into,
        save,
        save_safetensors,
    )
    from .gds import gds_handle
    from .gpu.discovery import gds_available, gds_unavailable_reason


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nvmeswap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"
__all__ = [
    "BufferedIOWarning",
    "Checkpointer",
    "CuFileError",
    "CudaError",
    "EngineFallbackWarning",
    "GdsFallbackWarning",
    "MemoryBudgetError",
    "MemoryLockWarning",
    "ShortFileError",
    "ValidationError",
    "WorkerDied",
    "aio_handle",
    "async_save",
    "gds_available",
    "gds_handle",
    "gds_unavailable_reason",
    "load",
    "load_into",
    "load_safetensors",
    "load_safetensors_into",
    "save",
    "save_safetensors",
]
