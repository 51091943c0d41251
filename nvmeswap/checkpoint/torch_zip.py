"""torch.save's zip format: laying a state out as torch writes it, and finding where each
storage's bytes are in a file torch (or nvmeswap) wrote.

Note [torch.save layout]: ``torch.save`` writes a zip archive (``data.pkl``, the pickle with
each storage replaced by a persistent id ``("storage", type, key, location, numel)``, then
one uncompressed entry ``data/<key>`` per storage, each starting at a multiple of the
archive's ``.storage_alignment``). nvmeswap lets torch's own writer lay the archive out
(``torch._C.PyTorchFileWriter`` driven by ``torch.serialization._save``) with an alignment
of 4096, and intercepts each storage: instead of its bytes the writer records a hole of
its size (``write_record_metadata``, what ``torch.serialization.skip_data`` uses). The
headers, pickle and central directory torch produced are kept as they are; the holes are
filled by nvmeswap's direct writes, and each storage's CRC-32 (zip's data descriptor after
the bytes, and the central directory) is filled in as its bytes go by. The result is the
file torch would have written with ``storage_alignment = 4096``; ``torch.load`` and
``zipfile`` read it unchanged.

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
layout makes is cyclic garbage), unless it was off already.
"""
from __future__ import annotations

import contextlib
import gc
import io
import os
import pickle
import struct
import types
import zipfile
from collections.abc import Iterator
from typing import Any

from .image import FileImage, TensorRun, uint8_view
from .state import state_tensors

STORAGE_ALIGNMENT = 4096
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = 0x02014B50
_LOCAL = 0x04034B50


class _Recorder:
    """A write-only file for ``PyTorchFileWriter``: keeps what is written, each stretch
    between two storages as one piece (the writer writes a record's header, name and
    padding apart: a run each made a state of 2000 small tensors 10000 runs to copy),
    and each skipped region (a storage's bytes) as a hole. After ``keep_apart()`` each
    write is a piece of its own, as the end of the file's are: the central directory's
    entries must begin pieces for ``_find_crc_slots`` to find them."""

    def __init__(self) -> None:
        self.position = 0
        self.pieces: list[tuple[int, Any]] = []     # (offset, bytearray | ("hole", name, n))
        self.pending: str | None = None
        self._apart = False             # every write a piece of its own

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        if data.nbytes:
            last = self.pieces[-1][1] if self.pieces and not self._apart else None
            if isinstance(last, bytearray):
                last += data
            else:
                self.pieces.append((self.position, bytearray(data)))
            self.position += data.nbytes
        return data.nbytes

    def keep_apart(self) -> None:
        self._apart = True

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != os.SEEK_CUR or self.pending is None:
            raise AssertionError(f"unexpected seek({offset}, {whence}) while laying out")
        self.pieces.append((self.position, ("hole", self.pending, offset)))
        self.position += offset
        self.pending = None
        return self.position

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass


class _LayoutZip:
    """The zip writer ``torch.serialization._save`` talks to: storages become holes, each
    storage the one the pickler named (in ``storages``), whatever torch hands over."""

    def __init__(self, writer: Any, recorder: _Recorder) -> None:
        self.writer = writer
        self.recorder = recorder
        self.storages: dict[str, Any] = {}

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if name == ".storage_alignment":
            # The writer's own alignment, not torch's process-wide setting: a layout
            # changes nothing another thread's torch.save could see.
            data = str(STORAGE_ALIGNMENT)
            nbytes = len(data)
        if isinstance(data, (bytes, str)):
            self.writer.write_record(name, data, nbytes)
        else:       # a storage: the one the pickler named, if named (``_layout_pickle``)
            self.storages.setdefault(name, data)
            self.write_record_metadata(name, nbytes)

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        self.recorder.pending = name if nbytes else None
        self.writer.write_record_metadata(name, nbytes)

    def __getattr__(self, name):
        return getattr(self.writer, name)


