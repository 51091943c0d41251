"""Where a torch.save archive keeps each tensor's bytes, read from its pickle without
making the tensors: what ``load_into`` needs to place them.

Note [reading where tensors are]: ``load_into`` reads each saved tensor straight into a
tensor the caller has; of the pickle it needs only the structure (dicts, lists, tuples)
and each tensor's dtype, shape, strides and place in its storage. Torch's weights-only
unpickler, which makes every tensor (over meta storages here), is Python and took most
of a ``load_into`` of many small tensors (2000 tensors: some 50 us each, more than the
reads, 2026-11-27). The pickle of a state of plain tensors names a handful of globals:
the rebuild functions of tensors and Parameters, ``OrderedDict``, the storage types and
dtypes (and ``_codecs.encode``, protocol 2's way to pickle bytes). ``saved_tensors`` reads it with the C unpickler, each of those globals resolved
to an inert stand-in (a rebuild gives a ``SavedTensor``; a storage type or a dtype is
only a value) and every other global refused: a pickle naming one (a tensor subclass,
a sparse or quantized tensor, any other object) is read by torch's weights-only
unpickler as before. Nothing a file names is called but these stand-ins and
``OrderedDict`` (and latin-1 encoding), so this admits less than ``weights_only=True``
does.
"""
from __future__ import annotations

import collections
import functools
import io
import pickle
from typing import Any


class SavedTensor:
    """A tensor of a pickle: its storage's key, dtype, storage offset (in elements), shape
    and strides."""

    __slots__ = ("dtype", "key", "offset", "shape", "stride")

    def __init__(self, key: str, dtype: Any, offset: int, shape: tuple, stride: tuple) -> None:
        self.key, self.dtype, self.offset = key, dtype, offset
        self.shape, self.stride = tuple(shape), tuple(stride)
        numbers = (offset, *self.shape, *self.stride)
        if len(self.shape) != len(self.stride) or not all(
                type(number) is int and number >= 0 for number in numbers):
            raise pickle.UnpicklingError("a tensor of odd offset, shape or strides")

    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def is_contiguous(self) -> bool:
        """As ``torch.Tensor.is_contiguous``: row-major strides but for dimensions of size
        1, or no elements."""
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1:
                if step != expected:
                    return self.numel() == 0
                expected *= size
        return True


class _SavedStorage:
    __slots__ = ("dtype", "key")

    def __init__(self, key: str, dtype: Any) -> None:
        self.key, self.dtype = key, dtype


class _StorageType:
    """A storage type a persistent id names (``torch.FloatStorage``...): its dtype only."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                       metadata=None):
    return SavedTensor(storage.key, storage.dtype, storage_offset, size, stride)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                       dtype, metadata=None):
    return SavedTensor(storage.key, dtype, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    if not isinstance(data, SavedTensor):
        raise pickle.UnpicklingError("a Parameter of something else than a tensor")
    return data


def _latin1(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as protocol 2 pickles bytes with: latin-1 only."""
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError("an encoding other than bytes' own")
    return text.encode("latin1")


@functools.cache
def _globals() -> dict[tuple[str, str], Any]:
    """The globals a plain state's pickle names, each to its stand-in."""
    import torch

    found: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("_codecs", "encode"): _latin1,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch.storage", "UntypedStorage"): _StorageType(torch.uint8),
        ("torch", "UntypedStorage"): _StorageType(torch.uint8),
    }
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        found["torch", name] = _StorageType(dtype)
    for dtype in vars(torch).values():
        if isinstance(dtype, torch.dtype):
            found["torch", str(dtype).removeprefix("torch.")] = dtype
    return found


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _globals().get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a plain state's")
        return found

    def persistent_load(self, saved_id: Any) -> _SavedStorage:
        typename, storage_type, key, _location, _numel = saved_id
        if typename not in ("storage", b"storage") or not isinstance(storage_type,
                                                                     _StorageType):
            raise pickle.UnpicklingError(f"unknown persistent id {saved_id!r}")
        return _SavedStorage(key.decode() if isinstance(key, bytes) else key,
                             storage_type.dtype)


def saved_tensors(pickled: bytes) -> Any:
    """The object of a torch.save pickle with each tensor a ``SavedTensor``, or None where
    the pickle holds more than containers, scalars and plain tensors (Note [reading
    where tensors are])."""
    try:
        return _Unpickler(io.BytesIO(pickled), encoding="utf-8").load()
    except Exception:       # anything else, or a file torch's unpickler is to judge
        return None
