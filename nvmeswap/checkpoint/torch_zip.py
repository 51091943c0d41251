"""torch.save's zip format: laying a state out as torch writes it (zip_entries.py finds
where each storage's bytes are in a file torch or nvmeswap wrote).

Note [torch.save layout]: ``torch.save`` writes a zip archive (``data.pkl``, the pickle with
each storage replaced by a persistent id ``("storage", type, key, location, numel)``, then
one uncompressed entry ``data/<key>`` per storage, each starting at a multiple of the
archive's ``.storage_alignment``). nvmeswap lets ``torch.serialization._save`` make the
records (the pickle, and which storages under which names), with an alignment of 4096,
and intercepts each storage: instead of its bytes the archive gets a hole of its size
(``write_record_metadata``, what ``torch.serialization.skip_data`` uses). The records are
placed as torch's writer places them, by nvmeswap's writer (Note [own zip writer]) or
torch's own (``torch._C.PyTorchFileWriter``) where that one cannot; the holes are
filled by nvmeswap's direct writes, and each storage's CRC-32 (zip's data descriptor after
the bytes, and the central directory) is filled in as its bytes go by. The result is the
file torch would have written with ``storage_alignment = 4096`` (but for its
serialization id, an opaque 40 digits); ``torch.load`` and ``zipfile`` read it unchanged.

Note [CUDA state layout]: left to itself, torch's writer copies each CUDA storage into
new pageable host memory before handing it over: a second, slow copy of the whole state,
in the caller's time. For a state with CUDA tensors nvmeswap runs the writer under
``torch.serialization.skip_data``, so that it hands over only each storage's name and
size, and learns the storages from the pickler instead (its ``persistent_id``, which
names each one). The holes then point at the CUDA storages themselves: a synchronous save
copies them chunk by chunk into its locked ring, an asynchronous one into its snapshot
(1 GiB on an H100: 0.69x torch.save before, 1.72x after, 2026-11-26). ``skip_data``
refuses quantized and nested tensors (and tensors without storage); a state holding one
keeps torch's copy, whether a walk of its dicts and lists finds it first or skip_data
refuses it.

Note [tensor archives]: DCP writes each tensor item as a torch.save archive of its own
(Note [DCP files]); running torch's writer for each took 0.6 ms an item, 1.15 s of a 2 s
``dcp.save`` of a model's 2000 tensors. Two host tensors that torch pickles alike (their
``__reduce_ex__`` gives the same dtype, storage size, offset, shape, strides and
requires_grad, with no hooks or metadata) have archives that differ only in the
tensor's bytes and their CRC: the first one's layout is kept as a template, and the
next ones are copies of its header runs around a new tensor run.

Note [laying out many tensors]: for a state of many small tensors the layout is most of
a save, and two of its costs are not the pickle's own. Torch's ``persistent_id`` is a
Python function the C pickler calls for every object it pickles (some 20 a tensor: its
shape, strides, rebuild function...), and it answers None for all but storages: the
layout's pickler asks it only about objects whose type may be a storage. And the tens of
thousands of objects a layout makes (pickler memo, zip pieces, runs) set off the cyclic
garbage collector, whose passes over the whole heap (torch's modules and all) took up to
0.1 s of one layout of 2000 tensors: it is paused while a layout runs (none of what the
layout makes is cyclic garbage), unless it was off already. A load makes as many (the
records, storages, tensors) and pauses it too: the first ``nvmeswap.load`` of 2000
tensors in a fresh process took 0.32 to 0.33 s with it running, 0.19 to 0.22 s paused.
So does a synchronous save for its write, whose plan holds a tuple a run: the first
``nvmeswap.save`` of those tensors took 0.21 to 0.31 s, then 0.11 s. An asynchronous
save pauses it for the caller's part (its first call blocked 0.13 to 0.15 s, then 0.04
s), not for its write: a pause on the saving thread would be one on the caller's too.
Torch's own reduction of a tensor (``Tensor.__reduce_ex__``: some 10 us, its checks for
every kind of tensor there is) is most of what remains of the pickle's time: the
layout's pickler reduces a plain tensor (dense, on the host or a GPU, no subclass,
hooks, attributes or conj/neg bits) itself, to the very tuple torch's reduction gives,
which it checks once a process against torch's own on a few probe tensors (a torch
whose reduction differs keeps its own); every other tensor is torch's to reduce.
A plain state on the host skips torch's pickler altogether: nvmeswap writes its pickle
(Note [own pickle of a plain state] in plain_pickle.py).
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import struct
import types
import zipfile
from typing import Any, ClassVar

from . import plain_pickle, zip_writer
from .crc import crc32
from .image import FileImage, TensorRun, uint8_view
from .state import paused_gc, state_tensors
from .zip_entries import directory_place

STORAGE_ALIGNMENT = 4096
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = 0x02014B50
_LOCAL = 0x04034B50


class _Recorder:
    """A write-only file for ``PyTorchFileWriter``: keeps what is written, each stretch
    between two storages as one piece (the writer writes a record's header, name and
    padding apart: a run each made a state of 2000 small tensors 10000 runs to copy),
    and each skipped region (a storage's bytes) as a hole."""

    def __init__(self) -> None:
        self.position = 0
        self.pieces: list[tuple[int, Any]] = []     # (offset, bytearray | ("hole", name, n))
        self.pending: str | None = None
        self._bytes: bytearray | None = None      # the last piece, if not a hole

    def write(self, data: Any) -> int:
        nbytes = memoryview(data).nbytes
        if nbytes:
            if self._bytes is None:
                self._bytes = bytearray(data)
                self.pieces.append((self.position, self._bytes))
            else:
                self._bytes += data
            self.position += nbytes
        return nbytes

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != os.SEEK_CUR or self.pending is None:
            raise AssertionError(f"unexpected seek({offset}, {whence}) while laying out")
        self.pieces.append((self.position, ("hole", self.pending, offset)))
        self._bytes = None
        self.position += offset
        self.pending = None
        return self.position

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass


class _Records:
    """The zip file ``torch.serialization._save`` writes to: keeps each record as
    ``(name, bytes)``, or ``(name, nbytes)`` for a storage, that storage the one the
    pickler named (in ``storages``) if named, whatever torch hands over."""

    def __init__(self) -> None:
        self.records: list[tuple[str, Any]] = []
        self.storages: dict[str, Any] = {}

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if name == ".storage_alignment":
            # The archive's own alignment, not torch's process-wide setting: a layout
            # changes nothing another thread's torch.save could see.
            data = str(STORAGE_ALIGNMENT)
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, bytes):
            self.records.append((name, data))
        else:       # a storage: the one the pickler named, if named (``_layout_pickle``)
            self.storages.setdefault(name, data)
            self.write_record_metadata(name, nbytes)

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        self.records.append((name, nbytes))


