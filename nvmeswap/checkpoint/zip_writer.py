"""torch.save's zip archive laid out by nvmeswap itself: the records ``torch.serialization``
hands its writer, placed as torch's writer places them, straight into a ``FileImage``.

Note [own zip writer]: for a state of many small tensors, torch's zip writer
(``PyTorchFileWriter``) and what a layout did around it were a fifth of a save: four
Python writes a record into the layout's recorder, then a pass over what it wrote to cut
the image into runs, and one over its central directory to find each storage's CRC
field (2000 tensors: 36 to 45 ms, against 26 to 28 ms for this module, in one process,
2026-11-27). The format is small and fixed: each record a local header (version 0,
flags 0x0808: sizes in a data descriptor, UTF-8 names; stored; no time, CRC or sizes;
an empty record flags 0x0800 and no descriptor), the name ``archive/<record>``, an extra
field ``FB`` of ``Z`` bytes padding the record's bytes to the archive's alignment, the
bytes, a data descriptor; then the records ``version`` and ``.data/serialization_id``,
the central directory, and both zip64 and classic end records. nvmeswap writes the same
bytes as it goes, and knows where each storage's CRC goes as it places it. Only the
serialization id differs: torch combines hashes of the record names in the order of a
C++ hash set, which Python cannot follow; nvmeswap combines CRCs of the names in record
order (a layout's id was no file's own before either: torch's writer took each
storage's CRC as 0). An archive that would need zip64 fields (4 GiB or more) or 65535
records is left to torch's writer, as is every archive on a torch whose writer lays a
probe out otherwise (``torch_zip._own_writer_end_records``, once a process).
"""
from __future__ import annotations

import struct
from typing import Any, NamedTuple

from .crc import crc32
from .image import FileImage, TensorRun, uint8_view

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_UTF8_NAMES = 0x0800
_FLAGS = _UTF8_NAMES | 0x0008   # and sizes in a data descriptor
_ZIP64_MADE_BY, _ZIP64_NEEDED = 0x031E, 45
_LIMIT = 0xFFFFFFFF             # at or past it, a field would need zip64's form
_MAX_RECORDS = 0xFFFF
_HASH_MASK = (1 << 64) - 1
_PADDING = memoryview(b"Z" * 0xFFFF)      # the most an extra field holds


def _combine(seed: int, value: int) -> int:
    """c10's ``hash_combine``, on 64 bits, as torch combines the records' CRCs."""
    return seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _HASH_MASK)


class _CentralEntry(NamedTuple):
    """What a record's central directory entry holds (``run``: the storage whose CRC
    is to be filled in)."""
    name: bytes
    flags: int
    crc: int
    nbytes: int
    header_at: int
    run: TensorRun | None


class _Archive:
    """An image being written record by record; the bytes since the last storage are
    kept in ``pending`` until the next storage (or the end) closes them into a run."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.image = FileImage()
        self.pending = bytearray()
        self.pending_slots: list[tuple[TensorRun, int]] = []   # CRC places in pending
        self.central: list[_CentralEntry] = []
        self.names_hash = self.crcs_hash = 0

    @property
    def cursor(self) -> int:
        return self.image.size + len(self.pending)

    def header(self, full_name: bytes, flags: int) -> int:
        """The local header of a record; returns where the header starts."""
        at = self.cursor
        padding = -(at + _LOCAL.size + len(full_name) + 4) % self.alignment
        self.pending += _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0,
                                    len(full_name), padding + 4)
        self.pending += full_name
        self.pending += b"FB" + padding.to_bytes(2, "little")
        self.pending += _PADDING[:padding]
        return at

    def add(self, full_name: bytes, data: bytes | Any, nbytes: int) -> None:
        """A record of ``data`` (bytes, or a 1-D uint8 tensor over a storage); an empty
        one has no data descriptor."""
        flags = _FLAGS if nbytes else _UTF8_NAMES
        at = self.header(full_name, flags)
        run = None
        if isinstance(data, bytes):
            crc = crc32(data)
            self.pending += data
        else:
            self._close_pending()
            run = self.image.add_tensor(self.image.size, data)
            crc = 0
        if run is not None:
            self.pending_slots.append((run, 4))
        if nbytes:
            self.pending += _DESCRIPTOR.pack(0x08074B50, crc, nbytes, nbytes)
        self.central.append(_CentralEntry(full_name, flags, crc, nbytes, at, run))
        self.names_hash = _combine(self.names_hash, crc32(full_name))
        self.crcs_hash = _combine(self.crcs_hash, crc)

    def finish(self) -> None:
        directory_at = self.cursor
        for entry in self.central:
            if entry.run is not None:
                self.pending_slots.append((entry.run, len(self.pending) + 16))
            self.pending += _CENTRAL.pack(0x02014B50, 0, 0, entry.flags, 0, 0, 0, entry.crc,
                                          entry.nbytes, entry.nbytes, len(entry.name), 0, 0,
                                          0, 0, 0, entry.header_at)
            self.pending += entry.name
        directory_size = self.cursor - directory_at
        count = len(self.central)
        zip64_end_at = self.cursor
        self.pending += _ZIP64_END.pack(0x06064B50, _ZIP64_END.size - 12, _ZIP64_MADE_BY,
                                        _ZIP64_NEEDED, 0, 0, count, count, directory_size,
                                        directory_at)
        self.pending += _ZIP64_LOCATOR.pack(0x07064B50, 0, zip64_end_at, 1)
        self.pending += _END.pack(0x06054B50, 0, 0, count, count, directory_size,
                                  directory_at, 0)
        self._close_pending()

    def _close_pending(self) -> None:
        if self.pending:
            segment = self.image.add_segment(self.image.size, self.pending)
            for run, index in self.pending_slots:
                run.crc_slots.append((segment, index))
        self.pending = bytearray()
        self.pending_slots = []


def archive_image(records: list[tuple[str, Any]], storages: dict[str, Any],
                  end_records: list[tuple[str, bytes]], *, archive: str = "archive",
                  alignment: int = 4096,
                  serialization_id: bytes | None = None) -> FileImage | None:
    """The image of the zip archive torch's writer makes of ``records`` (``(name, bytes)``,
    or ``(name, nbytes)`` for the storage ``storages[name]``) followed by
    ``end_records`` and a serialization id (nvmeswap's unless given); None where torch's
    writer would write zip64 fields (Note [own zip writer])."""
    total = sum(len(data) if isinstance(data, bytes) else data for _, data in records)
    headers = sum(2 * len(name) + 150 + alignment for name, _ in records)
    if total + headers + 4 * alignment >= _LIMIT or len(records) + 2 >= _MAX_RECORDS:
        return None
    prefix = archive.encode() + b"/"
    written = _Archive(alignment)
    for name, data in records:
        full_name = prefix + name.encode()
        if isinstance(data, bytes) or not data:
            written.add(full_name, data or b"", len(data) if isinstance(data, bytes) else 0)
        else:
            written.add(full_name, uint8_view(storages[name], data), data)
    for name, data in end_records:
        written.add(prefix + name.encode(), data, len(data))
    if serialization_id is None:
        serialization_id = b"%020d%020d" % (written.names_hash, written.crcs_hash)
    written.add(prefix + b".data/serialization_id", serialization_id, len(serialization_id))
    written.finish()
    return written.image
