"""Tensors in the process-wide locked set: making them, freeing them, and recognising them.

``aio_handle`` and DeepSpeed's ``pin_handle`` both serve their locked tensors from here,
each as one user (``LockedUser``) of the set (Note [process-wide locked memory] in
io/regions.py), so a tensor made by either is pinned, and zero-copy, for all.
"""
from __future__ import annotations

from typing import Any

from .environment import switch
from .gpu.copies import register_for_device_copies
from .io.limits import DEFAULT
from .io.operation import checked_int
from .io.regions import SharedRegion
from .units import PAGE, round_up


def new_locked_tensor(locked: Any, num_elem: int, example: Any, *,
                      reserve: Any = None, arena_bytes: int = DEFAULT.arena_bytes) -> tuple:
    """A 1-D locked tensor of ``num_elem`` elements of ``example``'s dtype, added to
    ``locked`` (a ``LockedUser``) so that every handle of the process finds it, and the
    region it lives in. ``reserve(nbytes)`` may refuse the size (page-rounded) before
    anything is allocated."""
    import torch

    if not isinstance(example, torch.Tensor):
        raise TypeError("new_cpu_locked_tensor() needs an example tensor for the dtype, got "
                        f"{type(example).__name__}")
    num_elem = checked_int("num_elem", num_elem, 0, None)
    itemsize = torch.empty((), dtype=example.dtype).element_size()
    if reserve is not None:
        reserve(round_up(max(num_elem * itemsize, 1), PAGE))
    region = SharedRegion(num_elem * itemsize, arena_bytes=arena_bytes)
    if registers_with_cuda_now():
        # Like DeepNVMe's (pin_memory) tensors: non_blocking copies to the GPU are DMA.
        register_for_device_copies(region)
    locked.add(region)
    tensor = torch.frombuffer(region.mapping, dtype=torch.uint8)
    return tensor[: num_elem * itemsize].view(example.dtype), region


def register_with_cuda() -> bool:
    """Whether locked tensors are registered with CUDA (where CUDA is in use already:
    never initialised for it). ``NVMESWAP_REGISTER_LOCKED=0``, or DeepSpeed's
    ``DS_PIN_MEMORY_REGISTER_DEVICE=0``, turns it off: registration costs milliseconds
    per GiB at allocation, and a process that never copies to a GPU gains nothing."""
    return all(switch(name) is not False
               for name in ("NVMESWAP_REGISTER_LOCKED", "DS_PIN_MEMORY_REGISTER_DEVICE"))


def registers_with_cuda_now() -> bool:
    """Whether a locked tensor made now is registered with CUDA: CUDA is in use in this
    process and ``register_with_cuda()``."""
    import torch

    return torch.cuda.is_initialized() and register_with_cuda()


def free_locked_tensor(locked: Any, tensor: Any, *, address: int | None = None) -> bool:
    """Take the region holding ``tensor`` (or starting at ``address``) out of the set,
    unmapped from the workers of every user; False if there is none. Refused while an
    operation of any handle uses the region: it would find its memory gone."""
    if address is None:
        # One byte at least: a region that ends where the tensor starts is a neighbour.
        region = locked.containing(_data_ptr(tensor), 1)
    else:
        region = locked.containing(address, 0)
        region = region if region is not None and region.address == address else None
    if region is None:
        return False
    locked.memory.check_unused(region)
    if locked.pop_starting_at(region.address) is not region:
        return False        # freed meanwhile by another thread
    locked.memory.free(region)
    return True


def is_locked(locked: Any, buffer: Any) -> bool:
    """Whether ``buffer`` lies in the process's locked set, or torch pinned it."""
    address = _data_ptr(buffer)
    nbytes = buffer.numel() * buffer.element_size() if hasattr(buffer, "numel") else 0
    if locked.containing(address, nbytes) is not None:
        return True
    is_pinned = getattr(buffer, "is_pinned", None)
    try:
        return bool(is_pinned()) if callable(is_pinned) else False
    except RuntimeError:      # a torch without any accelerator may refuse the question
        return False


def _data_ptr(tensor):
    data_ptr = getattr(tensor, "data_ptr", None)
    if not callable(data_ptr):
        raise TypeError(f"expected a tensor, got {type(tensor).__name__}")
    return data_ptr()
