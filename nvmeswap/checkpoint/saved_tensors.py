"""A torch.save pickle of a plain state read by the C unpickler: where each tensor's bytes
are (what ``load_into`` needs), or the state itself (``nvmeswap.load``).

Note [reading where tensors are]: torch's weights-only unpickler is Python, some 50 us a
tensor: for a state of many small tensors it was most of a load (2000 tensors: about as
long as ``torch.load``'s whole load, 2026-11-27) and of a ``load_into``, which makes
every tensor over meta storages only to learn its dtype, shape, strides and place. The
pickle of a state of plain tensors names a handful of globals: the rebuild functions of
tensors and Parameters, ``OrderedDict``, the storage types and dtypes (and
``_codecs.encode``, protocol 2's way to pickle bytes). Such a pickle is read by the C
unpickler with only those globals resolved, every other one refused: a storage type to
its dtype, and the rebuild functions, for ``load_into``, to inert stand-ins (a rebuild
gives a ``SavedTensor``), for a load to torch's own (the same tensors). A pickle naming any
other global (a tensor subclass, a sparse or quantized tensor, a device, any object)
or failing in any way is read again, from its start, by torch's weights-only unpickler,
which loads or refuses it as ``torch.load`` does. What a file can call is thus a subset
of what ``weights_only=True`` lets it call.

Note [sealed globals]: the C unpickler's BUILD sets attributes of whatever object is on
its stack (by its ``__setstate__`` if it has one, else through its ``__dict__`` and
``setattr``), where torch's weights-only unpickler builds only tensors, Parameters and
OrderedDicts. The objects a plain state's globals resolve to are kept from one load to
the next, and include torch's own rebuild functions: a file that built on one could
change every later load in the process (the dtype of a storage type, a function's
defaults). So every global resolves to an object that refuses BUILD: nvmeswap's storage
types and stand-ins, and each function behind a sealed callable (``_sealed``), all with
a ``__setstate__`` that raises; ``OrderedDict`` and the dtypes refuse it by themselves.
A pickle that builds on one is then not plain, and torch's unpickler refuses it. The C
unpickler reads some opcodes torch's refuses that call nothing (LONG4, a Python int of
more than 255 bytes): such a state loads.
"""
from __future__ import annotations

import collections
import functools
import io
import pickle
from typing import Any


class _Sealed:
    """Refuses the C unpickler's BUILD (Note [sealed globals])."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"a pickle may not change {type(self).__name__}")


def _sealed(function: Any) -> Any:
    """A callable that calls ``function`` and refuses BUILD (Note [sealed globals])."""
    kind = type(function.__name__, (_Sealed,), {"__slots__": (),
                                                 "__call__": staticmethod(function)})
    return kind()


class SavedTensor(_Sealed):
    """A tensor of a pickle: its storage's key, dtype, storage offset (in elements), shape
    and strides, and whether its values are its bytes' conjugate (``conj``) or negation
    (``neg``), as torch saves a view with those bits."""

    __slots__ = ("conj", "dtype", "key", "neg", "offset", "shape", "stride")

    def __init__(self, key: str, dtype: Any, offset: int, shape: tuple, stride: tuple,
                 conj: bool = False, neg: bool = False) -> None:
        self.key, self.dtype, self.offset = key, dtype, offset
        self.shape, self.stride = tuple(shape), tuple(stride)
        self.conj, self.neg = conj, neg
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


class _SavedStorage(_Sealed):
    __slots__ = ("dtype", "key")

    def __init__(self, key: str, dtype: Any) -> None:
        self.key, self.dtype = key, dtype


class _StorageType(_Sealed):
    """A storage type a persistent id names (``torch.FloatStorage``...): its dtype only."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype


def _bits(metadata: Any) -> dict[str, bool]:
    """The conjugate and negative bits of a tensor's saved metadata (torch's
    ``_get_tensor_metadata``: none but these)."""
    if not metadata:
        return {}
    if not isinstance(metadata, dict) or not set(metadata) <= {"conj", "neg"}:
        raise pickle.UnpicklingError("a tensor of other metadata than its bits")
    return {name: bool(value) for name, value in metadata.items()}


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                       metadata=None):
    return SavedTensor(storage.key, storage.dtype, storage_offset, size, stride,
                       **_bits(metadata))


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                       dtype, metadata=None):
    return SavedTensor(storage.key, dtype, storage_offset, size, stride, **_bits(metadata))


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
def _globals(stand_ins: bool) -> dict[tuple[str, str], Any]:
    """The globals a plain state's pickle names, each sealed (Note [sealed globals]): the
    rebuild functions to stand-ins, or (not ``stand_ins``) to torch's own."""
    import torch

    rebuilds = {"_rebuild_tensor_v2": _rebuild_tensor_v2, "_rebuild_tensor_v3": _rebuild_tensor_v3,
                "_rebuild_parameter": _rebuild_parameter,
                "_rebuild_parameter_with_state": _rebuild_parameter}
    # A load's storages are made by its persistent_load, which needs only their dtype:
    # the storage types are stand-ins either way, UntypedStorage's bytes.
    untyped = _StorageType(torch.uint8)
    found: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("_codecs", "encode"): _sealed(_latin1),
        ("torch.storage", "UntypedStorage"): untyped, ("torch", "UntypedStorage"): untyped}
    for name, stand_in in rebuilds.items():
        found["torch._utils", name] = _sealed(stand_in if stand_ins
                                              else getattr(torch._utils, name))
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        found["torch", name] = _StorageType(dtype)
    for dtype in vars(torch).values():
        if isinstance(dtype, torch.dtype):
            found["torch", str(dtype).removeprefix("torch.")] = dtype
    return found


