"""Reading torch.save archives: the pickle, with each storage's bytes read by nvmeswap
into locked memory, or straight into tensors the caller already has.

Note [checkpoint reads]: the storages of a checkpoint lie one after another, separated
only by small headers. ``load`` reads them in groups of consecutive storages of at least
64 MiB, each group one large aligned read (the handle cuts it over its workers) into one
locked buffer of its own, and each storage is a view of its part of that buffer
(``torch.frombuffer``: a storage of exactly that size). The buffers are allocated one
after the other while the reads run: locking fresh memory costs about as much as reading
it from the device, and this way the two overlap instead of adding up. The headers read
along are a few KiB per storage; in exchange every request is large and aligned,
whatever the file's own alignment (64 bytes in files torch wrote, 4096 in nvmeswap's).
A buffer none of whose storages is returned as it is (each moved by ``map_location``, or
to the GPU its location names) leaves the process's locked set when the load returns:
left there, every load of a CUDA checkpoint through a kept Checkpointer would hold its
size of locked memory until ``close()``. Without a handle the buffers are fresh private
memory instead (Note [fresh private reads] in fresh_reads.py), in the same groups.

Note [headers in the reads]: where a storage's bytes start is in its local zip header
(its length varies with the writer's padding), and reading those headers one by one
before the reads cost a load of 2000 small tensors 2000 small reads of a cold file: 46
of its 160 ms (2026-11-27, memory-backed device), as each went through the page cache
with its readahead. The groups read those headers anyway (they lie between the
storages), so a load reads only the central directory, the pickle and the records
before the storages first; each storage's range starts at its local header, and where
its bytes start is found in the bytes read, the header checked (its signature, and the
name the central directory gives) before any byte of the storage is used. ``load_into``
without a handle does the same through its reader's ring (``read_records``): records
whose span fits a ring slot are read with their neighbours, up to a slot a request (one
request a tensor before, 4 in flight), and each tensor copied out once its header is
checked in the slot; a larger record's header is read on its own first. A cold
``load_into`` of 2000 small tensors, whose header reads had become 0.21 to 0.25 s of its
0.29 to 0.45 s on a slower day for fresh memory (their readahead fills the page cache),
took 0.12 to 0.18 s (2026-11-27, memory-backed device). Through a given handle the
headers are still read first, one by one.
"""
from __future__ import annotations

import bisect
import contextlib
import io
import pickle
import struct
import sys
from collections.abc import Iterator
from typing import Any

from ..io.interrupts import deferred_interrupts
from ..units import ALIGNMENT
from .fresh_reads import FreshReads
from .own_queue import Registration
from .queue_reader import copy_into, reader_of
from .saved_tensors import NOT_PLAIN, SavedTensor, plain_load, saved_tensors
from .state import paused_gc
from .striped_checkpoints import (
    layout_file,
    opened,
    stripe_paths,
    striped_reader,
    unstriped,
)
from .zip_entries import ZipEntries, reads_at


def _restored(path: str, restore: Any, storage: Any, location: str) -> Any:
    """``restore(storage, location)``, torch's refusal of a location naming the file."""
    import torch

    try:
        return restore(storage, location)
    except RuntimeError as error:
        if isinstance(error, torch.OutOfMemoryError):
            raise
        raise RuntimeError(f"{path}: {error}") from error


def _empty_storage():
    """An empty storage that cannot grow, as torch.load's: a tensor that runs past it (a
    damaged file) is refused, where ``set_`` would grow a resizable one and the tensor
    would show memory never read from the file."""
    import numpy
    import torch

    return torch.from_numpy(numpy.empty(0, numpy.uint8)).untyped_storage()


def _storage_dtype(storage_type):
    import torch

    return torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype


def _check_byteorder(entries: ZipEntries) -> None:
    if entries.byteorder != sys.byteorder:
        raise ValueError(f"{entries.path}: written on a {entries.byteorder}-endian machine; "
                         "nvmeswap.load reads native-endian archives only (torch.load "
                         "byte-swaps them)")


#: What an unpickler raises on bytes that are not a pickle of a state (a damaged file),
#: then named with the file. Not MemoryError or OSError: those are the machine's.
UNPICKLING_FAILURES = (pickle.UnpicklingError, EOFError, KeyError, IndexError, TypeError,
                       ValueError, AttributeError, RuntimeError, OverflowError, struct.error)


