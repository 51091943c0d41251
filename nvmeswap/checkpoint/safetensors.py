"""The safetensors format, written and read through nvmeswap without the ``safetensors``
package: an 8-byte little-endian header length N, N bytes of JSON (each tensor's dtype,
shape and ``data_offsets`` into the data that follows, plus an optional
``"__metadata__"`` of strings), then the tensors' bytes back to back.

Note [aligned safetensors]: the format allows no gaps between tensors, so only the start
of the data can be placed: nvmeswap pads the JSON with spaces (as the format allows) so
the data starts at a multiple of 4096. The whole data section is then one run of aligned
direct writes, and a load reads it in large aligned operations into locked buffers, each
tensor a view of its part (Note [checkpoint reads]).
"""
from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

from ..units import ALIGNMENT, round_up
from .image import FileImage, uint8_view
from .loading import check_target, read_data, read_each, reading
from .striped_checkpoints import opened

#: safetensors' dtype names; the unsigned 16/32/64-bit ones need torch 2.3+.
_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}
# Note [packed float4]: torch's float4_e2m1fn_x2 holds two 4-bit values an element, the
# header counts values: its last dimension is twice torch's (the safetensors package's
# reading, which refuses a 0-dim one).
_PACKED = "F4"
MAX_HEADER = 100_000_000        # the safetensors package's own limit
MAX_DIMENSION = (1 << 63) - 1   # the format's dimensions are unsigned 64-bit; torch's signed


def _dtypes():
    import torch

    return {name: getattr(torch, attr) for name, attr in _NAMES.items() if hasattr(torch, attr)}


def layout(tensors: Any, metadata: Any = None) -> FileImage:
    """The ``FileImage`` of a safetensors file of ``tensors`` (a dict name -> CPU tensor);
    every argument checked first."""
    import torch

    if not isinstance(tensors, dict):
        raise TypeError(f"save_safetensors needs a dict of tensors, got "
                        f"{type(tensors).__name__}")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise TypeError("metadata must be a dict of str to str")
    names = {dtype: name for name, dtype in _dtypes().items()}
    header: dict[str, Any] = {}
    sources = []
    spans = []
    offset = 0
    for key, tensor in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"safetensors keys are str, got {key!r}")
        if key == "__metadata__":
            raise ValueError("'__metadata__' is reserved in safetensors; pass metadata=")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{key}: expected a tensor, got {type(tensor).__name__}")
        if tensor.dtype not in names:
            raise ValueError(f"{key}: safetensors has no name for {tensor.dtype}")
        if tensor.layout != torch.strided:
            raise ValueError(f"{key}: only dense tensors can be saved, not {tensor.layout}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes and tensor.is_contiguous() and tensor.device.type == "cpu":
            start = tensor.data_ptr()
            spans.append((start, start + nbytes, key))
        shape = list(tensor.shape)
        if names[tensor.dtype] == _PACKED:
            if not shape:
                raise ValueError(f"{key}: a 0-dim {tensor.dtype} tensor has no safetensors "
                                 "form (its header counts 4-bit values); reshape it to (1,)")
            shape[-1] *= 2
        header[key] = {"dtype": names[tensor.dtype], "shape": shape,
                       "data_offsets": [offset, offset + nbytes]}
        sources.append(tensor)
        offset += nbytes
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{first} and {second} share memory; safetensors stores each "
                             "tensor once (clone one of them)")
    if metadata is not None:
        header = {"__metadata__": dict(metadata), **header}
    text = json.dumps(header, separators=(",", ":")).encode()
    data_start = round_up(8 + len(text), ALIGNMENT)
    text += b" " * (data_start - 8 - len(text))
    if len(text) > MAX_HEADER:
        raise ValueError(f"a safetensors header of {len(text)} bytes is more than readers "
                         f"take ({MAX_HEADER}); save fewer tensors or less metadata")
    image = FileImage()
    image.add_bytes(0, struct.pack("<Q", len(text)) + text)
    for tensor in sources:
        if tensor.numel():
            # Its values, a conjugate or negative bit applied; CUDA ones stay there (Note
            # [CUDA state layout]).
            data = tensor.detach().resolve_conj().resolve_neg().contiguous()
            image.add_tensor(image.size, uint8_view(data.untyped_storage())[
                data.storage_offset() * data.element_size():][:data.numel()
                                                              * data.element_size()])
    return image


