"""How a tier type declares its options, once: each is a field of the type's frozen
settings dataclass made with :func:`option` (default, one line of help, the reader
of its value). :func:`tier_options` turns that dataclass into the type's table of
:class:`TierOption` (as :data:`kvtierd.config.OPTIONS` is the daemon's), and
everything else is derived from the table: the parser's reading of a ``[[tiers]]``
table (:func:`read_options`: unknown, missing and bad options named), the help of
``kvtierd --help`` (:meth:`TierOption.help_line`) and the docs' table of the type
(docs/reference/configuration.md: ``tools/docs_reference.py`` reads
:attr:`kvtierd.tiers.registry.TierType.options`).

Readers take a value as TOML gave it and return the typed value, or raise
``ValueError`` saying what to write instead (:meth:`TierOption.read` names the
key: :class:`~kvtierd.tiers.configured.TierOptionError`); ``show`` writes a value
back as TOML. Pure: no I/O.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.tiers.configured import TierOptionError
from kvtierd.tiers.iopool import DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_JOBS
from kvtierd.util.units import format_duration, format_size, parse_duration, parse_size

SEAL_OPTION = "integrity_key_file"  # the options of kvtierd.tiers.integrity's keys
VERIFY_OPTION = "integrity_verify_key_file"
MIN_QUEUE_BYTES = 4096  # the bounds of max_queue_bytes and max_queue_jobs
MAX_QUEUE_JOBS = 1 << 20
MIN_WRITE_BUDGET = 4096  # bytes per second: the smallest budget but 0 (none)


class Reader(abc.ABC):
    """Reads one option's value (ValueError saying what to write) and writes one back."""

    @abc.abstractmethod
    def read(self, value: Any) -> Any:
        """``value`` as TOML gave it, checked and typed."""

    def show(self, value: Any) -> str:
        """``value`` as it is written in a TOML file."""
        return toml_text(value)


@dataclass(frozen=True, slots=True)
class TierOption:
    """One option of a tier type's ``[[tiers]]`` tables (besides ``type`` and ``name``)."""

    key: str
    reader: Reader
    help: str  # one line an operator reads
    default: Any = dataclasses.MISSING  # MISSING: required

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    def default_text(self) -> str:
        """The default as written in a TOML file (``"10GiB"``, ``8``, ``false``); "" if
        the option is required."""
        return "" if self.required else self.reader.show(self.default)

    def help_line(self) -> str:
        """The help with the default (or "required"): ``kvtierd --help``'s line."""
        shown = self.default_text()
        return f"{self.help} ({f'default {shown}' if shown else 'required'})"

    def read(self, value: Any) -> Any:
        """``value`` read; TierOptionError naming this option when it is bad."""
        try:
            return self.reader.read(value)
        except ValueError as exc:
            raise TierOptionError(self.key, str(exc)) from None


def option(default: Any, help: str, reader: Reader) -> Any:
    """A settings field: its default (``dataclasses.MISSING``: required), the one line
    of help an operator reads and the reader of its value."""
    metadata = {"option": (reader, help)}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def tier_options(settings: type) -> tuple[TierOption, ...]:
    """The table of a settings dataclass whose fields are made with :func:`option`, in
    declaration order."""
    table = []
    for f in dataclasses.fields(settings):
        reader, help = f.metadata["option"]
        table.append(TierOption(f.name, reader, help, f.default))
    return tuple(table)


def read_options(
    table: tuple[TierOption, ...], options: Mapping[str, Any], type_name: str
) -> dict[str, Any]:
    """Every option given in ``options`` (a ``[[tiers]]`` table without ``type`` and
    ``name``), read. TierOptionError naming the first unknown option (listing the
    known ones), else the first required one missing or bad value, in table order."""
    known = sorted(o.key for o in table)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TierOptionError(
            unknown[0], f"unknown {type_name} tier option; known: {', '.join(known)}"
        )
    values = {}
    for o in table:
        if o.key in options:
            values[o.key] = o.read(options[o.key])
        elif o.required:
            raise TierOptionError(o.key, f"missing: {o.help}")
    return values


def queued_bytes_option() -> Any:
    """The ``max_queue_bytes`` field of a tier type whose cascades queue on an
    :class:`~kvtierd.tiers.iopool.IoPool`."""
    return option(
        DEFAULT_QUEUE_BYTES,
        "cascade bytes queued before new cascade writes are dropped",
        Size(minimum=MIN_QUEUE_BYTES),
    )


def queued_jobs_option() -> Any:
    """The ``max_queue_jobs`` field of such a tier type."""
    return option(
        DEFAULT_QUEUE_JOBS,
        "cascade jobs queued before new cascade writes are dropped",
        Whole(1, MAX_QUEUE_JOBS),
    )


def write_budget_option() -> Any:
    """The ``max_write_bytes_per_s`` field of every tier type: the budget of the
    tier's cascade writes (:mod:`kvtierd.tiers.budget`), 0 for none."""
    return option(
        0,
        "bytes per second the cascades of all pools together may write to this tier (a "
        "second of it may come at once); a block past it is not written (dropped and "
        "counted with reason budget, never queued, never delaying a store); 0 for no budget",
        Size(minimum=MIN_WRITE_BUDGET, zero_allowed=True),
    )


