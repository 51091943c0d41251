"""The pickle ``torch.save`` writes of a plain state, written by nvmeswap itself.

Note [own pickle of a plain state]: for a state of many small tensors the pickle is
most of a layout, and most of the pickle is not the pickler's: torch's ``persistent_id``,
a Python function the C pickler calls for each of the some 20 objects a tensor pickles
to, and each tensor's reduction to its rebuild call (2000 tensors: 40 to 45 ms of a 74
ms layout, 2026-11-28). A plain state (dicts, ``OrderedDict``s with their attributes,
lists, tuples, strings, ints, floats, bools, None, and dense host tensors of a typed
storage's dtype with nothing of their own) pickles to a short, fixed sequence of
opcodes a tensor, which this module writes as the C pickler would (protocol 2): the
same memo, by object identity, the same batches of items, the same persistent ids
(torch's: ``("storage", torch.FloatStorage, "<key>", "cpu", <numel>)``, keys numbered
as storages are first met). Anything else in the state (any other type, a tuple
holding itself, a storage seen under two dtypes, which ``torch.save`` refuses) leaves
the state to torch's pickler. ``torch_zip`` checks this writer against torch's own
once a process, on a probe state, and keeps torch's where the two differ (Note
[laying out many tensors]).
"""
from __future__ import annotations

import collections
import copyreg
import struct
import sys
from itertools import islice
from pickle import encode_long
from typing import Any

_BATCH = 1000               # the C pickler's items per SETITEMS or APPENDS
_LENGTH = struct.Struct("<I")
_SIGNED = struct.Struct("<i")
_DOUBLE = struct.Struct(">d")
_SHORT_TUPLES = (b"\x85", b"\x86", b"\x87")     # TUPLE1, TUPLE2, TUPLE3
_PUTS = [b"q" + bytes((index,)) for index in range(256)]        # BINPUT
_GETS = [b"h" + bytes((index,)) for index in range(256)]        # BINGET
_SMALL_INTS = [b"K" + bytes((value,)) for value in range(256)]  # BININT1
# torch's persistent id names its strings by literals, which the interpreter interns: the
# pickler's memo meets the same objects wherever else the state holds them.
_STORAGE = sys.intern("storage")
_CPU = sys.intern("cpu")


class NotPlain(Exception):
    """The state holds something this writer leaves to torch's pickler."""


def _storage_types() -> dict[Any, Any]:
    """Each dtype a ``TypedStorage`` pickles under, to that storage class."""
    import torch

    untyped = torch.storage._new_dtypes()       # rebuilt another way: torch's to pickle
    return {dtype: getattr(torch, name)
            for dtype, name in torch.storage._dtype_to_storage_type_map().items()
            if dtype not in untyped}


