"""Byte counts as people write them: 4096, 64K, 1M, 1G."""

_SCALE = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text):
    """``"1G"`` -> 1073741824; plain integers pass through; a clear ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    cleaned = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = _SCALE.get(cleaned[-1:], 1)
    digits = cleaned[:-1] if scale > 1 else cleaned
    if not digits.isdigit():
        raise ValueError(f"not a size: {text!r} (use a number with an optional K, M, G suffix)")
    return int(digits) * scale


def format_size(n):
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
    """``parse_size`` for argparse, so that its message reaches the user."""
    import argparse
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
