"""Finding cuFile and the CUDA driver at run time (never at build): is GPUDirect Storage usable?

Where cuFile is looked for: ``$NVMESWAP_CUFILE_LIBRARY`` alone when it is set (a path
that cannot be loaded is not replaced by another); else the dynamic loader's
``libcufile.so.0``, and the ``nvidia-cufile`` wheel's ``nvidia/cufile/lib``.
``NVMESWAP_GDS=0`` or ``NVMESWAP_CUFILE_LIBRARY=none`` hides cuFile: gds_handle then moves
CUDA tensors as aio_handle does. The CUDA driver (for CUDA IPC between a handle and its
workers): ``$NVMESWAP_CUDA_LIBRARY``, then ``libcuda.so.1``.
"""
import os
import sys

from .. import _cuda, _cufile
from ..environment import switch

# Present when the nvidia-fs kernel module is loaded; without it cuFile runs in compat mode.
NVIDIA_FS = ("/proc/driver/nvidia-fs", "/sys/module/nvidia_fs")
_state = {}


def hidden_by():
    """The setting that hides cuFile, or None."""
    if switch("NVMESWAP_GDS") is False:
        return f"NVMESWAP_GDS={os.environ['NVMESWAP_GDS']}"
    if os.environ.get("NVMESWAP_CUFILE_LIBRARY", "").strip().lower() in ("none", "0", "off"):
        return f"NVMESWAP_CUFILE_LIBRARY={os.environ['NVMESWAP_CUFILE_LIBRARY']}"
    return None


def candidates():
    if os.environ.get("NVMESWAP_CUFILE_LIBRARY"):
        return [os.environ["NVMESWAP_CUFILE_LIBRARY"]]  # the one asked for, or none
    paths = ["libcufile.so.0"]
    for entry in sys.path:
        wheel_copy = os.path.join(entry, "nvidia", "cufile", "lib", "libcufile.so.0")
        if os.path.exists(wheel_copy):
            paths.append(wheel_copy)
    return paths


def driver_candidates():
    paths = [os.environ["NVMESWAP_CUDA_LIBRARY"]] if os.environ.get("NVMESWAP_CUDA_LIBRARY") \
        else []
    return paths + ["libcuda.so.1"]


def _first_loadable(library, paths, what):
    reasons = []
    for path in paths:
        ok, why = library.load(path)
        if ok:
            return path, ""
        reasons.append(why)
    return None, f"{what} could not be loaded: " + "; ".join(reasons)


def _load():
    if not _state and hidden_by() is not None:
        _state.update(available=False, reason=f"{hidden_by()} hides cuFile", cufile=None,
                      cuda=None)
    if not _state:
        cufile, reason = _first_loadable(_cufile, candidates(), "cuFile")
        cuda = None
        if cufile is not None:
            cuda, reason = _first_loadable(_cuda, driver_candidates(), "the CUDA driver")
        _state.update(available=cufile is not None and cuda is not None, reason=reason,
                      cufile=cufile, cuda=cuda)
    return _state


def gds_available():
    """True when cuFile and the CUDA driver loaded (GPUDirect Storage, or cuFile's compat mode)."""
    return _load()["available"]


def gds_unavailable_reason():
    """Why ``gds_available()`` is False ("" when it is True)."""
    return _load()["reason"]


def library_paths():
    """The paths cuFile and the CUDA driver were loaded from (for the workers to load too)."""
    state = _load()
    return state["cufile"], state["cuda"]


def nvidia_fs_loaded():
    return any(os.path.exists(path) for path in NVIDIA_FS)
