"""The on/off environment variables nvmeswap reads, all read one way."""
from __future__ import annotations

import os

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def switch(name: str) -> bool | None:
    """The setting of the environment variable ``name``: True for 1, true, yes or on,
    False for 0, false, no or off (any case), None where it is unset or empty; anything
    else is a ValueError naming it (a typo must not pass for the default)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1, true, yes or on, or 0, "
                     "false, no or off")