def _never_storages() -> frozenset[type]:
    """Types torch's ``persistent_id`` answers None for (they are not storages): most of
    what a state's pickle holds."""
    import collections

    import torch

    return frozenset({int, float, complex, str, bytes, bool, type(None), tuple, list, dict,
                      collections.OrderedDict, type, types.FunctionType,
                      types.BuiltinFunctionType, torch.Size, torch.dtype, torch.device,
                      torch.Tensor, torch.nn.Parameter,
                      type(torch.FloatStorage)})   # the storage classes a pickle names


def _plain_tensor_reduce(protocol: int) -> Any:
    """A function giving, for a plain tensor (a dense ``torch.Tensor`` on the host or a GPU,
    with no hooks, attributes or conj/neg bits: what a state's tensors are), what torch's
    ``Tensor.__reduce_ex__(protocol)`` gives, without its checks for every other kind
    (Note [laying out many tensors]); any other tensor it hands to torch."""
    import collections

    import torch
    from torch.storage import TypedStorage

    rebuild, rebuild_v3 = torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3
    untyped_dtypes = torch.storage._new_dtypes()    # rebuilt from an untyped storage
    strided, metadata = torch.strided, torch._C._get_tensor_metadata

    def reduce(tensor):
        if (type(tensor) is not torch.Tensor or tensor.layout is not strided
                or tensor.is_quantized or tensor.is_nested or tensor._backward_hooks
                or tensor.__dict__ or metadata(tensor)
                or tensor.device.type not in ("cpu", "cuda")):
            return tensor.__reduce_ex__(protocol)
        dtype = tensor.dtype
        # A fresh tuple and hooks dict for each tensor, as torch makes: the pickle's memo
        # would otherwise refer back to the first one.
        if dtype in untyped_dtypes:
            return (rebuild_v3, (tensor.untyped_storage(), tensor.storage_offset(),
                                 tuple(tensor.size()), tensor.stride(), tensor.requires_grad,
                                 collections.OrderedDict(), dtype))
        storage = TypedStorage(wrap_storage=tensor.untyped_storage(), dtype=dtype,
                               _internal=True)
        return (rebuild, (storage, tensor.storage_offset(), tuple(tensor.size()),
                          tensor.stride(), tensor.requires_grad, collections.OrderedDict()))

    return reduce


