"""fs tier settings (kvtierd.tiers.fs.settings): every default is written once, in
``FsTierSettings``; its table of options (``OPTIONS``), the help text, the docs'
configuration reference (its table generated from the table at every docs build), the tier
and its I/O pool agree with it."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import tomllib

from kvtierd.ops.cli import build_parser
from kvtierd.tiers.configured import TierOptionError
from kvtierd.tiers.fs import FsTier
from kvtierd.tiers.fs.settings import DEFAULTS, OPTIONS, FsTierSettings, parse_fs_settings
from kvtierd.tiers.iopool import IoPool
from tools.docs_reference import render, tier_table

KEYS = [option.key for option in OPTIONS]
SHOWN = {option.key: option.default_text() for option in OPTIONS}

REPO = Path(__file__).resolve().parents[4]
CONFIGURATION = REPO / "docs" / "reference" / "configuration.md"


def test_the_docs_table_of_fs_options_is_the_generated_one() -> None:
    """The configuration reference asks for the table (``<!-- generated: tier fs -->``)."""
    table = tier_table("fs")
    assert table in render(CONFIGURATION.read_text())
    assert '| `capacity` | `"10GiB"` | bytes of block files of all pools together' in table


def test_the_docs_example_sets_every_fs_option_and_parses() -> None:
    section = CONFIGURATION.read_text()
    found = re.search(r"```toml\n(.*?)```", section, re.S)  # the full example
    assert found is not None
    example = found.group(1)
    tables = tomllib.loads(example)["tiers"]
    first = {k: v for k, v in tables[0].items() if k not in ("type", "name")}
    assert sorted(first) == sorted(KEYS)
    for table in tables:
        parse_fs_settings({k: v for k, v in table.items() if k not in ("type", "name")})


def test_the_quick_start_names_the_default_capacity() -> None:
    for page in (REPO / "README.md", REPO / "docs" / "getting-started.md"):
        assert f"a {DEFAULTS.capacity >> 30} GiB fs tier" in page.read_text(), page


def test_help_names_every_option_with_its_default() -> None:
    helps = {option.key: option.help_line() for option in OPTIONS}
    assert list(helps) == KEYS == [f.name for f in dataclasses.fields(FsTierSettings)]
    assert helps["root"].endswith("(required)")
    assert helps["capacity"].endswith('(default "10GiB")')
    assert helps["io_processes"].endswith(f"(default {DEFAULTS.io_processes})")
    text = " ".join(build_parser().format_help().split())  # argparse rewraps the epilog
    for option, help_text in helps.items():
        assert f"{option}: {' '.join(help_text.split())}" in text


def test_the_tier_and_its_io_pool_default_to_the_settings_defaults() -> None:
    """The keyword options of FsTier and IoPool with a default have the settings' own."""
    for cls in (FsTier, IoPool):
        parameters = inspect.signature(cls).parameters
        for option in KEYS:
            if option in parameters and parameters[option].default is not inspect.Parameter.empty:
                assert parameters[option].default == getattr(DEFAULTS, option), (cls, option)
    assert "read_threads" in inspect.signature(IoPool).parameters


def test_parsing_only_a_root_gives_every_default() -> None:
    assert parse_fs_settings({"root": "/x/"}) == dataclasses.replace(DEFAULTS, root="/x")


@pytest.mark.parametrize(
    ("option", "shown"),
    [("capacity", '"10GiB"'), ("max_queue_bytes", '"1GiB"'), ("fsync", "false"),
     ("o_direct", '"auto"'), ("read_threads", "8"), ("root", "")],
)  # fmt: skip
def test_defaults_are_shown_as_toml_values(option: str, shown: str) -> None:
    assert SHOWN[option] == shown


def test_a_shown_default_parses_back_to_the_default() -> None:
    checked = []
    for option in KEYS:
        shown = SHOWN[option]
        if shown:
            value = tomllib.loads(f"v = {shown}")["v"]
            parsed = parse_fs_settings({"root": "/x", option: value})
            assert getattr(parsed, option) == getattr(DEFAULTS, option), option
            checked.append(option)
    # every option but the root (no default) is shown, so none can be skipped unseen
    assert sorted(checked) == sorted(option for option in KEYS if option != "root")
    assert {"capacity", "max_queue_bytes", "fsync", "o_direct", "read_threads"} <= set(checked)


@pytest.mark.parametrize(
    ("options", "key", "message"),
    [
        ({}, "root", "missing: directory holding the block files"),
        ({"root": "rel"}, "root", "expected an absolute directory path, got 'rel'"),
        ({"capacity": "512KiB"}, "capacity", "must be at least 1MiB, got '512KiB'"),
        ({"capacity": "lots"}, "capacity", "lots"),
        ({"fsync": "yes"}, "fsync", "expected true or false, got 'yes'"),
        ({"o_direct": "maybe"}, "o_direct", "expected auto, on or off"),
        ({"read_threads": 257}, "read_threads", "expected an integer in [0, 256], got 257"),
        ({"read_threads": 0, "write_threads": 0}, "read_threads", "must be at least 1"),
        ({"max_queue_jobs": 0}, "max_queue_jobs", "expected an integer in [1, 1048576]"),
        ({"io_worker_timeout": "0s"}, "io_worker_timeout", "must be 10ms to 3600s, got '0s'"),
        ({"integrity_key_file": "k"}, "integrity_key_file", "expected an absolute path"),
        ({"integrity_verify_key_file": "/k"}, "integrity_verify_key_file", "needs integrity_key"),
    ],
)
def test_bad_options_name_the_option_and_what_to_write(
    options: dict[str, object], key: str, message: str
) -> None:
    with pytest.raises(TierOptionError) as caught:
        parse_fs_settings({"root": "/x", **options} if key != "root" else options)
    assert caught.value.key == key and message in caught.value.message, caught.value.message


def test_o_direct_and_the_durations_read_their_other_spellings() -> None:
    parsed = parse_fs_settings({"root": "/x", "o_direct": True, "io_worker_timeout": "500ms"})
    assert (parsed.o_direct, parsed.io_worker_timeout) == ("on", 0.5)
    assert parse_fs_settings({"root": "/x", "o_direct": False}).o_direct == "off"


def test_an_unknown_option_lists_the_known_ones() -> None:
    with pytest.raises(TierOptionError, match="unknown fs tier option; known: admission, capa"
                       ) as info:  # fmt: skip
        parse_fs_settings({"root": "/x", "threads": 4})
    assert info.value.key == "threads"


def test_admission_is_one_of_the_policies() -> None:
    assert parse_fs_settings({"root": "/x"}).admission == "always"
    assert parse_fs_settings({"root": "/x", "admission": "tinylfu"}).admission == "tinylfu"
    for bad in ("lru", True, 1):
        with pytest.raises(TierOptionError, match=r"^expected one of always, reused, tinylfu, "
                           ) as info:  # fmt: skip
            parse_fs_settings({"root": "/x", "admission": bad})
        assert info.value.key == "admission"


def test_settings_name_what_two_tiers_may_not_share() -> None:
    assert FsTierSettings(root="/a").exclusive() == {"root": "/a"}
