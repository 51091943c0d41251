"""Is GPUDirect Storage (cuFile) usable here? cuFile is found at run time, never at build.

Where it is looked for, in order: ``$NVMESWAP_CUFILE_LIBRARY``, the dynamic loader's
``libcufile.so.0``, and the ``nvidia-cufile`` wheel's ``nvidia/cufile/lib``.
"""
import os
import sys

from . import _cufile

_state = {}


def candidates():
    paths = [os.environ["NVMESWAP_CUFILE_LIBRARY"]] if os.environ.get("NVMESWAP_CUFILE_LIBRARY") \
        else []
    paths.append("libcufile.so.0")
    for entry in sys.path:
        wheel_copy = os.path.join(entry, "nvidia", "cufile", "lib", "libcufile.so.0")
        if os.path.exists(wheel_copy):
            paths.append(wheel_copy)
    return paths


def _load():
    if not _state:
        reasons = []
        for path in candidates():
            ok, why = _cufile.load(path)
            if ok:
                _state.update(available=True, path=path, reason="")
                break
            reasons.append(why)
        else:
            _state.update(available=False, path=None,
                          reason="cuFile could not be loaded: " + "; ".join(reasons))
    return _state


def gds_available():
    """True when libcufile loaded (GPUDirect Storage, or cuFile's compat mode)."""
    return _load()["available"]


def gds_unavailable_reason():
    """Why ``gds_available()`` is False ("" when it is True)."""
    return _load()["reason"]
