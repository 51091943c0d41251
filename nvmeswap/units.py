"""Byte counts as people write them (4096, 64K, 1M, 1G), the units nvmeswap prints, and the
block sizes it aligns memory and files to.

Note [units]: every size given to nvmeswap counts in powers of 1024, as ds_io's do:
``K``/``KiB``/``KB`` = 2^10, ``M`` = 2^20, ``G`` = 2^30, ``T`` = 2^40 bytes. Speeds in
nvmeswap's own tables are GB/s with GB = 10^9 bytes (as fio and drive makers count); the
``Task``/``E2E`` lines kept for scripts written for ds_io use ds_io's GB = 2^30 bytes.
Each output says which it uses.
"""
import os
import re

_SCALE = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# ASCII digits only ("²" and other scripts' digits are not sizes); "1KiB", "1kb", "1B".
_SIZE = re.compile(r"([0-9]+)\s*(?:([KMGT])I?)?B?", re.ASCII | re.IGNORECASE)

#: Bytes in the GB of nvmeswap's tables (decimal, as fio and drive makers count).
GB = 10**9
#: Bytes in the GB of ds_io's ``Task``/``E2E ... Speed`` lines.
DS_IO_GB = 1 << 30
#: One line for help texts.
SIZE_HELP = "K, M, G, T (also KiB, MB, ...) are powers of 1024, as in ds_io"

#: The O_DIRECT block: memory addresses, file offsets and lengths of direct I/O align to it.
ALIGNMENT = 4096
#: The size of a memory page: shared regions and locked tensors are whole pages.
PAGE = os.sysconf("SC_PAGE_SIZE")
#: A disk sector, O_DIRECT's unit in DeepNVMe: its get_alignment() is this times the parallelism.
SECTOR = 512


def round_up(n, multiple):
    """The least multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple


def parse_size(text):
    """``"1G"`` -> 1073741824; plain integers pass through; a clear ValueError otherwise.

    See Note [units]: every suffix is a power of 1024.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    found = _SIZE.fullmatch(str(text).strip())
    if found is None:
        raise ValueError(f"not a size: {text!r} (a whole number with an optional K, M, G or T "
                         "suffix; " + SIZE_HELP + ")")
    return int(found[1]) * _SCALE.get((found[2] or "").upper(), 1)


def format_size(n):
    """``1073741824`` -> ``"1G"``: exact, in the form :func:`parse_size` reads back."""
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def human_size(n):
    """``80000000000`` -> ``"74.5 GiB"``: for people, not for parsing."""
    for suffix, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {suffix}"
    return f"{n} bytes"


def size_argument(text):
    """A positive ``parse_size`` for argparse, so that its message reaches the user."""
    import argparse
    try:
        value = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value