@functools.cache
def _tensor_reduce(protocol: int) -> Any:
    """``_plain_tensor_reduce(protocol)`` if it pickles a few probe tensors to the bytes
    torch's own reduction does (this torch's), else None."""
    import torch

    try:
        reduce = _plain_tensor_reduce(protocol)
    except AttributeError:          # a torch without one of the functions it calls
        return None
    base = torch.arange(24, dtype=torch.float32)
    probes = [base, base[3:].view(3, 7).t(), torch.ones(2, 2, requires_grad=True),
              torch.zeros((), dtype=torch.bfloat16), torch.zeros(5, dtype=torch.uint16)]

    def pickled(reduction):
        class Probe(pickle.Pickler):
            dispatch_table: ClassVar[dict] = {torch.Tensor: reduction}

            def persistent_id(self, obj):
                if isinstance(obj, (torch.TypedStorage, torch.UntypedStorage)):
                    storage = getattr(obj, "_untyped_storage", obj)
                    return (type(obj).__name__, str(getattr(obj, "dtype", None)),
                            storage.data_ptr(), storage.nbytes())
                return None

        data = io.BytesIO()
        Probe(data, protocol=protocol).dump(probes)
        return data.getvalue()

    same = pickled(reduce) == pickled(lambda tensor: tensor.__reduce_ex__(protocol))
    return reduce if same else None


def _layout_pickle(pickle_module: Any, storages: dict[str, Any] | None, protocol: int) -> Any:
    """``pickle_module`` with a Pickler whose subclasses (torch's pickler is one) ask
    torch's ``persistent_id`` only about objects that may be storages and reduce plain
    tensors themselves (Note [laying out many tensors]), and, given ``storages``, record
    as ``storages["data/<key>"]`` each storage it names (Note [CUDA state layout])."""
    import copyreg

    import torch

    never = _never_storages()
    tables = dict(copyreg.dispatch_table)
    reduce = _tensor_reduce(protocol)
    if reduce is not None:
        tables.setdefault(torch.Tensor, reduce)     # unless copyreg names one

    class Pickler(pickle_module.Pickler):
        dispatch_table = tables

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            names = cls.persistent_id

            def persistent_id(self, obj):
                if type(obj) in never:
                    return None
                saved_id = names(self, obj)
                if (storages is not None and isinstance(saved_id, tuple)
                        and saved_id[0] == "storage"):
                    storages[f"data/{saved_id[2]}"] = getattr(obj, "_untyped_storage", obj)
                return saved_id

            cls.persistent_id = persistent_id

    return types.SimpleNamespace(Pickler=Pickler)