class NamedUnpicklingError(pickle.UnpicklingError):
    """An unpickling error that names its file already."""


def unpickle(entries: ZipEntries, make_storage: Any, weights_only: bool,
             map_location: Any = None) -> Any:
    """The archive's object, ``make_storage(key, dtype, nbytes, location)`` giving each
    storage (an ``UntypedStorage``) once per key, as ``torch.load`` does."""
    import torch
    from torch import serialization

    _check_byteorder(entries)
    loaded: dict[str, Any] = {}
    storage_errors: list[BaseException] = []    # raised making storages: not the pickle's

    def persistent_load(saved_id):
        try:
            return load_storage(saved_id)
        except BaseException as error:
            storage_errors.append(error)
            raise

    def load_storage(saved_id):
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise NamedUnpicklingError(f"{entries.path}: a persistent id of its pickle is "
                                       f"not a storage's ({_shown(saved_id)})")
        typename, storage_type, key, location, numel = (
            part.decode() if isinstance(part, bytes) else part for part in saved_id)
        if typename != "storage":
            raise NamedUnpicklingError(f"{entries.path}: unknown persistent id {typename!r}")
        if not (storage_type is torch.UntypedStorage
                or isinstance(getattr(storage_type, "dtype", None), torch.dtype)) \
                or not isinstance(key, str) or not isinstance(location, str) \
                or type(numel) is not int or numel < 0:
            raise NamedUnpicklingError(f"{entries.path}: a storage's persistent id of its "
                                       f"pickle is damaged ({_shown(saved_id)})")
        if key not in loaded:
            dtype = _storage_dtype(storage_type)
            nbytes = numel * torch._utils._element_size(dtype)
            storage = make_storage(key, dtype, nbytes, location)
            loaded[key] = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype,
                                                     _internal=True)
        return loaded[key]

    tls = serialization._serialization_tls
    previous, tls.map_location = tls.map_location, map_location
    try:
        # A plain state's pickle by the C unpickler (Note [reading where tensors are])
        result = plain_load(entries.pickle, persistent_load) if weights_only else NOT_PLAIN
        if result is NOT_PLAIN:
            result = _torch_s_unpickling(entries, persistent_load, weights_only)
    except UNPICKLING_FAILURES as error:
        if _among(error, storage_errors) or isinstance(
                error, (NamedUnpicklingError, torch.OutOfMemoryError, NotImplementedError)):
            raise       # named already, the storages' own, or the machine's or torch's
        raise ValueError(f"{entries.path}: its pickle (data.pkl) could not be read "
                         f"({type(error).__name__}: {error})") from error
    finally:
        tls.map_location = previous
    torch._utils._validate_loaded_sparse_tensors()
    return result


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _among(error: BaseException, errors: list[BaseException]) -> bool:
    """Whether ``error`` is one of ``errors`` or was raised while handling one."""
    seen = 0
    while error is not None and seen < 8:
        if any(error is other for other in errors):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _torch_s_unpickling(entries: ZipEntries, persistent_load: Any, weights_only: bool) -> Any:
    """The archive's object by torch's weights-only unpickler, or the C unpickler with
    torch's ``find_class`` where ``weights_only`` is off."""
    from torch import serialization

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
    try:
        return unpickler.load()
    except pickle.UnpicklingError as error:
        if weights_only:
            raise NamedUnpicklingError(
                f"{entries.path}: {error}; pass weights_only=False only for a file "
                "from a source you trust") from None
        raise


GROUP_BYTES = 64 << 20