def _never_storages() -> frozenset[type]:
    """Types torch's ``persistent_id`` answers None for (they are not storages): most of
    what a state's pickle holds."""
    import collections

    import torch

    return frozenset({int, float, complex, str, bytes, bool, type(None), tuple, list, dict,
                      collections.OrderedDict, type, types.FunctionType,
                      types.BuiltinFunctionType, torch.Size, torch.dtype, torch.device,
                      torch.Tensor, torch.nn.Parameter})


def _layout_pickle(pickle_module: Any, storages: dict[str, Any] | None) -> Any:
    """``pickle_module`` with a Pickler whose subclasses (torch's pickler is one) ask
    torch's ``persistent_id`` only about objects that may be storages (Note [laying out
    many tensors]) and, given ``storages``, record as ``storages["data/<key>"]`` each
    storage it names (Note [CUDA state layout])."""
    never = _never_storages()

    class Pickler(pickle_module.Pickler):
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


def _record(obj, pickle_module, pickle_protocol, *, skip_data, name_storages):
    """Run torch's writer over ``obj``: what it wrote, with a hole per storage; the
    pickler names each storage if ``name_storages`` (a state with tensors off the host)."""
    import torch
    from torch import serialization

    recorder = _Recorder()
    writer = torch._C.PyTorchFileWriter(recorder, True, STORAGE_ALIGNMENT)
    zip_file = _LayoutZip(writer, recorder)
    # Torch hands a host storage over as it is: only the others need naming by the
    # pickler.
    pickle_module = _layout_pickle(pickle_module,
                                   zip_file.storages if name_storages else None)
    skipping = serialization.skip_data() if skip_data else contextlib.nullcontext()
    with skipping:
        serialization._save(obj, zip_file, pickle_module, pickle_protocol, False)
    recorder.keep_apart()       # the records and the central directory at the end
    writer.write_end_of_file()
    return recorder, zip_file


def refuse_skip_data() -> None:
    """A save inside ``torch.serialization.skip_data()`` (this thread's) would write no
    tensor bytes: refused."""
    from torch import serialization

    if serialization._serialization_tls.skip_data:
        raise TypeError("nvmeswap.save cannot run inside torch.serialization.skip_data()")


