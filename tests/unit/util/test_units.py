from __future__ import annotations

import pytest

from kvtierd.util.units import format_bytes, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096), (4096, 4096), ("8GiB", 8 << 30), ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000), ("64 KiB", 64 << 10), ("2tib", 2 << 40), ("10b", 10),
    ],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", -1, "8 parsecs", True, "1e9", "1..5GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), ("3", 3.0), (1.5, 1.5)],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["ten", "10 years", "", -2, False])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 30) == "3.0 GiB"