class Pieces:
    """Locked buffers holding file ranges (Note [checkpoint reads]), in ``handle``'s
    locked set or (no handle) fresh private memory; ``view(start, n)`` is the memory of
    file bytes ``[start, start + n)``."""

    def __init__(self, handle: Any = None) -> None:
        self.handle = handle
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.views: list[memoryview] = []
        self.buffers: list[Any] = []
        self.reads: FreshReads | None = None     # reads still in flight into the buffers

    def wait(self) -> None:
        """Until the bytes of every buffer are read (Note [reads beside the pickle])."""
        if self.reads is not None:
            self.reads.wait()

    def stop(self) -> None:
        """Start no more reads: the load failed (its memory is never used)."""
        if self.reads is not None:
            self.reads.stop()

    def ready(self, start: int, nbytes: int) -> int:
        """Which buffer holds file bytes ``[start, start + nbytes)``, once they are read."""
        index = self.index(start, nbytes)
        if self.reads is not None:
            self.reads.wait_for(index, start + nbytes - self.starts[index])
        return index

    def read_at(self, start: int, nbytes: int) -> bytes:
        """File bytes ``[start, start + nbytes)``, once they are read."""
        self.ready(start, nbytes)
        return bytes(self.view(start, nbytes))

    def add(self, start: int, buffer: Any) -> None:
        self.starts.append(start)
        self.ends.append(start + buffer.numel())
        self.buffers.append(buffer)
        self.views.append(memoryview(buffer.numpy()))

    def index(self, start: int, nbytes: int) -> int:
        """Which buffer holds file bytes ``[start, start + n)``."""
        index = bisect.bisect_right(self.starts, start) - 1
        if index < 0 or start + nbytes > self.ends[index]:
            raise AssertionError(f"bytes {start}..{start + nbytes} were not read")
        return index

    def view(self, start: int, nbytes: int) -> memoryview:
        index = self.index(start, nbytes)
        at = start - self.starts[index]
        return self.views[index][at:at + nbytes]

    def free(self, keep: set[int] = frozenset()) -> None:
        """Take the buffers, but those whose index is in ``keep``, out of the handle's
        locked set; fresh memory needs nothing: it goes with the last view of it."""
        if self.handle is None:
            return
        failures = []
        for index, buffer in enumerate(self.buffers):
            if index not in keep:
                try:
                    self.handle.free_cpu_locked_tensor(buffer)
                except Exception as failure:    # the others are freed all the same
                    failures.append(failure)
        if failures:
            raise failures[0]


