"""Byte quantities: parsing what users write ("20GiB") and rendering what the plan shows."""

from __future__ import annotations

import math
import re

# One convention, stated in every error: a single-letter unit is binary, as in Slurm's --mem and
# Docker's --memory ("20G" = 20 GiB), an SI unit with B is decimal ("20GB" = 20 * 10**9 bytes),
# and KiB/MiB/GiB/TiB are binary.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, what: str = "memory_limit") -> int:
    """Parse a byte count given as a number of bytes or a string like "20GiB" or "1.5 GB".

    Raises:
        TypeError: `value` is neither a number nor a string (a bool is refused too).
        ValueError: the string cannot be parsed, or the amount is not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"{what} must be a number of bytes or a string such as '20GiB', "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{what}={value!r} cannot be parsed: write a number of bytes or a number with "
                f"a unit, e.g. '20GiB': KiB, MiB, GiB, TiB and K, M, G, T are binary (20G = 20GiB "
                f"= 20 * 2**30 bytes), KB, MB, GB, TB decimal (20GB = 20 * 10**9 bytes); "
                f"case and a space before the unit do not matter"
            )
        amount = float(match.group(1)) * _UNITS[unit]
    else:
        amount = float(value)
    if not (amount >= 1 and math.isfinite(amount)):
        raise ValueError(
            f"{what} must be a positive, finite amount of at least one byte, got {value!r}; "
            f"write e.g. {what}='20GiB'"
        )
    return int(amount)


def table_unit(largest: int | float) -> tuple[str, int]:
    """The unit a table of byte counts up to `largest` reads best in: GiB, else MiB."""
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def human(n: int | float) -> str:
    """Render bytes with the largest binary unit that keeps the number >= 1."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
