"""Reading torch.save archives: the pickle, with each storage's bytes read by nvmeswap
into locked memory, or straight into tensors the caller already has.

Note [one read per checkpoint]: the storages of a torch.save archive lie one after another,
separated only by small zip headers. ``load`` reads the whole span from the first storage
to the end of the last in one operation (the handle cuts it over its workers) into one
locked buffer, and each storage is a view of its part of that buffer (``torch.frombuffer``:
a storage of exactly that size). The headers read along are a few KiB per storage; in
exchange every request is large and aligned, whatever the archive's own alignment (64
bytes in files torch wrote, 4096 in nvmeswap's).
"""
from __future__ import annotations

import io
import pickle
import sys
from typing import Any

from ..units import ALIGNMENT
from .stripes import read_layout, read_striped
from .torch_zip import ZipEntries


def _storage_dtype(storage_type):
    import torch

    return torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype


def unpickle(entries: ZipEntries, make_storage: Any, weights_only: bool,
             map_location: Any = None) -> Any:
    """The archive's object, ``make_storage(key, dtype, nbytes, location)`` giving each
    storage (an ``UntypedStorage``) once per key, as ``torch.load`` does."""
    import torch
    from torch import serialization

    if entries.byteorder != sys.byteorder:
        raise ValueError(f"{entries.path}: written on a {entries.byteorder}-endian machine; "
                         "nvmeswap.load reads native-endian archives only (torch.load "
                         "byte-swaps them)")
    loaded: dict[str, Any] = {}

    def persistent_load(saved_id):
        typename = saved_id[0].decode() if isinstance(saved_id[0], bytes) else saved_id[0]
        if typename != "storage":
            raise pickle.UnpicklingError(f"{entries.path}: unknown persistent id {typename!r}")
        storage_type, key, location, numel = saved_id[1:]
        key = key.decode() if isinstance(key, bytes) else key
        location = location.decode() if isinstance(location, bytes) else location
        if key not in loaded:
            dtype = _storage_dtype(storage_type)
            nbytes = numel * torch._utils._element_size(dtype)
            storage = make_storage(key, dtype, nbytes, location)
            loaded[key] = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype,
                                                     _internal=True)
        return loaded[key]

    data = io.BytesIO(entries.pickle)
    if weights_only:
        from torch import _weights_only_unpickler

        unpickler = _weights_only_unpickler.Unpickler(data, encoding="utf-8")
    else:
        class _Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if isinstance(name, str) and "Storage" in name:
                    try:
                        return serialization.StorageType(name)
                    except KeyError:
                        pass
                return super().find_class({"torch.tensor": "torch._tensor"}.get(module, module),
                                          name)

        unpickler = _Unpickler(data)
    unpickler.persistent_load = persistent_load
    tls = serialization._serialization_tls
    previous, tls.map_location = tls.map_location, map_location
    try:
        try:
            result = unpickler.load()
        except pickle.UnpicklingError as error:
            if weights_only:
                raise pickle.UnpicklingError(
                    f"{entries.path}: {error}; pass weights_only=False only for a file "
                    "from a source you trust") from None
            raise
    finally:
        tls.map_location = previous
    torch._utils._validate_loaded_sparse_tensors()
    return result


def storage_span(entries: ZipEntries) -> tuple[int, int]:
    """``(start, end)``: the aligned file range that holds every storage (Note [one read
    per checkpoint]); ``(0, 0)`` when there is none."""
    ranges = [(start, start + size) for record, (start, size, _) in entries.records.items()
              if record.startswith("data/") and size]
    if not ranges:
        return 0, 0
    return min(r[0] for r in ranges) // ALIGNMENT * ALIGNMENT, max(r[1] for r in ranges)


def _read_archive(path, handle):
    """``(entries, buffer, start)``: the archive's records, and one locked buffer holding
    file bytes from offset ``start`` on that cover every storage (Note [one read per
    checkpoint]); a striped checkpoint (Note [striped checkpoints]) is read whole."""
    import torch

    layout = read_layout(path)
    if layout is not None:
        buffer = read_striped(layout, handle, path)
        try:
            return ZipEntries(path, memory=memoryview(buffer.numpy())), buffer, 0
        except BaseException:
            handle.free_cpu_locked_tensor(buffer)
            raise
    entries = ZipEntries(path)
    start, end = storage_span(entries)
    buffer = handle.new_cpu_locked_tensor(end - start, torch.empty(0, dtype=torch.uint8))
    try:
        if end > start:
            handle.sync_pread(buffer, path, start)
    except BaseException:
        handle.free_cpu_locked_tensor(buffer)
        raise
    return entries, buffer, start