class Header:
    """The parsed header of a safetensors file: ``tensors`` (name -> (dtype, shape, start,
    end) with absolute file offsets), ``metadata`` and ``data_start``. Read from ``file``
    (an open binary file) where given, else from ``path``."""

    def __init__(self, path: str, file: Any = None) -> None:
        with open(path, "rb") if file is None else contextlib.nullcontext(file) as raw:
            raw.seek(0)
            head = raw.read(8)
            length = self._length(path, head)
            text = raw.read(length)
            size = raw.seek(0, 2)
        if len(text) < length:
            raise ValueError(f"{path}: the safetensors header is cut short")
        try:
            parsed = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{path}: bad safetensors header: {error}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{path}: bad safetensors header: a JSON "  # noqa: TRY004
                             f"{type(parsed).__name__}, not an object")
        self.path = path
        self.data_start = 8 + length
        self.metadata = parsed.pop("__metadata__", None)
        if self.metadata is not None and not (isinstance(self.metadata, dict) and all(
                isinstance(value, str) for value in self.metadata.values())):
            raise ValueError(f"{path}: bad safetensors header: __metadata__ is not an "
                             "object of strings")
        dtypes = _dtypes()
        self.tensors = {}
        for name, entry in parsed.items():
            dtype, shape, begin, end = self._entry(path, name, entry, dtypes)
            self.tensors[name] = (dtype, shape, self.data_start + begin, self.data_start + end)
        # As the format has it (and the safetensors package checks): the tensors' bytes
        # follow one another from the data's start to the file's end, none shared.
        at = self.data_start
        for name, (_, _, begin, end) in sorted(self.tensors.items(),
                                               key=lambda item: item[1][2:]):
            if begin != at:
                raise ValueError(f"{path}: {name}'s bytes start at {begin - self.data_start} "
                                 f"of the data, not at {at - self.data_start}: "
                                 f"{'shared with another tensor' if begin < at else 'a gap'}")
            at = end
        if at != size:
            raise ValueError(f"{path}: {size} bytes, but its header describes {at}")

    @staticmethod
    def _entry(path, name, entry, dtypes):
        """``(dtype, shape, begin, end)`` of a header's ``entry`` for tensor ``name``,
        checked: its offsets hold the bytes of its shape and dtype."""
        import torch

        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise ValueError(f"{path}: {name} is not described by dtype, shape and "
                             "data_offsets in the header")
        dtype = dtypes.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{path}: {name} has a dtype this torch lacks: {entry['dtype']}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list)
                and all(type(dim) is int and 0 <= dim <= MAX_DIMENSION for dim in shape)):
            raise ValueError(f"{path}: {name} has a bad shape {shape}")
        if entry["dtype"] == _PACKED:
            if not shape or shape[-1] % 2:
                raise ValueError(f"{path}: {name} has shape {shape} of 4-bit values, which "
                                 "does not end on a byte")
            shape = [*shape[:-1], shape[-1] // 2]
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(offset) is int for offset in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{path}: {name} has bad data_offsets {offsets}")
        begin, end = offsets
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes:
            raise ValueError(f"{path}: {name} has {end - begin} bytes for shape {shape} of "
                             f"{dtype}")
        return dtype, tuple(shape), begin, end

    @staticmethod
    def _length(path, head):
        if len(head) < 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER:
            raise ValueError(f"{path}: a safetensors header of {length} bytes is too "
                             "large (not a safetensors file?)")
        return length


@contextlib.contextmanager
def _opened(path, handle):
    """``(header, reader, file)``: the file's header, and the reader and file to read its
    bytes with (``loading.reading``), all of the one file (Note [one file per load])."""
    with opened(path) as (layout, file, source):
        header = Header(path, file=file)
        with reading(source, layout, handle) as (reader, file_name):
            yield header, reader, file_name


def load_locked(path: str, handle: Any) -> dict:
    """``load_safetensors``: the data section read in large aligned operations into locked
    buffers, ``handle``'s or (no handle) fresh private ones (Note [checkpoint reads])."""
    import torch

    with opened(path) as (layout, file, source):
        header = Header(path, file=file)
        pieces = read_data(source, layout, handle, [(start, end) for _, _, start, end
                                                    in header.tensors.values()])
    try:
        result = {}
        for name, (dtype, shape, start, end) in header.tensors.items():
            if end == start:        # no elements (Header checked the bytes against the shape)
                result[name] = torch.empty(shape, dtype=dtype)
                continue
            result[name] = torch.frombuffer(pieces.view(start, end - start),
                                            dtype=dtype).reshape(shape)
        return result
    except BaseException:
        pieces.free()
        raise


def load_into(path: str, into: Any, handle: Any, strict: bool) -> Any:
    """``load_safetensors_into``: each tensor of the file read straight into the tensor of
    the same name in ``into`` (a flat dict), every match checked before any read; a
    striped file is read whole, then copied."""
    if not isinstance(into, dict):
        raise TypeError(f"load_safetensors_into needs a dict of tensors, got "
                        f"{type(into).__name__}")
    with _opened(path, handle) as (header, reader, file_name):
        read_each(reader, file_name, _placed(header, into, strict))
    return into


def _placed(header, into, strict):
    """``(target tensor, file offset of its bytes)`` for each non-empty tensor of the file
    with a place in ``into``, every match checked first."""
    import torch

    path = header.path
    missing = [name for name in header.tensors if name not in into]
    extra = [name for name in into if name not in header.tensors]
    if strict and (missing or extra):
        raise KeyError(f"load_safetensors_into: {path} and the target differ: in the file "
                       f"only {missing}, in the target only {extra}")
    reads = []
    for name, (dtype, shape, start, end) in header.tensors.items():
        if name not in into:
            continue
        target = into[name]
        if not isinstance(target, torch.Tensor):
            raise TypeError(f"load_safetensors_into: {name} is a "
                            f"{type(target).__name__} in memory, not a tensor")
        if target.dtype != dtype or tuple(target.shape) != shape:
            raise ValueError(f"{path}: {name} is {dtype} {shape} in the file, "
                             f"{target.dtype} {tuple(target.shape)} in memory")
        check_target("load_safetensors_into", name, target)
        if end > start:     # its bytes are its dtype's and shape's (Header checked them)
            reads.append((target, start))
    return reads


def _numel(shape):
    count = 1
    for dim in shape:
        count *= dim
    return count
