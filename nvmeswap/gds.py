"""``nvmeswap.gds_handle``: DeepNVMe's gds_handle; aio_handle with cuFile placing CUDA tensors.

CUDA tensors go to cuFile in the worker processes (io/cufile_placement.py,
Note [device regions]); everything else takes aio_handle's road.
"""
from __future__ import annotations

import json
import os
from typing import Any

from .aio import aio_handle
from .gpu.discovery import gds_available, gds_unavailable_reason, library_paths, nvidia_fs_loaded
from .io.buffers import io_buffer
from .io.cufile_placement import CufilePlacement, warn_gds
from .io.placement import HostPlacement


class gds_handle(aio_handle):
    """DeepNVMe's gds_handle: CUDA tensors go straight between the GPU and the file.

    Parameters
    ----------
    block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism, \
o_direct, share_locked_memory_with
        As for ``aio_handle``.
    cufile_config : dict or str, optional
        cuFile's configuration (the JSON of cufile.json, as a dict, or the path of such a
        file), handed to the workers' cuFile explicitly; nothing is written to disk.
        None leaves cuFile to its defaults ($CUFILE_ENV_PATH_JSON or /etc/cufile.json).

    Notes
    -----
    CUDA tensors are read and written with cuFile, split over ``intra_op_parallelism``
    workers; ``pin_device_tensor`` registers a tensor with cuFile for the fastest
    transfers, and slices of a pinned tensor use its registration. CPU tensors take the
    aio road. Where cuFile cannot be used (not installed, no CUDA driver, hidden by
    ``NVMESWAP_GDS=0``) the handle still works, moving CUDA tensors as aio_handle does,
    after one ``GdsFallbackWarning``; it never exits the process. A file that cuFile
    refuses (a cloud VM without nvidia-fs refuses every file) takes that road too, after
    one warning naming cuFile's status and the filesystem (Note [cuFile refusing a
    file]).
    """

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128,
                 single_submit: bool = False, overlap_events: bool = False,
                 intra_op_parallelism: int = 1, *, cufile_config: dict | str | None = None,
                 **options: Any) -> None:
        self._cufile_config = _config_json(cufile_config)
        super().__init__(block_size, queue_depth, single_submit, overlap_events,
                         intra_op_parallelism, **options)

    def _make_placement(self, host: HostPlacement) -> CufilePlacement:
        config, self._cufile_config = self._cufile_config, None
        if not gds_available():
            warn_gds("unavailable", f"{gds_unavailable_reason()}; gds_handle moves CUDA "
                     "tensors through locked host memory instead, as aio_handle does")
            return CufilePlacement(host, None)
        if not nvidia_fs_loaded():
            warn_gds("compat", "the nvidia-fs kernel module is not loaded, so cuFile runs in "
                     "compat mode (POSIX I/O through its own host bounce buffers)")
        config_fd = -1
        if config is not None:
            config_fd = os.memfd_create("nvmeswap-cufile-json", os.MFD_CLOEXEC)
            os.write(config_fd, config)
        return CufilePlacement(host, library_paths(), config_fd)

    # -- cuFile buffer registration (DeepNVMe names) ---------------------------------------
    def new_pinned_device_tensor(self, num_elem: int, example_tenosr: Any = None, *,
                                 example_tensor: Any = None) -> Any:
        """A 1-D CUDA tensor of the example tensor's dtype (and device, if a CUDA one),
        registered with cuFile. The keyword is DeepNVMe's (misspelt) ``example_tenosr``;
        ``example_tensor`` is accepted too."""
        import torch

        self._scheduler.check_usable()
        example_tensor = example_tenosr if example_tenosr is not None else example_tensor
        if not isinstance(example_tensor, torch.Tensor):
            raise TypeError("new_pinned_device_tensor() needs an example tensor, got "
                            f"{type(example_tensor).__name__}")
        if not example_tensor.is_cuda and not torch.cuda.is_available():
            raise RuntimeError("new_pinned_device_tensor() makes a CUDA tensor, and torch "
                               "sees no CUDA device here; use new_cpu_locked_tensor for "
                               "host memory")

        device = example_tensor.device if example_tensor.is_cuda else \
            torch.device("cuda", torch.cuda.current_device())
        tensor = torch.empty(num_elem, dtype=example_tensor.dtype, device=device)
        self.pin_device_tensor(tensor)
        return tensor

    def free_pinned_device_tensor(self, tensor: Any) -> bool:
        """Unregister a tensor from ``new_pinned_device_tensor``; the memory goes with it."""
        return self.unpin_device_tensor(tensor)

    def pin_device_tensor(self, tensor: Any) -> bool:
        """Keep a CUDA tensor mapped in every worker, registered with cuFile there (on
        each worker's first use of it); True when its I/O goes to cuFile.

        False when cuFile is not in use here or the memory cannot be shared with the
        workers (each with one warning): its I/O still works, on the aio road. The handle
        holds the tensor until ``unpin_device_tensor``.
        """
        self._scheduler.check_usable()
        buf = io_buffer(tensor, writable=True)
        if buf.device is None:
            raise TypeError(f"pin_device_tensor takes CUDA tensors; got one on {tensor.device}")
        return self._placement.pin(buf)

    def unpin_device_tensor(self, tensor: Any) -> bool:
        """Undo ``pin_device_tensor``; False if the tensor was not pinned by this handle."""
        self._scheduler.check_usable()
        if not hasattr(tensor, "data_ptr"):
            raise TypeError(f"unpin_device_tensor takes a tensor, got {type(tensor).__name__}")
        region = self._placement.pinned.pop_starting_at(tensor.data_ptr())
        if region is None:
            return False
        self._scheduler.unshare(region)
        return True


def _config_json(config):
    """cuFile's configuration as JSON bytes (Note [cuFile configuration] in
    workers/cufile_io.py)."""
    if config is None:
        return None
    if isinstance(config, dict):
        return json.dumps(config).encode()
    if isinstance(config, (str, os.PathLike)):
        with open(config, "rb") as source:
            data = source.read()
        try:
            parsed = json.loads(data)
        except ValueError as error:
            raise ValueError(f"{os.fspath(config)}: not a cuFile JSON configuration: "
                             f"{error}") from None
        if isinstance(parsed, dict):
            return data
        raise ValueError(f"{os.fspath(config)}: not a cuFile JSON configuration: it holds "
                         f"a {type(parsed).__name__}, not an object")
    raise TypeError(f"cufile_config must be a dict or a path, got {type(config).__name__}")