def load_locked(path: str, handle: Any, map_location: Any, weights_only: bool) -> Any:
    """``nvmeswap.load``: the storages are views of one locked buffer."""
    import torch
    from torch import serialization

    entries, buffer, start = _read_archive(path, handle)
    try:
        view = memoryview(buffer.numpy())
        restore = serialization._get_restore_location(map_location)

        def make_storage(key, dtype, nbytes, location):
            record = entries.records.get(f"data/{key}")
            if record is None or record[1] != nbytes:
                raise ValueError(f"{path}: storage {key} of {nbytes} bytes is not in the "
                                 "archive" if record is None else
                                 f"{path}: storage {key} holds {record[1]} bytes, the pickle "
                                 f"says {nbytes}")
            if nbytes == 0:
                storage = torch.UntypedStorage(0)
            else:
                at = record[0] - start
                storage = torch.frombuffer(view[at:at + nbytes],
                                           dtype=torch.uint8).untyped_storage()
            return restore(storage, location)

        return unpickle(entries, make_storage, weights_only, map_location)
    except BaseException:
        handle.free_cpu_locked_tensor(buffer)
        raise


def load_into(path: str, into: Any, handle: Any, strict: bool) -> Any:
    """``nvmeswap.load_into``: each saved tensor read straight into the matching tensor of
    ``into``; every match checked before any read."""
    import torch

    layout = read_layout(path)
    if layout is not None:
        buffer = read_striped(layout, handle, path)
        view = memoryview(buffer.numpy())
        try:
            entries = ZipEntries(path, memory=view)
            for target, start in _placed(path, entries, into, strict):
                nbytes = target.numel() * target.element_size()
                source = torch.frombuffer(view[start:start + nbytes], dtype=target.dtype)
                target.copy_(source.reshape(target.shape))
        finally:
            view.release()
            handle.free_cpu_locked_tensor(buffer)
        return into
    reads = _placed(path, ZipEntries(path), into, strict)
    for target, start in reads:
        handle.async_pread(target, path, start)
    if reads:
        handle.wait()
    return into


def _placed(path, entries, into, strict):
    """``(target tensor, file offset of its saved bytes)`` for each non-empty saved tensor
    with a place in ``into``, every match checked first."""
    import torch

    keys: dict[int, str] = {}

    def make_storage(key, dtype, nbytes, location):
        storage = torch.UntypedStorage(nbytes, device="meta")
        keys[storage._cdata] = key
        return storage

    saved = unpickle(entries, make_storage, weights_only=True)
    reads = []
    for name, source, target in _pairs(saved, into, strict, path):
        if source.dtype != target.dtype or source.shape != target.shape:
            raise ValueError(f"{path}: {name} is {source.dtype} {tuple(source.shape)} in the "
                             f"file, {target.dtype} {tuple(target.shape)} in memory")
        if not target.is_contiguous():
            raise ValueError(f"load_into: the tensor for {name} is not contiguous")
        if not source.is_contiguous():
            raise ValueError(f"{path}: {name} was saved as a non-contiguous view; use "
                             "nvmeswap.load for it")
        key = keys[source.untyped_storage()._cdata]
        start = entries.records[f"data/{key}"][0] + source.storage_offset() * source.element_size()
        if source.numel():
            reads.append((target, start))
    return reads


def _pairs(saved, into, strict, path, name=""):
    """``(name, saved tensor, target tensor)`` for each tensor of ``saved`` with a place in
    ``into`` (nested dicts, lists and tuples); a missing or extra entry is an error when
    ``strict``."""
    import torch

    if isinstance(saved, torch.Tensor):
        if not isinstance(into, torch.Tensor):
            raise TypeError(f"load_into: {name or 'the object'} is a tensor in {path}, "
                            f"{type(into).__name__} in memory")
        yield name, saved, into
    elif isinstance(saved, dict):
        if not isinstance(into, dict):
            raise TypeError(f"load_into: {name or 'the object'} is a dict in {path}, "
                            f"{type(into).__name__} in memory")
        missing = [k for k in saved if k not in into]
        extra = [k for k in into if k not in saved]
        if strict and (missing or extra):
            raise KeyError(f"load_into: {path} and the target differ: in the file only "
                           f"{missing}, in the target only {extra}")
        for key, value in saved.items():
            if key in into:
                yield from _pairs(value, into[key], strict, path, f"{name}.{key}" if name
                                  else str(key))
    elif isinstance(saved, (list, tuple)):
        if not isinstance(into, (list, tuple)) or len(into) != len(saved):
            raise TypeError(f"load_into: {name or 'the object'} is a {type(saved).__name__} "
                            f"of {len(saved)} in {path}, not so in memory")
        for index, (value, target) in enumerate(zip(saved, into)):
            yield from _pairs(value, target, strict, path, f"{name}[{index}]")
