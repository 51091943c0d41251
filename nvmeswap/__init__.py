"""nvmeswap: move tensors between memory and files on fast SSDs at the speed of the device.

A drop-in for DeepSpeed DeepNVMe's ``aio_handle`` and ``gds_handle``, built on kernel AIO and
cuFile in Cython and a pool of worker processes. Importing it loads neither torch nor CUDA.
"""
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
from .gds import gds_handle
from .gpu.discovery import gds_available, gds_unavailable_reason

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