@contextlib.contextmanager
def _paused_gc() -> Iterator[None]:
    """No cyclic garbage collection meanwhile (Note [laying out many tensors]); left
    off if it was off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def layout(obj: Any, pickle_module: Any = pickle, pickle_protocol: int = 2) -> FileImage:
    """The ``FileImage`` of ``torch.save(obj)`` with 4096-aligned storages (Note [torch.save
    layout])."""
    refuse_skip_data()
    with _paused_gc():
        return _layout(obj, pickle_module, pickle_protocol)


def _layout(obj: Any, pickle_module: Any, pickle_protocol: int) -> FileImage:
    tensors = [tensor for _, tensor in state_tensors(obj)]
    off_host = any(tensor.device.type != "cpu" for tensor in tensors)
    recorded = None
    if _copies_cuda_storages(tensors):
        try:
            recorded = _record(obj, pickle_module, pickle_protocol, skip_data=True,
                               name_storages=True)
        except RuntimeError:
            pass    # a tensor skip_data refuses, out of the walk's sight: torch's copy, then
    recorder, zip_file = recorded or _record(obj, pickle_module, pickle_protocol,
                                             skip_data=False, name_storages=off_host)

    image = FileImage()
    runs: dict[str, TensorRun] = {}
    for offset, piece in recorder.pieces:
        if isinstance(piece, tuple):
            _, name, nbytes = piece
            storage = zip_file.storages[name]
            runs[name] = image.add_tensor(offset, uint8_view(storage)[:nbytes])
        else:
            image.add_bytes(offset, piece)
    _find_crc_slots(image, runs)
    image.compact()
    return image


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
                run = image.add_tensor(offset, uint8_view(storage)[:self.nbytes])
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
    reduced = tensor.__reduce_ex__(2)
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


def _find_crc_slots(image, runs):
    """Point each storage's run at the CRC fields torch left as 0: the data descriptor that
    follows its bytes and its central directory entry."""
    by_offset = {offset: run for offset, run in image.runs}
    for name, run in runs.items():
        end = run.offset + run.nbytes
        descriptor = by_offset.get(end)
        if not isinstance(descriptor, bytearray) or descriptor[:4] != _DESCRIPTOR:
            raise AssertionError(f"no data descriptor after {name}")
        run.crc_slots.append((descriptor, 4))
    # The central directory: the last runs, entries one after another.
    wanted = dict(runs)
    for _, segment in image.runs:
        if not isinstance(segment, bytearray):
            continue
        at = 0
        while at + 46 <= len(segment) and struct.unpack_from("<I", segment, at)[0] == _CENTRAL:
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", segment, at + 28)
            name = segment[at + 46:at + 46 + name_len].decode()
            record = name.split("/", 1)[1] if "/" in name else name
            if record in wanted:
                wanted.pop(record).crc_slots.append((segment, at + 16))
            at += 46 + name_len + extra_len + comment_len
    if wanted:
        raise AssertionError(f"no central directory entry for {sorted(wanted)}")


# -- reading ------------------------------------------------------------------------------
class _Slice(io.RawIOBase):
    """``length`` bytes of an open file from ``base``, as a file of their own."""

    def __init__(self, raw, base, length):
        self.raw, self.base, self.length, self.position = raw, base, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.position

    def seek(self, offset, whence=0):
        origin = {0: 0, 1: self.position, 2: self.length}[whence]
        self.position = max(0, origin + offset)
        return self.position

    def readinto(self, buffer):
        count = max(0, min(len(buffer), self.length - self.position))
        self.raw.seek(self.base + self.position)
        got = self.raw.readinto(memoryview(buffer)[:count])
        self.position += got
        return got


class ZipEntries:
    """Where each record of a torch.save archive is: ``records`` maps the record name
    (``data.pkl``, ``data/0``, ...) to ``(file offset of its bytes, size, crc)``. The
    archive may be ``length`` bytes from ``base`` inside a larger file (DCP's files); it
    is read from ``file`` (an open binary file) where given, else from ``path``."""

    def __init__(self, path: str, base: int = 0, length: int | None = None, *,
                 file: Any = None) -> None:
        self.path = path
        self.records: dict[str, tuple[int, int, int]] = {}
        opened = open(path, "rb") if file is None else contextlib.nullcontext(file)  # noqa: SIM115
        with opened as raw:
            if length is None:
                length = raw.seek(0, 2) - base
            view = _Slice(raw, base, length)
            try:
                archive = zipfile.ZipFile(io.BufferedReader(view))
            except zipfile.BadZipFile as error:
                raise ValueError(f"{path}: not a torch.save zip archive ({error}); files "
                                 "of torch's legacy (pre-1.6) format are not supported") \
                    from None
            with archive:
                for info in archive.infolist():
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise ValueError(f"{path}: record {info.filename} is compressed")
                    raw.seek(base + info.header_offset)
                    header = raw.read(30)
                    signature, *_, name_len, extra_len = struct.unpack("<IHHHHHIIIHH",
                                                                       header)
                    if signature != _LOCAL:
                        raise ValueError(f"{path}: bad local header for {info.filename}")
                    start = base + info.header_offset + 30 + name_len + extra_len
                    record = info.filename.split("/", 1)[1] if "/" in info.filename \
                        else info.filename
                    self.records[record] = (start, info.file_size, info.CRC)
            if "data.pkl" not in self.records:
                raise ValueError(f"{path}: not a torch.save archive (no data.pkl)")
            self.pickle = self.read(raw, "data.pkl")
            self.byteorder = (self.read(raw, "byteorder").decode()
                              if "byteorder" in self.records else "little")

    def read(self, raw: Any, record: str) -> bytes:
        start, size, _ = self.records[record]
        raw.seek(start)
        return raw.read(size)
