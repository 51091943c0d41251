"""The mounts this process sees, read from /proc/self/mountinfo: which filesystem holds a
file (by its device) or a folder (by its path)."""
from __future__ import annotations

import os
import re
from typing import NamedTuple


class Mount(NamedTuple):
    device: str     # "major:minor", as st_dev gives it
    point: str
    fs_type: str
    source: str


def parse(lines) -> list[Mount]:
    """The mounts in mountinfo's ``lines`` (proc(5): the mount point is the fifth field;
    type and source follow the "-" that ends the optional fields)."""
    found = []
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        end = fields.index("-")
        found.append(Mount(fields[2], _unescape(fields[4]), *fields[end + 1:end + 3]))
    return found


def mounts() -> list[Mount]:
    """This process's mounts; none where /proc cannot be read."""
    try:
        with open("/proc/self/mountinfo") as f:
            return parse(f)
    except OSError:
        return []


def of_device(device: int) -> Mount | None:
    """The mount of the filesystem on ``device`` (an ``st_dev``), or None."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    return next((mount for mount in mounts() if mount.device == wanted), None)


def of_folder(folder: str) -> Mount | None:
    """The mount that holds ``folder``: the longest mount point above it (the last one
    mounted, where several are on the same point), or None."""
    target = os.path.realpath(folder)
    best = None
    for mount in mounts():
        point = mount.point
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = mount
    return best


def _unescape(field):
    # The kernel writes space, tab, newline and backslash in paths as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
