"""``validate=True``: re-read exactly the bytes just transferred and compare them."""
import os

from .._memory import buffer_address, first_difference
from ..errors import ValidationError, short_file_error

_STEP = 16 << 20


def validate(op, reader):
    """Compare the file's bytes of ``op`` with the buffer's, shown by ``reader.host_bytes``."""
    fd = os.open(op.file.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for start in range(0, op.buffer.nbytes, _STEP):
            length = min(_STEP, op.buffer.nbytes - start)
            data = os.pread(fd, length, op.file_offset + start)
            if len(data) != length:
                raise short_file_error(op.file.name, f"validation read {len(data)} of {length} "
                                                     f"bytes at offset {op.file_offset + start}")
            address, _keeper = reader.host_bytes(start, length)
            diff = first_difference(buffer_address(data, False)[0], address, length)
            if diff >= 0:
                at = op.file_offset + start + diff
                raise ValidationError(f"{op.file.name}: validation failed at file offset {at}: "
                                      "the file and the buffer differ", op.file.name, at)
    finally:
        os.close(fd)
