"""The CRC-32 of checkpoint bytes (zip's: the IEEE polynomial, as ``zlib.crc32``).

Note [fast CRC-32]
A torch.save archive holds the CRC-32 of every record, so a save computes it over all
of the state's bytes. With zlib's ``crc32`` (2.2 to 3.3 GB/s on this machine's cores)
that was the longest step of a save: 0.4 s of a 0.66 s save of 1 GiB here, and on an
H100 VM 116 ms of a 190 ms save of 256 MiB of CUDA state. ISA-L's, through the
``isal`` package, gives the same values at 9.1 GB/s here (zlib-ng's: 7.4). It is a
dependency where it has wheels (x86-64 and ARM64 Linux and macOS, Windows); elsewhere,
or where it will not import, zlib's is used. Both release the GIL while they run, which
the CRC thread of a save needs (Note [streamed checkpoint writes]).
"""
from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:     # a platform without its wheels: the standard library's
    from zlib import crc32

__all__ = ["crc32"]