def _copies_cuda_storages(tensors: list[Any]) -> bool:
    """Whether torch's writer would copy CUDA storages of a state's ``tensors`` that
    nvmeswap can take as they are (Note [CUDA state layout])."""
    return (any(tensor.is_cuda for tensor in tensors)
            and not any(tensor.is_quantized or tensor.is_nested or tensor.is_meta
                        for tensor in tensors))


def _record(obj, pickle_module, pickle_protocol, *, skip_data, name_storages) -> _Records:
    """The records ``torch.serialization._save`` hands its zip writer for ``obj``; the
    pickler names each storage if ``name_storages`` (a state with tensors off the host:
    torch hands a host storage over as it is)."""
    from torch import serialization

    records = _Records()
    pickle_module = _layout_pickle(pickle_module,
                                   records.storages if name_storages else None,
                                   pickle_protocol)
    skipping = serialization.skip_data() if skip_data else contextlib.nullcontext()
    with skipping:
        serialization._save(obj, records, pickle_module, pickle_protocol, False)
    return records


def _torch_writer_image(records: _Records) -> FileImage:
    """The image of what torch's own writer writes of ``records``, each storage a hole
    in it filled by the storage's run."""
    import torch

    recorder = _Recorder()
    writer = torch._C.PyTorchFileWriter(recorder, True, STORAGE_ALIGNMENT)
    for name, data in records.records:
        if isinstance(data, bytes):
            writer.write_record(name, data, len(data))
        else:
            recorder.pending = name if data else None
            writer.write_record_metadata(name, data)
    writer.write_end_of_file()

    # The pieces alternate: header bytes, a storage's hole, header bytes that begin with
    # its data descriptor, ..., and the central directory in the last piece.
    image = FileImage()
    runs: dict[str, TensorRun] = {}
    before = None       # the run before these header bytes
    for offset, piece in recorder.pieces:
        if isinstance(piece, tuple):
            _, name, nbytes = piece
            storage = records.storages[name]
            before = runs[name] = image.add_tensor(offset, uint8_view(storage, nbytes))
        else:
            segment = image.add_bytes(offset, piece)
            if before is not None:
                if segment[:4] != _DESCRIPTOR:
                    raise AssertionError(f"no data descriptor after {name}")
                before.crc_slots.append((segment, 4))
                before = None
    _find_central_crc_slots(image.runs[-1], runs)
    return image


def _rendered(image: FileImage) -> bytes:
    """The bytes of ``image``'s file, its CRCs filled in."""
    for run in image.tensor_runs():
        run.set_crc(crc32(run.source.numpy().tobytes()))
    return b"".join(run.source.numpy().tobytes() if isinstance(run, TensorRun) else run
                    for _, run in image.runs)


@functools.cache
def _own_writer_end_records() -> list[tuple[str, bytes]] | None:
    """The records torch's writer adds after those it is handed, but for the
    serialization id (``version``), if nvmeswap's writer lays a probe state out as
    torch's does, byte for byte, else None (Note [own zip writer])."""
    import torch

    storage = torch.arange(6, dtype=torch.int64)
    probe = {"weight": torch.arange(3000, dtype=torch.float32).view(30, 100),
             "half": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0),
             "views": [storage[1:3], storage[4:]], "step": 7, "name": "probe"}
    records = _record(probe, pickle, 2, skip_data=False, name_storages=False)
    theirs = _rendered(_torch_writer_image(records))
    with zipfile.ZipFile(io.BytesIO(theirs)) as archive:
        handed = {f"archive/{name}" for name, _ in records.records}
        ends = [(info.filename.partition("/")[2], archive.read(info))
                for info in archive.infolist() if info.filename not in handed]
    serialization_id = ends.pop()
    if serialization_id[0] != ".data/serialization_id":
        return None
    ours = zip_writer.archive_image(records.records, records.storages, ends,
                                    serialization_id=serialization_id[1])
    return ends if ours is not None and _rendered(ours) == theirs else None