def _groups(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The file ranges ``[(start, end)]`` (non-overlapping) gathered into groups of at
    least ``GROUP_BYTES``, each starting aligned (Note [checkpoint reads])."""
    groups: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if groups and groups[-1][1] - groups[-1][0] < GROUP_BYTES:
            groups[-1][1] = max(groups[-1][1], end)
        else:
            groups.append([start // ALIGNMENT * ALIGNMENT, end])
    return [(start, end) for start, end in groups]


def read_data(source: int | str, layout: dict | None, handle: Any,
              ranges: list[tuple[int, int]], *, in_flight: bool = False) -> Pieces:
    """The file ranges ``[(start, end)]`` of a checkpoint (``opened``'s ``source``: a
    descriptor of the file; striped if it has a ``layout``, Note [striped checkpoints]:
    then through every device at once), in ``handle``'s locked buffers, or without a
    handle in fresh private memory; there with ``in_flight``, still being read when it
    returns (``pieces.wait()`` before their bytes are used)."""
    if handle is None:
        pieces = Pieces()
        groups = _groups(ranges)
        paths = [source] if layout is None else stripe_paths(layout)
        stripe_bytes = None if layout is None else layout["stripe_bytes"]
        pieces.reads = FreshReads(paths, stripe_bytes, groups)
        for (start, _), buffer in zip(groups, pieces.reads.buffers):
            pieces.add(start, buffer)
        if not in_flight:
            pieces.wait()
        return pieces
    if layout is None:
        pieces = read_ranges(unstriped(handle), source, ranges)
    else:
        with striped_reader(layout, handle) as reader:
            pieces = read_ranges(reader, layout_file(layout), ranges)
    pieces.handle = handle      # the reader may be closed now; the locked set is the process's
    return pieces


def read_ranges(handle: Any, path: int | str, ranges: list[tuple[int, int]]) -> Pieces:
    """Read the file ranges ``[(start, end)]`` (non-overlapping) into locked buffers, in
    groups of at least ``GROUP_BYTES``, allocating each while the one before is read."""
    import torch

    pieces = Pieces(handle)
    futures = []
    try:
        for start, end in _groups(ranges):
            # Held back from a Ctrl-C: each buffer and read in the books once made.
            with deferred_interrupts():
                buffer = handle.new_cpu_locked_tensor(end - start,
                                                      torch.empty(0, dtype=torch.uint8))
                pieces.add(start, buffer)
                futures.append(handle.submit_pread(buffer, path, start))
        while futures:
            futures[0].result()
            futures.pop(0)
    except BaseException:
        for future in futures:
            with contextlib.suppress(BaseException):
                future.result()
        with contextlib.suppress(Exception):    # the first failure is the one to raise
            pieces.free()
        raise
    return pieces


def _read_archive(path, handle, in_flight=False):
    """``(entries, pieces)``: the archive's records and the bytes of every storage with
    its local header (Note [checkpoint reads], Note [headers in the reads]), through
    ``handle`` or (None) into fresh memory, all from the one file (Note [one file per
    load]); ``in_flight`` as for ``read_data``."""
    with opened(path) as (layout, file, source):
        entries = ZipEntries(path, file=file, storage_headers=False)
        spans = [span for record, span in entries.spans.items() if record.startswith("data/")]
        return entries, read_data(source, layout, handle, spans, in_flight=in_flight)


@paused_gc()        # Note [laying out many tensors]: a load makes as many objects
def load_locked(path: str, handle: Any, map_location: Any, weights_only: bool) -> Any:
    """``nvmeswap.load``: the storages are views of locked buffers, ``handle``'s or (no
    handle) fresh private ones; those of storages bound for a GPU registered with CUDA
    for the copies (Note [own queue and CUDA])."""
    import torch
    from torch import serialization

    # Note [reads beside the pickle]: without a handle the reads run on a thread of their
    # own while the pickle is read (torch's unpickler, in Python: for a model's state of
    # 758 tensors about as long as the reads, which also pay the page faults of their
    # fresh memory); each storage is handed to the unpickler once its bytes are there,
    # so no code the pickle runs can see a byte not yet read. A model's 758 tensors
    # (174 MiB, cold, memory-backed device, one process): 0.29 -> 0.20 s.
    entries, pieces = _read_archive(path, handle, in_flight=handle is None)
    registered: dict[int, Registration] = {}    # by buffer index
    gpus: set[Any] = set()
    try:
        restore = serialization._get_restore_location(map_location)

        def make_storage(key, dtype, nbytes, location):
            record = entries.records.get(f"data/{key}")
            if record is None or record[1] != nbytes:
                raise ValueError(f"{path}: storage {key} of {nbytes} bytes is not in the "
                                 "archive" if record is None else
                                 f"{path}: storage {key} holds {record[1]} bytes, the pickle "
                                 f"says {nbytes}")
            if nbytes == 0:
                return _restored(path, restore, _empty_storage(), location)
            start = entries.storage_start(f"data/{key}", pieces.read_at)
            index = pieces.ready(start, nbytes)
            if handle is None and index not in registered and \
                    _bound_for_gpu(location, map_location):
                if torch.cuda.is_available():
                    torch.cuda.init()   # as restore would: now, so the buffer is registered
                pieces.ready(pieces.starts[index], pieces.buffers[index].numel())
                registered[index] = Registration(pieces.buffers[index])
            storage = torch.frombuffer(pieces.view(start, nbytes),
                                       dtype=torch.uint8).untyped_storage()
            restored = _restored(path, restore, storage, location)
            if _same_memory(restored, storage):
                returned.add(index)
            elif getattr(restored, "is_cuda", False):
                gpus.add(restored.device)
            return restored

        returned: set[int] = set()
        loaded = unpickle(entries, make_storage, weights_only, map_location)
        pieces.wait()
    except BaseException:
        pieces.stop()
        try:
            pieces.wait()
        except BaseException:   # the load's own error is the one to raise
            pass
        try:
            _copies_done(gpus, registered)
        except BaseException:   # the load's own error is the one to raise
            pass
        finally:
            pieces.free()
        raise
    _copies_done(gpus, registered)
    if len(returned) < len(pieces.buffers):
        pieces.free(keep=returned)
    return loaded


def _bound_for_gpu(location: str, map_location: Any) -> bool:
    """Whether a storage saved at ``location`` goes to a GPU under ``map_location``: known
    for None, a device (or its name) and a dict of names; not for a function (False)."""
    if isinstance(map_location, dict):
        location = map_location.get(location, location)
    elif callable(map_location):
        return False
    elif map_location is not None:
        location = map_location
    return str(location).startswith("cuda")


def _copies_done(gpus: set[Any], registered: dict[int, Registration]) -> None:
    """Wait for the copies ``map_location`` queued out of the buffers to ``gpus``, then
    unregister the buffers registered for them."""
    import torch

    try:
        for device in gpus:
            torch.cuda.synchronize(device)
    finally:
        for registration in registered.values():
            registration.release()


def _same_memory(restored: Any, storage: Any) -> bool:
    """Whether ``map_location`` returned ``storage``'s own memory, not a copy of it."""
    try:
        return (restored.device == storage.device
                and restored.data_ptr() == storage.data_ptr())
    except (AttributeError, RuntimeError):
        return True         # something else: keep the buffer, as before