@functools.cache
def _globals_without_fake_mode() -> dict[tuple[str, str], Any]:
    """``_globals(stand_ins=False)`` with torch's ``_rebuild_tensor_v2`` replaced by one
    that skips its look for a fake tensor mode (Note [rebuilding without a fake mode])."""
    import torch

    rebuild, set_metadata = torch._utils._rebuild_tensor_v2, torch._utils.set_tensor_metadata

    def rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
                          backward_hooks, metadata=None):
        if backward_hooks:
            return rebuild(storage, storage_offset, size, stride, requires_grad,
                           backward_hooks, metadata)
        untyped = storage._untyped_storage
        tensor = torch.empty((0,), dtype=storage.dtype, device=untyped.device).set_(
            untyped, storage_offset, size, stride)
        tensor.requires_grad = requires_grad
        if metadata:
            set_metadata(tensor, metadata)
        tensor._backward_hooks = backward_hooks
        return tensor

    return {**_globals(stand_ins=False),
            ("torch._utils", "_rebuild_tensor_v2"): _sealed(rebuild_tensor_v2)}


class _Unpickler(pickle.Unpickler):
    def __init__(self, pickled: bytes, found: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(pickled), encoding="utf-8")
        self.found = found

    def find_class(self, module: str, name: str) -> Any:
        found = self.found.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a plain state's")
        return found


def _saved_storage(saved_id: Any) -> _SavedStorage:
    typename, storage_type, key, location, numel = saved_id
    # Anything odd is torch's unpickler's to judge, and the load's to name.
    if typename not in ("storage", b"storage") or not isinstance(storage_type, _StorageType) \
            or not isinstance(key, (str, bytes)) or not isinstance(location, (str, bytes)) \
            or type(numel) is not int or numel < 0:
        raise pickle.UnpicklingError(f"unknown persistent id {saved_id!r}")
    return _SavedStorage(key.decode() if isinstance(key, bytes) else key, storage_type.dtype)


def saved_tensors(pickled: bytes) -> Any:
    """The object of a torch.save pickle with each tensor a ``SavedTensor``, or None where
    the pickle holds more than containers, scalars and plain tensors (Note [reading
    where tensors are])."""
    unpickler = _Unpickler(pickled, _globals(stand_ins=True))
    unpickler.persistent_load = _saved_storage
    try:
        return unpickler.load()
    except Exception:       # anything else, or a file torch's unpickler is to judge
        return None


NOT_PLAIN = object()


def plain_load(pickled: bytes, persistent_load: Any) -> Any:
    """The object of a torch.save pickle of a plain state, made as torch's weights-only
    unpickler makes it (``persistent_load`` giving its storages), or ``NOT_PLAIN`` where
    it holds anything else or fails: torch's unpickler is then to read (or refuse) it. An
    error of ``persistent_load`` (a storage that could not be read) is raised as it is."""
    storage_errors = []

    def load_storage(saved_id):
        try:
            return persistent_load(saved_id)
        except BaseException as error:
            storage_errors.append(error)
            raise

    import torch

    # Note [rebuilding without a fake mode]: torch's ``_rebuild_tensor_v2`` ends by looking
    # for a fake tensor mode (tracing, export) to give the tensor a fake device; the look
    # was a fifth of a load of 2000 small tensors (cProfile, 2026-11-28). No such mode can
    # start while a pickle is read, so it is looked for once a load; without one, each
    # tensor is rebuilt as torch rebuilds it, less the look.
    fake_mode = torch._guards.detect_fake_mode(None) is not None
    unpickler = _Unpickler(pickled, _globals(stand_ins=False) if fake_mode
                           else _globals_without_fake_mode())
    unpickler.persistent_load = load_storage
    try:
        return unpickler.load()
    except Exception as error:
        if any(error is failed for failed in storage_errors):
            raise           # not the pickle's fault: reading it again would fail again
        return NOT_PLAIN    # torch's unpickler gives it again, or its own error