def refuse_skip_data() -> None:
    """A save inside ``torch.serialization.skip_data()`` (this thread's) would write no
    tensor bytes: refused."""
    from torch import serialization

    if serialization._serialization_tls.skip_data:
        raise TypeError("nvmeswap.save cannot run inside torch.serialization.skip_data()")


def layout(obj: Any, pickle_module: Any = pickle, pickle_protocol: int = 2) -> FileImage:
    """The ``FileImage`` of ``torch.save(obj)`` with 4096-aligned storages (Note [torch.save
    layout])."""
    refuse_skip_data()
    with paused_gc():
        return _layout(obj, pickle_module, pickle_protocol)


def _layout(obj: Any, pickle_module: Any, pickle_protocol: int) -> FileImage:
    tensors = [tensor for _, tensor in state_tensors(obj)]
    off_host = any(tensor.device.type != "cpu" for tensor in tensors)
    recorded = None
    if not off_host and pickle_module is pickle and pickle_protocol == 2:
        recorded = _plain_records(obj)
    if _copies_cuda_storages(tensors):
        try:
            recorded = _record(obj, pickle_module, pickle_protocol, skip_data=True,
                               name_storages=True)
        except RuntimeError:
            pass    # a tensor skip_data refuses, out of the walk's sight: torch's copy, then
    return _image(recorded or _record(obj, pickle_module, pickle_protocol, skip_data=False,
                                      name_storages=off_host))


@functools.cache
def _records_besides_pickle() -> list[tuple[str, bytes]] | None:
    """The records ``torch.serialization._save`` writes between the pickle and the
    storages, if nvmeswap's pickle of a probe state is torch's, byte for byte, else None
    (Note [own pickle of a plain state], once a process)."""
    import collections

    import torch

    base = torch.arange(24, dtype=torch.float32)
    shared = ["shared", (1, 2)]
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    probe = {"model": module.state_dict(), "cpu": "storage", "storage": "cpu",
             "views": [base, base[3:].view(3, 7).t(), base[:0], base],
             "tensors": (torch.zeros((), dtype=torch.bfloat16), torch.ones(2, 1, 3, 1, 2),
                         torch.ones(2, dtype=torch.int8, requires_grad=False),
                         torch.ones(2, requires_grad=True)),
             "numbers": [0, 255, 256, 65536, -1, -(1 << 31), 1 << 31, 1 << 70, -(1 << 70),
                         0.1, float("inf"), True, False, None, "", "é\ud800"],
             "batches": [{index: index for index in range(1000)}, list(range(1001)),
                         collections.OrderedDict((index, index) for index in range(3))],
             "again": [shared, shared, (shared, shared), (), (1, 2, 3, 4)]}
    theirs = _record(probe, pickle, 2, skip_data=False, name_storages=False)
    besides = [(name, data) for name, data in theirs.records[1:]
               if not name.startswith("data/")]
    records = _plain_records(probe, besides)
    same = records is not None and records.records == theirs.records and all(
        storage._cdata == theirs.storages[name]._cdata
        for name, storage in records.storages.items())
    return besides if same else None


def _plain_records(obj: Any, besides: list[tuple[str, bytes]] | None = None) -> _Records | None:
    """The records ``torch.serialization._save`` hands its writer for a plain state,
    made by nvmeswap (Note [own pickle of a plain state]); None for any other state, or
    where nvmeswap's pickle is not this torch's."""
    if besides is None and (besides := _records_besides_pickle()) is None:
        return None
    pickled = plain_pickle.plain_pickle(obj)
    if pickled is None:
        return None
    data, storages = pickled
    records = _Records()
    records.records = [("data.pkl", data), *besides]
    for key, storage in storages.items():
        records.storages[f"data/{key}"] = storage
        records.records.append((f"data/{key}", storage.nbytes()))
    return records