@paused_gc()
def load_into(path: str, into: Any, handle: Any, strict: bool) -> Any:
    """``nvmeswap.load_into``: each saved tensor read straight into the matching tensor of
    ``into`` (through ``handle``, or without one the process's own queue); every match
    checked before any read."""
    with opened(path) as (layout, file, source):
        entries = ZipEntries(path, file=file, storage_headers=False)
        placed, with_bits = _placed(path, entries, into, strict)
        read_at = reads_at(file)
        with reading(source, layout, handle) as (reader, file_name):
            if handle is None:
                read_records(reader, file_name, entries, placed, read_at)
            else:
                read_each(reader, file_name, [
                    (target, entries.storage_start(record, read_at) + within)
                    for target, record, within in placed])
    _apply_bits(with_bits)
    return into


def _apply_bits(with_bits: list[tuple[Any, bool, bool]]) -> None:
    """Each ``(target, conj, neg)``: a target that holds the bytes of a tensor saved with
    a conjugate or negative bit, given its values (the bytes' conjugate, negation)."""
    import torch

    with torch.no_grad():
        for target, conj, neg in with_bits:
            if conj:
                target.conj_physical_()
            if neg:
                target.neg_()


def read_records(reader: Any, path: int | str, entries: ZipEntries,
                 placed: list[tuple[Any, str, int]], read_at: Any) -> None:
    """Each ``(tensor, record, byte offset in it)`` of ``placed`` read from ``path``
    through ``reader`` (a ``QueueReader``). Note [headers in the reads]: a record whose
    span (its local header to the next record's) fits in one of the reader's ranges is
    read whole, header and all, with its neighbours, and its header checked in the bytes
    read; a larger one's header is read first, on its own."""
    wanted: dict[str, list[tuple[Any, int]]] = {}
    for target, record, within in placed:
        wanted.setdefault(record, []).append((target, within))
    whole, apart = [], []
    for record in sorted(wanted, key=lambda record: entries.spans[record][0]):
        span_start, span_end = entries.spans[record]
        (whole if span_end - span_start <= reader.range_bytes else apart).append(record)
    for record in apart:
        start = entries.storage_start(record, read_at)
        for target, within in wanted[record]:
            reader.async_pread(target, path, start + within)

    def land(index: int, view: Any) -> None:
        record = whole[index]
        span_start = entries.spans[record][0]
        start = entries.storage_start(
            record, lambda offset, nbytes: view[offset - span_start:
                                                offset - span_start + nbytes].numpy().tobytes())
        for target, within in wanted[record]:
            at = start - span_start + within
            copy_into(target, view[at:at + target.numel() * target.element_size()])

    reader.read_ranges(path, [entries.spans[record] for record in whole], land)
    reader.wait()


@contextlib.contextmanager
def reading(source: int | str, layout: dict | None,
            handle: Any) -> Iterator[tuple[Any, int | str]]:
    """``(reader, file)``: what reads the bytes of a checkpoint (``opened``'s ``source``,
    with its ``layout`` if striped, Note [striped checkpoints]) by file offset, and the
    file to name to it: ``handle``'s, or without a handle a ``QueueReader`` of the
    process's own queue (``reader_of``)."""
    with reader_of(handle) as reader:
        if layout is None:
            yield unstriped(reader), source
        elif handle is None:
            reader.stripe(layout_file(layout), stripe_paths(layout), layout["stripe_bytes"])
            yield reader, layout_file(layout)
        else:
            with striped_reader(layout, handle) as striped:
                yield striped, layout_file(layout)


def read_each(handle: Any, path: int | str, reads: list[tuple[Any, int]]) -> None:
    """Each ``(tensor, file offset)`` of ``reads`` read from ``path``, all at once."""
    for target, start in reads:
        handle.async_pread(target, path, start)
    if reads:
        handle.wait()


