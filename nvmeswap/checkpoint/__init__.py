"""Checkpoints at the speed of the device: ``torch.save`` archives and safetensors files
written and read through nvmeswap (O_DIRECT, locked memory, the worker pool),
crash-consistently, optionally in the background, and striped over several devices.

Without a handle, ``save``/``load``/``load_into`` and their safetensors forms go through
the process's own kernel queue (Note [saves without a handle], Note [fresh private
reads]) and ``async_save`` through a short-lived ``Checkpointer``; keep one (or pass a
handle) to reuse its handle and locked buffers across checkpoints.
"""
from __future__ import annotations

import os
from typing import Any

from . import loading
from . import safetensors as safetensors_format
from .checkpointer import Checkpointer, checked_path
from .snapshot import SaveFuture
from .stripes import StripedHandle

__all__ = ["Checkpointer", "SaveFuture", "StripedHandle", "async_save", "load", "load_into",
           "load_safetensors", "load_safetensors_into", "save", "save_safetensors"]


def save(obj: Any, path: str | os.PathLike, *, handle: Any = None) -> None:
    """Save ``obj`` (nested dicts, lists and tuples of tensors of any dtype and Python
    values) to ``path`` as ``torch.save`` would; ``torch.load`` reads the file unchanged.

    Tensor bytes go with O_DIRECT from a small ring of locked buffers through ``handle``
    or, without one, this process's own kernel queue (Note [saves without a handle];
    where CUDA is in use the ring is registered with it, Note [own queue and CUDA]). The
    file is written under a temporary name, made durable, then renamed over ``path``
    (Note [crash-consistent checkpoints]): a save killed at any instant leaves the
    previous file at ``path``. Errors name the file; a missing folder is reported before
    any I/O.
    """
    with Checkpointer(handle, chunk_bytes=None) as checkpointer:
        checkpointer.save(obj, path)


def load(path: str | os.PathLike, map_location: Any = None, *, handle: Any = None,
         weights_only: bool = True) -> Any:
    """Load a ``torch.save`` archive (written by nvmeswap or by torch), as ``torch.load``.

    CPU tensors land in locked memory, buffers of at least 64 MiB of consecutive
    storages, each read in large operations (Note [checkpoint reads]). Without a
    ``handle`` they are fresh private memory, read by this process's own kernel queue
    (Note [fresh private reads]; where storages go to a GPU, their buffers are registered
    with CUDA for the copies, Note [own queue and CUDA]); with one they are in the
    process's locked set, pinned and zero-copy for nvmeswap handles, until
    ``Checkpointer.free`` (or ``free_cpu_locked_tensor`` on each buffer) takes them out.
    Their memory goes with the last tensor.
    ``map_location`` is ``torch.load``'s. ``weights_only`` as in ``torch.load`` (True:
    tensors, containers and plain values only).
    """
    if handle is None:
        return loading.load_locked(checked_path(path, writing=False), None, map_location,
                                   weights_only)
    with Checkpointer(handle) as checkpointer:
        return checkpointer.load(path, map_location, weights_only=weights_only)


def load_into(path: str | os.PathLike, into: Any, *, handle: Any = None,
              strict: bool = True) -> Any:
    """Read each tensor saved at ``path`` straight into the tensor at the same place in
    ``into`` (a state dict; nested dicts, lists and tuples). Every dtype, shape and key
    is checked before any read (``strict``: the keys must match exactly). Returns
    ``into``; its non-tensor values are left alone. Without a handle the bytes go
    through this process's own kernel queue and a small private ring."""
    if handle is None:
        return loading.load_into(checked_path(path, writing=False), into, None, strict)
    with Checkpointer(handle) as checkpointer:
        return checkpointer.load_into(path, into, strict=strict)


def async_save(obj: Any, path: str | os.PathLike, *, handle: Any = None,
               background_snapshot: bool = False) -> SaveFuture:
    """Start saving ``obj`` to ``path``; returns a ``SaveFuture`` (a
    ``concurrent.futures.Future``) once the tensors are copied (``obj`` may change from
    then on), or at once with ``background_snapshot``: then ``obj`` may change once
    ``future.snapshot_taken`` is done (Note [snapshot in the background]).

    ``.result()`` returns None once the file is durable under ``path``, or raises the
    failure. Each call copies into a plain buffer of the checkpoint's size, held for the
    time of the save; ``Checkpointer.async_save`` copies into a locked one, kept and
    reused across saves (faster from the second save on).
    """
    checkpointer = Checkpointer(handle, chunk_bytes=None)
    try:
        return checkpointer.async_save(obj, path, one_off=True,
                                       background_snapshot=background_snapshot)
    except BaseException:
        checkpointer.close()
        raise


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None, *,
                     handle: Any = None) -> None:
    """Save a flat dict of tensors (str -> tensor, any safetensors dtype) as a safetensors
    file that the ``safetensors`` package reads unchanged; ``metadata`` is a dict of str.
    Written crash-consistently, as ``save``; tensors that share memory are refused, as
    the package refuses them."""
    with Checkpointer(handle, chunk_bytes=None) as checkpointer:
        checkpointer.save_safetensors(tensors, path, metadata)


def load_safetensors(path: str | os.PathLike, *, handle: Any = None) -> dict:
    """Read a safetensors file (written by nvmeswap or by the ``safetensors`` package)
    into a dict of CPU tensors in locked memory (as ``load``'s)."""
    if handle is None:
        return safetensors_format.load_locked(checked_path(path, writing=False), None)
    with Checkpointer(handle) as checkpointer:
        return checkpointer.load_safetensors(path)


def load_safetensors_into(path: str | os.PathLike, into: dict, *, handle: Any = None,
                          strict: bool = True) -> dict:
    """Read each tensor of a safetensors file (ours or the package's) straight into the
    tensor of the same name in ``into`` (a flat dict: a model's ``state_dict()``, say),
    CPU or CUDA, with no new memory. Every name (``strict``: both ways), dtype, shape and
    contiguity is checked before any read. Returns ``into``."""
    if handle is None:
        return safetensors_format.load_into(checked_path(path, writing=False), into, None,
                                            strict)
    with Checkpointer(handle) as checkpointer:
        return checkpointer.load_safetensors_into(path, into, strict=strict)
