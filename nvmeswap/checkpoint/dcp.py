"""torch.distributed.checkpoint storage through nvmeswap: ``NvmeFileSystemWriter`` and
``NvmeFileSystemReader`` for ``dcp.save``, ``dcp.async_save`` and ``dcp.load``.

Note [DCP files]: the files are DCP's own (``FileSystemWriter``'s layout): one
``__<rank>_<n>.distcp`` per rank (or per item), each tensor item a ``torch.save`` archive
of the tensor, each bytes item its raw bytes, found through ``.metadata`` by offset and
length. So DCP's ``FileSystemReader`` reads our checkpoints and ours reads DCP's. What
changes is who moves the bytes: each rank's file is laid out in memory (archives at
4096-aligned offsets, Note [torch.save layout]) and streamed through nvmeswap like any
checkpoint (Note [streamed checkpoint writes]), crash-consistently; a load reads each
saved tensor's bytes straight into the tensor being loaded when the two have the same
layout, and through one locked scratch buffer otherwise. Everything else (planning,
metadata, the ``.metadata`` file, staging for ``async_save``) is DCP's.

Stream extensions (``_extensions``: compression, say) and DCP's safetensors
serialization change what a file holds, byte by byte, as it streams; for those the
writer hands the files to ``FileSystemWriter`` itself (and the reader, items saved with
extensions to ``FileSystemReader``), warning once with a ``BufferedIOWarning``: the
checkpoint is DCP's to the byte, moved the buffered way.
"""
from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemReader,
    FileSystemWriter,
    SerializationFormat,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import BufferedIOWarning, short_file_error, warn_once
from ..units import ALIGNMENT
from .checkpointer import Checkpointer
from .image import FileImage
from .loading import unpickle
from .torch_zip import tensor_archive
from .zip_entries import ZipEntries

__all__ = ["NvmeFileSystemReader", "NvmeFileSystemWriter"]


class _Session:
    """The checkpointer to use: the one given, or one made for this call and closed (with
    no handle either, through the process's own queue: Note [saves without a handle],
    Note [fresh private reads])."""

    def __init__(self, checkpointer, handle):
        self.given = checkpointer
        self.handle = handle

    def __enter__(self):
        if self.given is not None:
            return self.given
        self.made = Checkpointer(self.handle, chunk_bytes=None)
        return self.made

    def __exit__(self, *exc_info):
        if self.given is None:
            self.made.close()


class NvmeFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` with each rank's files written through nvmeswap (Note
    [DCP files]).

    Takes ``FileSystemWriter``'s arguments, plus ``checkpointer`` (an
    ``nvmeswap.Checkpointer`` to reuse across saves) or ``handle`` (an ``aio_handle``);
    with neither, the bytes go through the process's own kernel queue (Note [own queue
    and CUDA] where CUDA is in use). ``thread_count`` only splits the items over
    files, as in DCP.
    With ``_extensions`` or ``serialization_format=SAFETENSORS`` DCP's own writer writes
    the files (Note [DCP files]).
    """

    def __init__(self, path: str | os.PathLike, *args: Any,
                 checkpointer: Checkpointer | None = None, handle: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._session = _Session(checkpointer, handle)
        self._dcp_writes = None     # why DCP's own writer writes the files, if it does
        if self.serialization_format != SerializationFormat.TORCH_SAVE:
            self._dcp_writes = f"the {self.serialization_format.value} serialization"
        elif self.transforms.extensions:
            self._dcp_writes = "stream extensions " + ", ".join(
                extension.get_descriptor() for extension in self.transforms.extensions)

    def write_data(self, plan: Any, planner: Any) -> Future:
        if self._dcp_writes is not None:
            _warn_dcp_moves(f"NvmeFileSystemWriter: {self._dcp_writes}")
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        if self.single_file_per_rank:
            groups = _split_by_size_and_type(self.thread_count, plan.items)
        else:
            groups = [[item] for item in plan.items]
        results: list[WriteResult] = []
        with self._session as checkpointer:
            for number, items in enumerate(groups):
                file_name = f"{prefix}{number}{DEFAULT_SUFFIX}"
                image, file_results = _rank_file(items, planner, file_name)
                path = os.fspath(self.fs.concat_path(self.path, file_name))
                checkpointer.write_image(image, path)
                results += file_results
        future: Future = Future()
        future.set_result(results)
        return future


def _rank_file(items, planner, file_name):
    """The image of one file: bytes items as they are, then each tensor as a torch.save
    archive starting at a 4096-aligned offset; and the ``WriteResult`` of each item."""
    image = FileImage()
    results = []
    for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            payload = data.getbuffer() if isinstance(data, io.BytesIO) else data
            start = image.size
            image.add_bytes(start, bytes(payload))
            length = image.size - start
        else:
            tensor = data.detach().cpu()
            if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone()     # as DCP does: save the values, not the storage
            image.pad_to(ALIGNMENT)
            archive = tensor_archive(tensor)
            start = image.extend(archive)
            length = archive.size
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(file_name, start, length)))
    return image, results


class NvmeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with each tensor's bytes read through nvmeswap (Note [DCP
    files]); reads files of DCP's ``FileSystemWriter`` and of ``NvmeFileSystemWriter``.
    ``checkpointer`` / ``handle`` as for the writer."""

    def __init__(self, path: str | os.PathLike, *args: Any,
                 checkpointer: Checkpointer | None = None, handle: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._session = _Session(checkpointer, handle)

    def read_data(self, plan: Any, planner: Any) -> Future:
        transformed = {descriptor for request in plan.items for descriptor in
                       self.storage_data[request.storage_index].transform_descriptors or ()}
        if transformed:
            _warn_dcp_moves(f"NvmeFileSystemReader: stream extensions "
                            f"{', '.join(sorted(transformed))}")
            return super().read_data(plan, planner)
        by_file: dict[str, list] = {}
        for request in plan.items:
            info = self.storage_data[request.storage_index]
            by_file.setdefault(info.relative_path, []).append(request)
        with self._session as checkpointer, checkpointer.reader() as reader:
            for relative_path, requests in by_file.items():
                path = os.fspath(self.fs.concat_path(self.path, relative_path))
                self._read_file(reader, path, requests, planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_file(self, handle, path, requests, planner):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._read_items(handle, path, fd, requests, planner)
        finally:
            os.close(fd)

    def _read_items(self, handle, path, fd, requests, planner):
        direct = []         # (request, target) read straight into the target
        kinds: dict[int, list[_ItemKind]] = {}
        size = os.fstat(fd).st_size
        for request in requests:
            info = self.storage_data[request.storage_index]
            if request.type == LoadItemType.BYTE_IO:
                data = os.pread(fd, info.length, info.offset)
                if len(data) != info.length:
                    raise ValueError(f"{path}: {info.length} bytes at {info.offset} "
                                     f"expected, the file has {len(data)}")
                planner.load_bytes(request, io.BytesIO(data))
                continue
            if info.offset + info.length > size:
                raise short_file_error(path, f"the item at {info.offset} of {info.length} "
                                             f"bytes runs past the file's end ({size} bytes; "
                                             "cut short?)")
            saved, start = _saved_tensor(path, fd, info, kinds)
            wanted = narrow_tensor_by_index(saved, request.storage_offsets, request.lengths)
            target = planner.resolve_tensor(request).detach()
            if target.size() != wanted.size():
                raise ValueError(f"{path}: item {request.storage_index} is "
                                 f"{tuple(wanted.size())}, the target "
                                 f"{tuple(target.size())}")
            # A CUDA target too: the reader stages its bytes (as load_into's reads).
            # A conjugate or negative bit (saved, or the target's) takes the copy, which
            # applies it: the bytes are not the values.
            if (wanted.is_contiguous() and target.is_contiguous()
                    and target.device.type in ("cpu", "cuda") and target.dtype == wanted.dtype
                    and not (wanted.is_conj() or wanted.is_neg() or target.is_conj()
                             or target.is_neg())):
                offset = start + wanted.storage_offset() * wanted.element_size()
                if target.numel():
                    handle.async_pread(target, path, offset)
                direct.append((request, target))
            else:
                whole = torch.empty(saved.untyped_storage().nbytes(), dtype=torch.uint8)
                if whole.numel():
                    handle.sync_pread(whole, path, start)
                values = whole.view(saved.dtype).as_strided(
                    wanted.size(), wanted.stride(), wanted.storage_offset())
                if wanted.is_conj():
                    values = values.conj()
                if wanted.is_neg():
                    values = values._neg_view()
                target.copy_(values)
                planner.commit_tensor(request, target)
        if any(target.numel() for _, target in direct):
            handle.wait()
        for request, target in direct:
            planner.commit_tensor(request, target)


def _warn_dcp_moves(what):
    warn_once(("dcp", what), f"{what}: DCP's own file I/O moves these checkpoint files "
              "(buffered, not through nvmeswap; Note [DCP files])", BufferedIOWarning)


class _ItemKind:
    """A tensor item read before: its bytes up to its tensor's, and what they say."""

    def __init__(self, head: bytes, saved: Any) -> None:
        self.head = head
        self.saved = saved


_KINDS = 8      # kinds of item remembered for each length


def _saved_tensor(path, fd, info, kinds):
    """The tensor item at ``info`` as a meta tensor (dtype, shape, strides, offset) and
    the file offset of its storage's bytes. An item whose bytes up to its tensor's are
    those of one in ``kinds`` of its length says what that one said (Note [tensor
    archives]); any other is parsed, and becomes a kind of its length."""
    known = kinds.setdefault(info.length, [])
    if known:
        head = os.pread(fd, max(len(kind.head) for kind in known), info.offset)
        for kind in known:
            if head.startswith(kind.head):
                return kind.saved, info.offset + len(kind.head)
    saved, start = _parsed_tensor(path, fd, info)
    if len(known) < _KINDS:
        known.append(_ItemKind(os.pread(fd, start - info.offset, info.offset), saved))
    return saved, start


def _parsed_tensor(path, fd, info):
    with os.fdopen(os.dup(fd), "rb") as file:
        entries = ZipEntries(path, info.offset, info.length, file=file)
    found = {}

    def make_storage(key, dtype, nbytes, location):
        record = entries.records.get(f"data/{key}")
        if record is None or record[1] != nbytes:
            raise ValueError(f"{path}: the tensor at {info.offset} has no storage {key} "
                             f"of {nbytes} bytes")
        found[key] = record[0]
        return torch.UntypedStorage(nbytes, device="meta")

    saved = unpickle(entries, make_storage, weights_only=True)
    if not isinstance(saved, torch.Tensor) or len(found) != 1:
        raise ValueError(f"{path}: the item at {info.offset} is not one tensor")
    return saved, next(iter(found.values()))