def _placed(path, entries, into, strict):
    """``(target tensor, its storage's record, byte offset in the record)`` for each
    non-empty saved tensor with a place in ``into``, every match checked first; and
    ``(target, conj, neg)`` for those saved with a conjugate or negative bit."""
    import torch

    _check_byteorder(entries)
    saved = saved_tensors(entries.pickle)       # Note [reading where tensors are]
    keys: dict[int, str] = {}
    if saved is None:
        def make_storage(key, dtype, nbytes, location):
            storage = torch.UntypedStorage(nbytes, device="meta")
            keys[storage._cdata] = key
            return storage

        try:
            saved = unpickle(entries, make_storage, weights_only=True)
        except NotImplementedError as error:    # a kind torch cannot make over meta storages
            raise ValueError(f"{path}: holds a tensor load_into cannot place (torch: "
                             f"{str(error).splitlines()[0]}); nvmeswap.load reads it") from None
    reads, with_bits = [], []
    for name, source, target in _pairs(saved, into, strict, path):
        if not isinstance(source, SavedTensor):     # one torch's unpickler made
            if source.layout != torch.strided or source.is_quantized or source.is_nested:
                raise ValueError(f"{path}: {name} is a {source.layout} "
                                 f"{'quantized ' if source.is_quantized else ''}tensor; "
                                 "load_into reads dense ones, nvmeswap.load any")
            key = keys.get(source.untyped_storage()._cdata)
            if key is None:         # rebuilt without a storage of the archive
                raise ValueError(f"{path}: {name} was saved on the {source.device} device, "
                                 "without bytes; load_into has nothing to fill its tensor "
                                 "with")
            source = SavedTensor(key, source.dtype, source.storage_offset(), source.shape,
                                 source.stride(), source.is_conj(), source.is_neg())
        if source.dtype != target.dtype or source.shape != target.shape:
            raise ValueError(f"{path}: {name} is {source.dtype} {source.shape} in the "
                             f"file, {target.dtype} {tuple(target.shape)} in memory")
        check_target("load_into", name, target)
        if not source.is_contiguous():
            raise ValueError(f"{path}: {name} was saved as a non-contiguous view; use "
                             "nvmeswap.load for it")
        record, element = f"data/{source.key}", torch._utils._element_size(source.dtype)
        within = source.offset * element
        if record not in entries.records:
            raise ValueError(f"{path}: storage {source.key} of {name} is not in the archive")
        if within + source.numel() * element > entries.records[record][1]:
            raise ValueError(f"{path}: {name} runs past the end of its storage")
        if source.numel():
            reads.append((target, record, within))
            if source.conj or source.neg:
                with_bits.append((target, source.conj, source.neg))
    return reads, with_bits


def check_target(call: str, name: str, target: Any) -> None:
    """ValueError (from ``call``, naming the entry) unless bytes read straight into
    ``target`` are its values: contiguous, on the host or a GPU, no conjugate or
    negative bit."""
    if not target.is_contiguous():
        raise ValueError(f"{call}: the tensor for {name} is not contiguous")
    if target.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{call}: the tensor for {name} is on {target.device}; host and "
                         "CUDA tensors are filled")
    if target.is_conj() or target.is_neg():
        raise ValueError(f"{call}: the tensor for {name} is a conjugate or negative view "
                         "(its bytes are not its values); pass one without the bit")


def _pairs(saved, into, strict, path, name=""):
    """``(name, saved tensor, target tensor)`` for each tensor of ``saved`` with a place in
    ``into`` (nested dicts, lists and tuples); a missing or extra entry is an error when
    ``strict``."""
    import torch

    if isinstance(saved, (torch.Tensor, SavedTensor)):
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
            raise KeyError(f"load_into: {path} and the target differ"
                           f"{f' in {name}' if name else ''}: in the file only {missing}, "
                           f"in the target only {extra}")
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
    elif isinstance(into, (torch.Tensor, dict, list, tuple)):
        # Not loading it would leave the target as it was, unnoticed.
        raise TypeError(f"load_into: {name or 'the object'} is a {type(saved).__name__} in "
                        f"{path}, a {type(into).__name__} in memory")
