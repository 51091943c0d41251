"""The tensors a checkpointed state holds where a walk can see them: through its dicts,
lists and tuples; and the garbage collector's pause while a state's objects are made."""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection meanwhile (Note [laying out many tensors] in
    torch_zip.py: a layout, or a load, makes tens of thousands of objects, none of them
    cyclic garbage); left off if it was off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def state_tensors(obj: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for each tensor in ``obj``'s dicts, lists and tuples, each
    container walked once (a state may hold one twice, or itself)."""
    import torch

    seen = set()
    stack = [("", obj)]
    while stack:
        name, item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield name or "the tensor", item
        elif isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            if isinstance(item, dict):
                stack.extend((f"{name}.{key}" if name else str(key), value)
                             for key, value in item.items())
            else:
                stack.extend((f"{name}[{index}]", value) for index, value in enumerate(item))


def _unchanging_types() -> tuple[type, ...]:
    """Types whose values never change once made: a copy of a state shares them."""
    import torch

    return (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
            torch.Size, torch.layout)


def _plain_tensor(item: Any) -> bool:
    """Whether ``torch.save`` pickles ``item`` from its metadata alone, its bytes left
    for later: a dense host or CUDA tensor, no attributes of its own, no conjugate or
    negative bit to resolve (a nested tensor's layout is strided too: not one)."""
    import torch

    return (type(item) in (torch.Tensor, torch.nn.Parameter) and item.layout is torch.strided
            and item.device.type in ("cpu", "cuda") and not item.is_quantized
            and not item.is_nested
            and not item.is_conj() and not item.is_neg() and not item.__dict__)


def _alias(tensor: Any) -> Any:
    """A tensor of ``tensor``'s type over the same storage, with the shape, strides,
    offset and requires_grad ``tensor`` has now, whatever later becomes of them: torch
    pickles it to the same bytes."""
    import torch

    alias = tensor.detach()         # its own shape, strides and offset; the same storage
    if type(tensor) is torch.nn.Parameter:
        return torch.nn.Parameter(alias, requires_grad=tensor.requires_grad)
    return alias.requires_grad_() if tensor.requires_grad else alias


def state_copy(obj: Any, *, aliases: bool = False) -> tuple[Any, list[tuple[str, Any]]] | None:
    """A copy of ``obj``'s dicts (plain and ordered, with their attributes), lists and
    tuples, holding the same tensors (or with ``aliases`` each tensor's ``_alias``) and
    unchanging values, which pickles to the bytes ``obj`` pickles to now (each
    container shared or holding itself as in ``obj``); and ``(name, tensor)`` for each
    tensor of ``obj``, as ``state_tensors``. None if ``obj`` holds anything else, a
    tensor ``_plain_tensor`` refuses (or an inference tensor, to alias), or anything
    ``torch.save`` refuses (Note [snapshot in the background] in snapshot.py): its
    errors come at the call."""
    from collections import OrderedDict

    import torch

    unchanging = _unchanging_types()
    copies: dict[int, Any] = {}
    tuples_open: set[int] = set()
    tensors: list[tuple[str, Any]] = []
    dtypes: dict[int, Any] = {}     # torch.save refuses two dtypes over one storage's memory

    class Refused(Exception):
        pass

    def key_copy(key):
        if type(key) in unchanging:
            return key
        if type(key) is tuple:
            return tuple(key_copy(part) for part in key)
        raise Refused

    def copy(name, item):
        kind = type(item)
        if kind in unchanging:
            return item
        if id(item) in copies:
            return copies[id(item)]
        if kind is dict or kind is OrderedDict:
            copied = copies[id(item)] = kind()
            for key, value in item.items():
                copied[key_copy(key)] = copy(f"{name}.{key}" if name else str(key), value)
            if kind is OrderedDict and item.__dict__:
                copied.__dict__.update(copy(f"{name}.__dict__", item.__dict__))
            return copied
        if kind is list:
            copied = copies[id(item)] = []
            copied.extend(copy(f"{name}[{index}]", value) for index, value in enumerate(item))
            return copied
        if kind is tuple:
            if id(item) in tuples_open:
                raise Refused       # a tuple holding itself through a list or dict
            tuples_open.add(id(item))
            copied = tuple(copy(f"{name}[{index}]", value) for index, value in enumerate(item))
            tuples_open.discard(id(item))
            copies[id(item)] = copied
            return copied
        if isinstance(item, torch.Tensor) and _plain_tensor(item):
            if dtypes.setdefault(item.untyped_storage().data_ptr(), item.dtype) != item.dtype:
                raise Refused
            if aliases and item.is_inference():
                raise Refused
            copied = copies[id(item)] = _alias(item) if aliases else item
            tensors.append((name or "the tensor", item))
            return copied
        raise Refused

    try:
        return copy("", obj), tensors
    except (Refused, RecursionError):
        return None

