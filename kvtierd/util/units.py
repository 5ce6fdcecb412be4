"""Parsing of sizes ("8GiB", "512MiB", plain bytes) and durations ("10s", "500ms").

Only what the configuration reference documents is accepted
(docs/reference/configuration.md, "Sizes and durations"; ``SIZE_UNITS`` and
``DURATION_UNITS`` are its tables). Sizes are binary (IEC): ``KiB`` is 1024 bytes.
A decimal unit (``GB``, ``M``...) is refused, because half of its writers mean
1000 and half 1024; the message says what to write for either. A size is at most
:data:`MAX_SIZE` bytes however it is written (a TOML integer, a number of bytes in text,
a number with a unit): beyond, the same message. A duration needs its unit, except 0:
``lease = "10"`` could be seconds or milliseconds. Units are case-insensitive.
"""

from __future__ import annotations

import re
from fractions import Fraction

# unit (lower case) -> bytes; "" is a plain number of bytes
SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "eib": 1 << 60,
}
# refused units -> (the binary unit to write, the bytes of the decimal reading or 0):
# decimal ones (k, KB, G, GB...) and Kubernetes-style shorthands (Ki, Gi...)
_REFUSED_SIZE_UNITS: dict[str, tuple[str, int]] = {
    letter + suffix: (binary, 0 if suffix == "i" else 1000**power)
    for power, (letter, binary) in enumerate(
        (("k", "KiB"), ("m", "MiB"), ("g", "GiB"), ("t", "TiB"), ("p", "PiB"), ("e", "EiB")),
        start=1,
    )
    for suffix in ("", "b", "i")
}
# The largest size: an int64's (sizes cross the wire as uint64, and reach metrics and
# system calls as int64), 8EiB less one byte.
MAX_SIZE = (1 << 63) - 1
DURATION_UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
SIZE_FORMS = (
    "a number of bytes (4096) or a number with KiB, MiB, GiB, TiB, PiB or EiB ('512MiB', '8GiB')"
)
DURATION_FORMS = "a number with ms, s, m (minutes) or h ('500ms', '10s', '2m')"


def parse_size(value: str | int | float) -> int:
    """Bytes in ``value``: an int, or a number with an optional binary unit (KiB,
    MiB, GiB, TiB, PiB, EiB; B or none: bytes). A fraction with a unit is rounded down
    to whole bytes; without one it is refused.

    Raises ValueError saying what to write when the value is not one of these forms,
    decimal units (``10GB``, ``10G``) and ``Gi``-style shorthands included, or when it
    is over :data:`MAX_SIZE` (one message, whichever form said it).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return _at_most_max(value, value)
    match = _NUMBER_UNIT.match(str(value))
    if match is None:
        raise ValueError(f"expected a size: {SIZE_FORMS}; got {value!r}")
    number, unit = Fraction(match.group(1)), match.group(2).lower()
    if unit in _REFUSED_SIZE_UNITS:
        raise ValueError(_ambiguous_size(value, match.group(1), number, unit))
    if unit not in SIZE_UNITS:
        raise ValueError(f"expected a size: {SIZE_FORMS}; got {value!r}")
    if SIZE_UNITS[unit] == 1 and number.denominator != 1:
        raise ValueError(f"a size without a unit is a whole number of bytes, got {value!r}")
    return _at_most_max(value, int(number * SIZE_UNITS[unit]))


def _at_most_max(value: object, nbytes: int) -> int:
    if nbytes > MAX_SIZE:
        raise ValueError(f"a size is at most {MAX_SIZE} bytes (8EiB less one byte), got {value!r}")
    return nbytes


def _ambiguous_size(value: object, text: str, number: Fraction, unit: str) -> str:
    binary, decimal_bytes = _REFUSED_SIZE_UNITS[unit]
    message = (
        f"{value!r}: sizes are binary, write '{text}{binary}' ({text} x "
        f"{SIZE_UNITS[binary.lower()]} bytes)"
    )
    as_decimal = number * decimal_bytes
    if decimal_bytes and as_decimal.denominator == 1:  # the decimal reading, in bytes
        message += f" or {int(as_decimal)} ({text} x 10^{len(str(decimal_bytes)) - 1} bytes)"
    return message


def parse_duration(value: str | int | float) -> float:
    """Seconds in ``value``: a number with ms / s / m / min / h. A number without
    a unit is refused (seconds or milliseconds?) unless it is 0. The messages say
    what this reader takes, not an option's range: whether 0 (or 1ms) is allowed is
    the option's to say (``config.values.DurationIn``)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value}")
        if value == 0:
            return 0.0
        raise ValueError(_no_unit(value, f"{value:g}"))
    if str(value).lstrip().startswith("-"):
        raise ValueError(f"a duration cannot be negative, got {value!r}")
    match = _NUMBER_UNIT.match(str(value))
    if match is None:
        raise ValueError(f"expected a duration: {DURATION_FORMS}; got {value!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit:
        if number == 0:
            return 0.0
        raise ValueError(_no_unit(value, match.group(1)))
    if unit not in DURATION_UNITS:
        raise ValueError(f"expected a duration: {DURATION_FORMS}; got {value!r}")
    return number * DURATION_UNITS[unit]


def _no_unit(value: object, text: str) -> str:
    return f"a duration needs a unit, got {value!r}: write '{text}s' (seconds) or '{text}ms'"


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (e.g. '1.5 GiB')."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_size(n: int) -> str:
    """``n`` bytes as the configuration writes it, exactly: the largest binary unit
    that divides it ('64KiB', '1GiB'), else a plain number of bytes ('5000')."""
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        scale = SIZE_UNITS[unit.lower()]
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_duration(seconds: float) -> str:
    """``seconds`` as the configuration writes it ('10s', '500ms', '0s')."""
    if 0 < seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"
