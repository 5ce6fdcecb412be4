"""Parsing of sizes ("8GiB", "512MiB", plain bytes) and durations ("10s", "500ms")."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes in ``value``: an int, or a number with an optional unit (KiB, MB, GiB...).

    Raises ValueError with the accepted forms when the value is not one of them.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    match = _NUMBER_UNIT.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"expected a size such as 4096, '512MiB', '8GiB' or '1.5GB', got {value!r}"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(value: str | int | float) -> float:
    """Seconds in ``value``: a number of seconds, or a number with ms / s / m / h."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value}")
        return float(value)
    match = _NUMBER_UNIT.match(str(value))
    unit = (match.group(2).lower() or "s") if match else None
    if match is None or unit not in _DURATION_UNITS:
        raise ValueError(f"expected a duration such as '10s', '500ms' or '2m', got {value!r}")
    return float(match.group(1)) * _DURATION_UNITS[unit]


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (e.g. '1.5 GiB')."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
