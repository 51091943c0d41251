"""The tensors a checkpointed state holds where a walk can see them: through its dicts,
lists and tuples."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any


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