class Pickler:
    """Writes the pickle of one state (``save(obj)``, then ``out``); ``torch``: the module,
    for the state's tensors (without it, a tensor is not plain)."""

    def __init__(self, torch: Any = None) -> None:
        self.out = bytearray(b"\x80\x02")       # PROTO 2
        self.memo: dict[int, int] = {}          # id of an object of the state -> index
        self.count = 0
        self.keys: dict[int, str] = {}          # a storage's StorageImpl -> its key
        self.storages: dict[str, Any] = {}      # key -> untyped storage, in key order
        self.dtypes: dict[int, Any] = {}        # data pointer -> dtype, as torch checks
        self.open_tuples: set[int] = set()
        self.tensor_type = None                 # no object's type
        if torch is not None:
            self.storage_types = _storage_types()
            self.rebuild = torch._utils._rebuild_tensor_v2
            self.tensor_type, self.strided = torch.Tensor, torch.strided
            self.metadata = torch._C._get_tensor_metadata
            self.names = getattr(torch.Tensor, "has_names", None)     # named tensors, if any

    # -- the memo --------------------------------------------------------------------------
    def put_code(self) -> bytes:
        """A memo entry for what was just written (an object met only once)."""
        index = self.count
        self.count += 1
        return _PUTS[index] if index < 256 else b"r" + _LENGTH.pack(index)

    def memoize(self, obj: Any) -> None:
        self.memo[id(obj)] = self.count
        self.out += self.put_code()

    def get(self, index: int) -> None:
        self.out += _GETS[index] if index < 256 else b"j" + _LENGTH.pack(index)

    # -- objects ---------------------------------------------------------------------------
    def save(self, obj: Any) -> None:
        kind = type(obj)
        if obj is None:
            self.out += b"N"
        elif kind is bool:
            self.out += b"\x88" if obj else b"\x89"
        elif kind is int:
            self.integer(obj)
        elif kind is float:
            self.out += b"G" + _DOUBLE.pack(obj)
        elif (index := self.memo.get(id(obj))) is not None:
            self.get(index)
        elif kind is str:
            self.out += self.string_code(obj)
        elif kind is self.tensor_type:
            self.tensor(obj)
        elif kind is dict:
            self.out += b"}"
            self.memoize(obj)
            if obj:
                self.dict_items(obj)
        elif kind is list:
            self.out += b"]"
            self.memoize(obj)
            if obj:
                self.list_items(obj)
        elif kind is tuple:
            self.tuple(obj)
        elif kind is collections.OrderedDict:
            self.ordered_dict(obj)
        else:
            raise NotPlain

    def integer(self, value: int) -> None:
        self.out += _integer_code(value)

    def string_code(self, text: str) -> bytes:
        index = self.memo.get(id(text))
        if index is not None:
            return _GETS[index] if index < 256 else b"j" + _LENGTH.pack(index)
        encoded = text.encode("utf-8", "surrogatepass")
        self.memo[id(text)] = self.count
        return b"X" + _LENGTH.pack(len(encoded)) + encoded + self.put_code()

    def tuple(self, items: tuple) -> None:
        if not items:
            self.out += b")"                    # EMPTY_TUPLE, never memoized
            return
        if id(items) in self.open_tuples:
            raise NotPlain                      # a tuple holding itself
        self.open_tuples.add(id(items))
        if len(items) > 3:
            self.out += b"("
        for item in items:
            self.save(item)
        self.open_tuples.discard(id(items))
        self.out += _SHORT_TUPLES[len(items) - 1] if len(items) <= 3 else b"t"
        self.memoize(items)

    def dict_items(self, items: dict) -> None:
        """An exact dict's items: one SETITEM for one item, else batches of MARK ...
        SETITEMS, a last empty one after a full batch (the C pickler's way)."""
        if len(items) == 1:
            for key, value in items.items():
                self.save(key)
                self.save(value)
            self.out += b"s"
            return
        pairs = iter(items.items())
        while True:
            self.out += b"("
            written = 0
            for key, value in islice(pairs, _BATCH):
                self.save(key)
                self.save(value)
                written += 1
            self.out += b"u"
            if written < _BATCH:
                return

    def list_items(self, items: list) -> None:
        if len(items) == 1:
            self.save(items[0])
            self.out += b"a"
            return
        for start in range(0, len(items), _BATCH):
            self.out += b"("
            for item in items[start:start + _BATCH]:
                self.save(item)
            self.out += b"e"

    def iterated_items(self, pairs: Any) -> None:
        """Items of a reduction's iterator: SETITEM for a batch of one."""
        while True:
            batch = list(islice(pairs, _BATCH))
            if len(batch) > 1:
                self.out += b"("
            for key, value in batch:
                self.save(key)
                self.save(value)
            if batch:
                self.out += b"u" if len(batch) > 1 else b"s"
            if len(batch) < _BATCH:
                return

    def ordered_dict(self, items: collections.OrderedDict) -> None:
        """``OrderedDict.__reduce__``: the class called with no arguments, the items, then
        the instance's attributes (a model's ``_metadata``) built in."""
        self.global_name(collections.OrderedDict)
        self.out += b")R"
        self.memoize(items)
        self.iterated_items(iter(items.items()))
        if items.__dict__:
            self.save(items.__dict__)
            self.out += b"b"

    def global_name(self, obj: Any) -> None:
        self.out += self.global_code(obj)

    def global_code(self, obj: Any) -> bytes:
        index = self.memo.get(id(obj))
        if index is not None:
            return _GETS[index] if index < 256 else b"j" + _LENGTH.pack(index)
        self.memo[id(obj)] = self.count
        return (b"c%s\n%s\n" % (obj.__module__.encode(), obj.__qualname__.encode())
                + self.put_code())

    def tensor(self, tensor: Any) -> None:
        """``_rebuild_tensor_v2(<persistent id>, offset, size, stride, requires_grad,
        OrderedDict())``, as torch reduces a plain tensor; each part's code made in the
        order it is written, the memo's entries numbered so."""
        storage_type = self.storage_types.get(tensor.dtype)
        if (storage_type is None or tensor.layout is not self.strided or not tensor.is_cpu
                or tensor.is_quantized or tensor.is_nested or tensor.is_conj()
                or tensor.is_neg() or tensor._backward_hooks or tensor.__dict__
                or self.metadata(tensor) or (self.names and self.names(tensor))):
            raise NotPlain
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer and self.dtypes.setdefault(pointer, tensor.dtype) != tensor.dtype:
            raise NotPlain      # torch.save refuses it, with its own error
        key = self.keys.get(storage._cdata)
        if key is None:
            key = self.keys[storage._cdata] = str(len(self.keys))
            self.storages[key] = storage
        parts = (self.global_code(self.rebuild), b"((", self.string_code(_STORAGE),
                 self.global_code(storage_type), self.string_code(key),
                 self.string_code(_CPU), _integer_code(storage.nbytes() // tensor.element_size()),
                 b"t", self.put_code(), b"Q",            # the persistent id, BINPERSID
                 _integer_code(tensor.storage_offset()), self.ints_code(tuple(tensor.size())),
                 self.ints_code(tensor.stride()), b"\x88" if tensor.requires_grad else b"\x89",
                 self.global_code(collections.OrderedDict), b")R", self.put_code(),
                 b"t", self.put_code(), b"R")
        self.out += b"".join(parts)
        self.memoize(tensor)

    def ints_code(self, items: tuple) -> bytes:
        """A tuple made for this one tensor (its size or strides): never met again."""
        if not items:
            return b")"
        body = b"".join([_integer_code(item) for item in items])
        if len(items) <= 3:
            return body + _SHORT_TUPLES[len(items) - 1] + self.put_code()
        return b"(" + body + b"t" + self.put_code()


def _integer_code(value: int) -> bytes:
    if 0 <= value <= 0xFF:
        return _SMALL_INTS[value]
    if 0 <= value <= 0xFFFF:
        return b"M" + value.to_bytes(2, "little")
    if -0x80000000 <= value <= 0x7FFFFFFF:
        return b"J" + _SIGNED.pack(value)
    encoded = encode_long(value)
    if len(encoded) < 256:
        return b"\x8a" + len(encoded).to_bytes(1, "little") + encoded
    return b"\x8b" + _SIGNED.pack(len(encoded)) + encoded


def plain_pickle(obj: Any) -> tuple[bytes, dict[str, Any]] | None:
    """The bytes of torch.save's pickle of ``obj`` (``data.pkl``) and its storages by key
    (untyped, in the order their records follow), or None where ``obj`` is not a
    plain state (Note [own pickle of a plain state])."""
    import torch

    # A program may change how these pickle through copyreg (the C pickler writes exact
    # dicts, lists, tuples and strings its own way): then torch's pickler is to.
    if any(kind in copyreg.dispatch_table for kind in (collections.OrderedDict, torch.Tensor)):
        return None
    pickler = Pickler(torch)
    try:
        pickler.save(obj)
    except (NotPlain, RecursionError):
        return None
    pickler.out += b"."                         # STOP
    return bytes(pickler.out), pickler.storages
