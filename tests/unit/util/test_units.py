"""Sizes are binary (IEC) and a duration needs its unit: only what the configuration
reference documents is accepted; decimal or shorthand units and unitless durations
are refused with a message saying what to write (issue #31)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtierd.util.units import (
    DURATION_UNITS,
    MAX_SIZE,
    SIZE_UNITS,
    format_bytes,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)

CONFIGURATION = Path(__file__).resolve().parents[3] / "docs" / "reference" / "configuration.md"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096), (4096, 4096), ("8GiB", 8 << 30), ("512MiB", 512 << 20),
        ("1.5GiB", 3 << 29), ("64 KiB", 64 << 10), ("2tib", 2 << 40), ("10b", 10),
        ("10 B", 10), ("1PiB", 1 << 50), ("0.5KiB", 512), ("1.0", 1), (0, 0),
    ],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", -1, "8 parsecs", True, "1e9", "1..5GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # "10 GB" and "10GB" were 10,000,000,000 bytes without a word
        ("10 GB", "'10 GB': sizes are binary, write '10GiB' (10 x 1073741824 bytes) or "
                  "10000000000 (10 x 10^9 bytes)"),
        ("10GB", "write '10GiB' (10 x 1073741824 bytes) or 10000000000 (10 x 10^9 bytes)"),
        ("10G", "write '10GiB'"),
        ("1.5gb", "write '1.5GiB' (1.5 x 1073741824 bytes) or 1500000000 (1.5 x 10^9 bytes)"),
        ("512mb", "write '512MiB' (512 x 1048576 bytes) or 512000000 (512 x 10^6 bytes)"),
        ("4k", "write '4KiB' (4 x 1024 bytes) or 4000 (4 x 10^3 bytes)"),
        ("2TB", "write '2TiB'"),
        ("16Gi", "'16Gi': sizes are binary, write '16GiB' (16 x 1073741824 bytes)"),
    ],
)  # fmt: skip
def test_decimal_and_shorthand_units_are_refused_saying_what_to_write(text, message):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert message in str(info.value)


def test_a_fraction_of_a_byte_is_refused():
    with pytest.raises(ValueError, match="a size without a unit is a whole number of bytes"):
        parse_size("1.5")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1min", 60.0), ("1h", 3600.0),
        ("1.5s", 1.5), ("0", 0.0), (0, 0.0), ("0.0", 0.0), ("10 S", 10.0),
    ],
)  # fmt: skip
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["ten", "10 years", "", -2, False, "-1s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("value", "shown"), [("-5s", "'-5s'"), (" -0.5ms", "' -0.5ms'"), (-2, "-2")]
)
def test_a_negative_duration_is_named_negative(value, shown):
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert str(info.value) == f"a duration cannot be negative, got {shown}"


@pytest.mark.parametrize(
    ("value", "shown"), [("10", "'10'"), (10, "10"), (1.5, "1.5"), ("0.5", "'0.5'")]
)
def test_a_duration_without_a_unit_is_refused(value, shown):
    """``lease = "10"`` was 10 s: seconds or milliseconds is the reader's guess."""
    number = str(value)
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert str(info.value) == (
        f"a duration needs a unit, got {shown}: write '{number}s' (seconds) or '{number}ms'"
    )


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 30) == "3.0 GiB"


@pytest.mark.parametrize(
    "size", [1 << 30, 64 << 10, 16 << 20, 5000, 0, 3 << 29, 1 << 50, (1 << 40) + 1]
)
def test_format_size_is_exact_and_parses_back(size):
    assert parse_size(format_size(size)) == size


def test_format_duration():
    assert [format_duration(s) for s in (10.0, 0.1, 0.0, 2.0, 3600.0)] == [
        "10s", "100ms", "0s", "2s", "3600s",
    ]  # fmt: skip


def test_the_docs_tables_of_units_are_what_is_accepted():
    """The configuration reference lists exactly the units the parser accepts, with
    their values."""
    text = CONFIGURATION.read_text()
    section = text[text.index("## Sizes and durations") :]
    section = section[: section.index("\n#", 1)]
    sizes = re.findall(r"^\| `(\w+)` \| ([0-9]+) bytes?", section, re.M)
    durations = re.findall(r"^\| `(\w+)` \| ([0-9.]+) s\b", section, re.M)
    assert {unit.lower(): int(n) for unit, n in sizes} == {
        unit: n for unit, n in SIZE_UNITS.items() if unit
    }
    assert {unit: float(n) for unit, n in durations} == DURATION_UNITS


@pytest.mark.parametrize("value", [2**64, "16EiB", str(2**64), "16384PiB", 2**70, 2**63, "8EiB"])
def test_a_size_beyond_the_largest_is_refused_alike_in_every_form(value):
    """A TOML integer of 2^70 was taken as is (a fleet_capacity of 1 ZiB) while
    "16EiB" was refused: now every form past MAX_SIZE gets one message."""
    message = f"a size is at most {MAX_SIZE} bytes (8EiB less one byte), got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_size(value)


def test_the_largest_size_is_accepted_in_every_form():
    assert parse_size(MAX_SIZE) == parse_size(str(MAX_SIZE)) == MAX_SIZE
    assert parse_size("7EiB") == 7 << 60 and parse_size("8191PiB") == 8191 << 50
