"""Where each record of a torch.save archive is, in a file torch (or nvmeswap) wrote: read
straight from the zip's central directory and the records' local headers."""
from __future__ import annotations

import contextlib
import io
import os
import struct
from typing import Any

_END_RECORD = struct.Struct("<IHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_END_RECORD = struct.Struct("<IQHHIIQQQQ")
_CENTRAL_RECORD = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_FIELDS = 0x0001       # the extra field holding a central record's 64-bit values


def reads_at(file: Any) -> Any:
    """``read_at(offset, nbytes)`` of ``file``: a pread where it has a descriptor, else a
    seek and a read (a striped checkpoint's logical file)."""
    try:
        fd = file.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        def read_at(offset, nbytes):
            file.seek(offset)
            return file.read(nbytes)
        return read_at
    return lambda offset, nbytes: os.pread(fd, nbytes, offset)


def directory_place(read_at: Any, base: int, length: int) -> tuple[int, int, int]:
    """``(record count, offset, size)`` of the central directory of the zip archive of
    ``length`` bytes at ``base`` (of what ``read_at`` reads), offset from ``base``; from
    the end of central directory record, or the zip64 one it points to (torch's writer
    writes both). ValueError if there is none."""
    # The end record is the last 22 bytes but for a comment (none in torch's files): only
    # those and the zip64 locator before them are read first, as a striped file's
    # headers are in its first and last stripes.
    for most in (0, 0xFFFF):
        tail_length = min(length, _ZIP64_LOCATOR.size + _END_RECORD.size + most)
        tail = read_at(base + length - tail_length, tail_length)
        end = tail.rfind(b"PK\x05\x06", 0, len(tail) - _END_RECORD.size + 4)
        if len(tail) < tail_length or end >= 0:
            break
    if len(tail) < tail_length or end < 0:
        raise ValueError("no end of central directory record")
    *_, count, directory_size, directory_at, _ = _END_RECORD.unpack_from(tail, end)
    locator = end - _ZIP64_LOCATOR.size
    if locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":
        _, _, zip64_end_at, _ = _ZIP64_LOCATOR.unpack_from(tail, locator)
        record = read_at(base + zip64_end_at, _ZIP64_END_RECORD.size)
        if len(record) < _ZIP64_END_RECORD.size or record[:4] != b"PK\x06\x06":
            raise ValueError("bad zip64 end of central directory record")
        *_, count, directory_size, directory_at = _ZIP64_END_RECORD.unpack(record)
    return count, directory_at, directory_size


def _central_directory(read_at: Any, base: int,
                       length: int) -> list[tuple[str, int, int, int, int, bytes]]:
    """``(name, method, size, crc, local header offset, name's bytes)`` of each record of
    the zip archive of ``length`` bytes at ``base`` (of what ``read_at`` reads), offsets
    from ``base``; ValueError if it is not one. Read straight from its central
    directory (for a state of 2000 tensors ``zipfile`` took 15 of the 20 ms of finding
    the records, 2026-11-27)."""
    count, directory_at, directory_size = directory_place(read_at, base, length)
    directory = read_at(base + directory_at, directory_size) \
        if directory_at + directory_size <= length else b""
    if len(directory) != directory_size:
        raise ValueError("the central directory is past the end of the file")
    records, at = [], 0
    for _ in range(count):
        if at + _CENTRAL_RECORD.size > len(directory) or directory[at:at + 4] != b"PK\x01\x02":
            raise ValueError("bad central directory")
        (_, _, _, flags, method, _, _, crc, packed, size, name_len, extra_len, comment_len,
         _, _, _, header_at) = _CENTRAL_RECORD.unpack_from(directory, at)
        at += _CENTRAL_RECORD.size
        raw_name = directory[at:at + name_len]
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
        if 0xFFFFFFFF in (packed, size, header_at):
            size, header_at = _zip64_values(directory[at + name_len:at + name_len + extra_len],
                                            packed, size, header_at)
        records.append((name, method, size, crc, header_at, raw_name))
        at += name_len + extra_len + comment_len
    return records


def _zip64_values(extra: bytes, packed: int, size: int, header_at: int) -> tuple[int, int]:
    """A central record's size and local header offset, those that do not fit in 32 bits
    taken from its zip64 extra field (which holds, in this order, each of size, packed
    size and offset that is 0xFFFFFFFF)."""
    at = 0
    while at + 4 <= len(extra):
        kind, nbytes = struct.unpack_from("<HH", extra, at)
        if kind == _ZIP64_FIELDS:
            values = list(struct.unpack_from(f"<{nbytes // 8}Q", extra, at + 4))
            wanted = [size == 0xFFFFFFFF, packed == 0xFFFFFFFF, header_at == 0xFFFFFFFF]
            if len(values) < sum(wanted):
                break
            if wanted[0]:
                size = values.pop(0)
            if wanted[1]:
                values.pop(0)
            if wanted[2]:
                header_at = values.pop(0)
            return size, header_at
        at += 4 + nbytes
    raise ValueError("a record's zip64 extra field is missing or short")


class ZipEntries:
    """Where each record of a torch.save archive is: ``records`` maps the record name
    (``data.pkl``, ``data/0``, ...) to ``(file offset of its bytes, size, crc)``. The
    archive may be ``length`` bytes from ``base`` inside a larger file (DCP's files); it
    is read from ``file`` (an open binary file) where given, else from ``path``.

    Without ``storage_headers`` the local headers of the storages' records are not read
    (Note [headers in the reads]): their offset is None until ``storage_start`` finds it
    in bytes read since; ``spans`` holds each one's ``(header offset, end)``, the end
    being where the next record's header is (for the last record, the archive's end)."""

    def __init__(self, path: str, base: int = 0, length: int | None = None, *,
                 file: Any = None, storage_headers: bool = True) -> None:
        self.path = path
        self.records: dict[str, tuple[int | None, int, int]] = {}
        self.spans: dict[str, tuple[int, int]] = {}
        self._names: dict[str, tuple[str, bytes]] = {}    # record -> its name, as held
        opened = open(path, "rb") if file is None else contextlib.nullcontext(file)  # noqa: SIM115
        with opened as raw:
            read_at = reads_at(raw)
            if length is None:
                length = raw.seek(0, os.SEEK_END) - base
            try:
                directory = _central_directory(read_at, base, length)
            except (ValueError, OverflowError) as error:    # an offset past any file's
                raise ValueError(f"{path}: not a torch.save zip archive ({error}): damaged, "
                                 "or of torch's legacy (pre-1.6) format, which is not "
                                 "supported") from None
            headers = sorted(entry[4] for entry in directory)
            next_header = dict(zip(headers, headers[1:] + [length]))
            for name, method, size, crc, header_at, raw_name in directory:
                if method != 0:
                    raise ValueError(f"{path}: record {name} is compressed")
                record = name.split("/", 1)[1] if "/" in name else name
                if header_at + 30 + len(raw_name) > length:
                    raise ValueError(f"{path}: record {name} lies past the end of the "
                                     "archive (a truncated file?)")
                self.spans[record] = (base + header_at, base + next_header[header_at])
                self._names[record] = name, raw_name
                self.records[record] = (None, size, crc)
                if storage_headers or not record.startswith("data/"):
                    self.storage_start(record, read_at)
            if "data.pkl" not in self.records:
                raise ValueError(f"{path}: not a torch.save archive (no data.pkl)")
            self.pickle = self.read(read_at, "data.pkl")
            self.byteorder = "little"
            if "byteorder" in self.records:
                recorded = self.read(read_at, "byteorder")
                try:
                    self.byteorder = recorded.decode()
                except UnicodeDecodeError:
                    raise ValueError(f"{path}: its byteorder record is damaged "
                                     f"({recorded[:16]!r})") from None

    def storage_start(self, record: str, read_at: Any) -> int:
        """The file offset of ``record``'s bytes, from its local header (read by
        ``read_at(offset, nbytes)``) if not known yet; ValueError if the header is not
        one, or has the record run into the next."""
        start, size, crc = self.records[record]
        if start is not None:
            return start
        header_at, end = self.spans[record]
        name, raw_name = self._names[record]
        header = read_at(header_at, 30 + len(raw_name))
        if (len(header) < 30 + len(raw_name) or header[:4] != b"PK\x03\x04"
                or struct.unpack_from("<H", header, 26)[0] != len(raw_name)
                or header[30:] != raw_name):
            raise ValueError(f"{self.path}: bad local header for {name}")
        start = header_at + 30 + len(raw_name) + struct.unpack_from("<H", header, 28)[0]
        if start + size > end:
            raise ValueError(f"{self.path}: record {name} runs past "
                             "the next record or the end of the archive (a truncated "
                             "file?)")
        self.records[record] = (start, size, crc)
        return start

    def read(self, read_at: Any, record: str) -> bytes:
        start, size, _ = self.records[record]
        data = read_at(start, size)
        if len(data) != size:
            raise ValueError(f"{self.path}: record {record} is cut short")
        return data