def sealing_key_option(help: str) -> Any:
    """The ``integrity_key_file`` field of a tier type that seals what it writes
    (:mod:`kvtierd.tiers.integrity`); ``help`` says what the key does there."""
    return option("", help, AbsolutePath())


def verifying_key_option(blocks: str) -> Any:
    """The ``integrity_verify_key_file`` field of such a tier type (``blocks``: what
    it calls its blocks, "files" or "values")."""
    return option(
        "",
        f"a second key whose {blocks} verify too (never used to write): a key rotation",
        AbsolutePath(),
    )


ADMISSION_POLICIES = ("always", "reused", "tinylfu")  # kvtierd.tiering.admission runs them


def admission_option() -> Any:
    """The ``admission`` field of a tier type: which completed blocks it is written
    (:mod:`kvtierd.tiering.admission`, docs/design/admission.md)."""
    return option(
        "always",
        "which blocks are written to the tier: always (every stored block), reused (a "
        "block once it is loaded again from the primary) or tinylfu (a block seen more "
        "often than the one it would displace, by a frequency sketch)",
        OneOf(ADMISSION_POLICIES),
    )


def check_key_options(values: Mapping[str, Any]) -> None:
    """A key that only verifies needs the key that seals; TierOptionError otherwise."""
    if values.get(VERIFY_OPTION) and not values.get(SEAL_OPTION):
        raise TierOptionError(
            VERIFY_OPTION, f"a key that only verifies needs {SEAL_OPTION} (the key that seals)"
        )


def toml_text(value: Any) -> str:
    """``value`` (a bool, number, string or tuple of strings) as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_text(item) for item in value) + "]"
    return str(value)


# -- readers --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OfType(Reader):
    """A value of one TOML type, as it is: :data:`FLAG`, :data:`TEXT`."""

    kind: type
    words: str  # how a message names it

    def read(self, value: Any) -> Any:
        if not isinstance(value, self.kind):
            raise ValueError(f"expected {self.words}, got {value!r}")
        return value


FLAG = OfType(bool, "true or false")
TEXT = OfType(str, "a string")


@dataclass(frozen=True, slots=True)
class Whole(Reader):
    """An integer in ``[lo, hi]``."""

    lo: int
    hi: int

    def read(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            raise ValueError(f"expected an integer in [{self.lo}, {self.hi}], got {value!r}")
        return value


@dataclass(frozen=True, slots=True)
class Size(Reader):
    """Bytes (:func:`~kvtierd.util.units.parse_size`: ``"10GiB"``, ``4096``): at least
    ``minimum``, or 0 when ``zero_allowed`` (0 meaning "none")."""

    minimum: int = 0
    zero_allowed: bool = False

    def read(self, value: Any) -> int:
        nbytes = parse_size(value)
        if nbytes < self.minimum and not (self.zero_allowed and nbytes == 0):
            floor = f"at least {format_size(self.minimum)}"
            floor = f"0 (none) or {floor}" if self.zero_allowed else floor
            raise ValueError(f"must be {floor}, got {value!r}")
        return nbytes

    def show(self, value: int) -> str:
        return f'"{format_size(value)}"'


@dataclass(frozen=True, slots=True)
class Seconds(Reader):
    """A duration (:func:`~kvtierd.util.units.parse_duration`: ``"1.5s"``, ``"500ms"``)
    in ``[lo, hi]``; with ``positive`` more than 0 (``lo`` 0); with ``zero_allowed`` also
    0 (meaning "none")."""

    lo: float = 0.0
    hi: float = math.inf
    positive: bool = False
    zero_allowed: bool = False

    def read(self, value: Any) -> float:
        seconds = parse_duration(value)
        fits = self.lo <= seconds <= self.hi and not (self.positive and seconds == 0)
        if not fits and not (self.zero_allowed and seconds == 0):
            raise ValueError(f"must be {self._span()}, got {value!r}")
        return seconds

    def _span(self) -> str:
        lo, hi = format_duration(self.lo), format_duration(self.hi)
        span = f"{lo} to {hi}" if self.hi < math.inf else f"{lo} or more"
        span = f"more than {lo}" if self.positive else span
        return f"0s (none) or {span}" if self.zero_allowed else span

    def show(self, value: float) -> str:
        return f'"{value:g}s"'


@dataclass(frozen=True, slots=True)
class Choice(Reader):
    """One of ``choices``; true and false stand for the first and second of ``flags``.
    ``expected``: the choices as the message of a bad value words them."""

    choices: tuple[str, ...]
    flags: tuple[str, str]
    expected: str

    def read(self, value: Any) -> str:
        if isinstance(value, bool):
            value = self.flags[0] if value else self.flags[1]
        if value not in self.choices:
            raise ValueError(f"expected {self.expected}, got {value!r}")
        return str(value)


@dataclass(frozen=True, slots=True)
class OneOf(Reader):
    """One of ``choices`` (strings), nothing else."""

    choices: tuple[str, ...]

    def read(self, value: Any) -> str:
        if not isinstance(value, str) or value not in self.choices:
            raise ValueError(f"expected one of {', '.join(self.choices)}, got {value!r}")
        return value


class AbsolutePath(Reader):
    """An absolute path, or "" for none."""

    def read(self, value: Any) -> str:
        path: str = TEXT.read(value)
        if path and not os.path.isabs(path):
            raise ValueError(f"expected an absolute path, got {path!r}")
        return path