def _image(records: _Records) -> FileImage:
    """The archive of ``records``: nvmeswap's writer where it writes torch's bytes, else
    torch's (Note [own zip writer])."""
    ends = _own_writer_end_records()
    image = None
    if ends is not None:
        image = zip_writer.archive_image(records.records, records.storages, ends)
    return image if image is not None else _torch_writer_image(records)


class _ArchiveTemplate:
    """The layout of one tensor's archive without the tensor: its header runs, where
    the tensor's bytes go, and the places of their CRC (Note [tensor archives])."""

    def __init__(self, image: FileImage) -> None:
        self.runs: list[tuple[int, bytes | None]] = []      # None: the tensor's bytes
        number = {}
        for offset, run in image.runs:
            if isinstance(run, TensorRun):
                self.runs.append((offset, None))
                self.nbytes, slots = run.nbytes, run.crc_slots
            else:
                number[id(run)] = len(number)
                self.runs.append((offset, bytes(run)))
        self.slots = [(number[id(segment)], index) for segment, index in slots]

    def image(self, storage: Any) -> FileImage:
        image = FileImage()
        segments = []
        for offset, data in self.runs:
            if data is None:
                run = image.add_tensor(offset, uint8_view(storage, self.nbytes))
            else:
                segments.append(image.add_bytes(offset, data))
        run.crc_slots = [(segments[number], index) for number, index in self.slots]
        return image


_templates: dict[tuple, _ArchiveTemplate] = {}
_TEMPLATES = 256        # kinds of tensor remembered, at most (about 30 KiB each)


def _archive_kind(tensor: Any) -> tuple | None:
    """What torch's pickle holds of a host tensor besides its bytes, by its own
    ``__reduce_ex__``: None for a tensor whose archive may hold more."""
    import torch

    if tensor.device.type != "cpu":
        return None
    reduce = _tensor_reduce(2)
    reduced = reduce(tensor) if reduce is not None else tensor.__reduce_ex__(2)
    if len(reduced) != 2 or reduced[0] is not torch._utils._rebuild_tensor_v2:
        return None
    storage, *rest = reduced[1]
    if len(rest) != 5 or rest[4]:       # metadata, or backward hooks
        return None
    return (storage.dtype, storage._size(), storage._untyped_storage.nbytes(), *rest[:4])


def tensor_archive(tensor: Any) -> FileImage:
    """``layout(tensor)``, taken from a template of tensors of its kind where it can be
    (Note [tensor archives])."""
    kind = _archive_kind(tensor)
    template = _templates.get(kind) if kind is not None else None
    if template is not None:
        return template.image(tensor.untyped_storage())
    image = layout(tensor)
    if kind is not None and len(image.tensor_runs()) == 1 and len(_templates) < _TEMPLATES:
        _templates[kind] = _ArchiveTemplate(image)
    return image


_CENTRAL_ENTRY = struct.Struct("<I24xHHH")    # signature ... name, extra, comment lengths


def _find_central_crc_slots(last_piece, runs):
    """Point each storage's run at the CRC field torch left as 0 in its central directory
    entry, in the file's last piece (from the central directory to the end)."""
    base, segment = last_piece

    def read_at(offset, nbytes):
        if offset < base:
            raise AssertionError("the central directory is not in the last piece")
        return bytes(segment[offset - base:offset - base + nbytes])

    _, directory, _ = directory_place(read_at, 0, base + len(segment))
    wanted = {name.encode(): run for name, run in runs.items()}
    at = directory - base
    while at + 46 <= len(segment):
        signature, name_len, extra_len, comment_len = _CENTRAL_ENTRY.unpack_from(segment, at)
        if signature != _CENTRAL:
            break
        name = bytes(segment[at + 46:at + 46 + name_len])
        run = wanted.pop(name.partition(b"/")[2], None)     # "<archive>/data/<key>"
        if run is not None:
            run.crc_slots.append((segment, at + 16))
        at += 46 + name_len + extra_len + comment_len
    if wanted:
        raise AssertionError(f"no central directory entry for {sorted(wanted)}")
