"""What every tier type's settings share: fields that carry their help, the
generated help and docs tables, and the checked readers of ``[[tiers]]`` values.

A tier type declares its options once, as a frozen dataclass whose fields are
made with :func:`option` (default + one line of help); ``kvtierd --help`` and the
docs' table of that type (docs/reference/configuration.md) are generated from it
(:func:`help_lines`, :func:`markdown_table`). The readers raise ``TierOptionError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from kvtierd.tiers.configured import TierOptionError
from kvtierd.util.units import parse_size

SEAL_OPTION = "integrity_key_file"  # the options of kvtierd.tiers.integrity's keys
VERIFY_OPTION = "integrity_verify_key_file"
FormatDefault = Callable[[str], str]  # option name -> its default as written in TOML ("" none)


def option(default: Any, help: str) -> Any:
    """A settings field: its default and the one line of help an operator reads."""
    return dataclasses.field(default=default, metadata={"help": help})


def help_lines(settings: type, format_default: FormatDefault) -> dict[str, str]:
    """Each option's help with its default (or "required"), in declaration order."""
    helps = {}
    for f in dataclasses.fields(settings):
        shown = format_default(f.name)
        helps[f.name] = f"{f.metadata['help']} ({f'default {shown}' if shown else 'required'})"
    return helps


def markdown_table(settings: type, format_default: FormatDefault) -> str:
    """The docs' table of a tier type's options (``| option | default | meaning |``)."""
    lines = ["| option | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(settings):
        shown = format_default(f.name)
        lines.append(
            f"| `{f.name}` | {f'`{shown}`' if shown else 'required'} | {f.metadata['help']} |"
        )
    return "\n".join(lines) + "\n"


def size_text(nbytes: int) -> str:
    """``nbytes`` with the largest binary unit that divides it ("1GiB", "4096", "0")."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def read_bool(options: Mapping[str, Any], key: str) -> bool:
    value = options[key]
    if not isinstance(value, bool):
        raise TierOptionError(key, f"expected true or false, got {value!r}")
    return value


def read_int(options: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TierOptionError(key, f"expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def read_size(
    options: Mapping[str, Any], key: str, *, minimum: int = 0, zero_allowed: bool = False
) -> int:
    """``options[key]`` as bytes (:func:`~kvtierd.util.units.parse_size`): at least
    ``minimum``, or 0 when ``zero_allowed`` (0 meaning "none")."""
    try:
        value = parse_size(options[key])
    except ValueError as exc:
        raise TierOptionError(key, str(exc)) from None
    if value < minimum and not (zero_allowed and value == 0):
        floor = f"at least {size_text(minimum)}"
        floor = f"0 (none) or {floor}" if zero_allowed else floor
        raise TierOptionError(key, f"must be {floor}, got {options[key]!r}")
    return value


def read_str(options: Mapping[str, Any], key: str) -> str:
    value = options[key]
    if not isinstance(value, str):
        raise TierOptionError(key, f"expected a string, got {value!r}")
    return value


def parse_key_options(options: Mapping[str, Any]) -> dict[str, str]:
    """The two key file options of a ``[[tiers]]`` table, checked as text (absolute
    paths; a verify key needs a sealing key). Raises TierOptionError naming one."""
    values: dict[str, str] = {}
    for name in (SEAL_OPTION, VERIFY_OPTION):
        if name not in options:
            continue
        path = options[name]
        if not isinstance(path, str) or (path and not os.path.isabs(path)):
            raise TierOptionError(name, f"expected an absolute path, got {path!r}")
        values[name] = path
    if values.get(VERIFY_OPTION) and not values.get(SEAL_OPTION):
        raise TierOptionError(
            VERIFY_OPTION, f"a key that only verifies needs {SEAL_OPTION} (the key that seals)"
        )
    return values
