"""The readers of the configuration's values: each takes what a TOML file, an
environment variable or a flag gave and returns the typed value, or raises
ValueError saying what to write instead (the loader names the key)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from kvtierd.util.units import (
    format_bytes,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)


def int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer in [{lo}, {hi}], got {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer in [{lo}, {hi}], got {value!r}") from None
        if not lo <= number <= hi:
            raise ValueError(f"must be in [{lo}, {hi}], got {number}")
        return number

    return parse


class SizeIn:
    """A size option's parser: bytes in [lo, hi] (``units.parse_size``)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, value: Any) -> int:
        number = parse_size(value)
        if not self.lo <= number <= self.hi:
            raise ValueError(
                f"must be between {format_bytes(self.lo)} and {format_bytes(self.hi)}, "
                f"got {value!r}"
            )
        return number

    @staticmethod
    def show(value: int) -> str:
        return format_size(value)


class DurationIn:
    """A duration option's parser: seconds in [lo, hi] (``units.parse_duration``)."""

    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, value: Any) -> float:
        try:
            seconds = parse_duration(value)
        except ValueError as exc:  # the form refused: the range says what to write
            raise ValueError(f"{exc}; {self._range()}") from None
        if not self.lo <= seconds <= self.hi:
            raise ValueError(f"must be between {self.lo:g}s and {self.hi:g}s, got {value!r}")
        return seconds

    def _range(self) -> str:
        """What this option takes, 0 included only where it is (``lease = 0`` is not)."""
        return f"write one between {self.lo:g}s and {self.hi:g}s"

    @staticmethod
    def show(value: float) -> str:
        return format_duration(value)


def choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).lower()
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return text

    return parse


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def plain_text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def abs_file_or_empty(value: Any) -> str:
    text = plain_text(value)
    if text and not os.path.isabs(text):
        raise ValueError(f"expected an absolute file path or '', got {value!r}")
    return text


def directory(value: Any) -> str:
    text = plain_text(value)
    if not text or not os.path.isabs(text):
        raise ValueError(f"expected an absolute directory path, got {value!r}")
    return text


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


# sockaddr_un.sun_path holds 107 bytes and a NUL; the daemon also binds sockets named
# <path> + ".regions" / ".tickets" / ".lane" (region_access, tickets, fastlane)
_MAX_UNIX_PATH_BYTES = 107 - len(".regions")


def parse_listen_address(value: str) -> str:
    """A normalized listen address: ``unix:///abs/path`` (at most
    :data:`_MAX_UNIX_PATH_BYTES` bytes, so the sockets next to it fit too) or
    ``host:port``."""
    text = plain_text(value).strip()
    if text.startswith("unix://"):
        path = text[len("unix://") :]
        if not os.path.isabs(path):
            raise ValueError(f"a unix socket path must be absolute, got {value!r}")
        if len(os.fsencode(path)) > _MAX_UNIX_PATH_BYTES:
            raise ValueError(
                f"a unix socket path is at most {_MAX_UNIX_PATH_BYTES} bytes (the sockets "
                f"next to it add '.regions' within the kernel's 107), got "
                f"{len(os.fsencode(path))}: {path!r}; use a shorter directory"
            )
        return "unix://" + path
    match = _HOST_PORT.match(text)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"expected 'unix:///abs/path' or 'HOST:PORT', got {value!r}")
    return text


def listen_list(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError("expected a non-empty list of 'unix:///abs/path' or 'HOST:PORT'")
    return tuple(parse_listen_address(item) for item in items)


def metrics_address_value(value: Any) -> str:
    text = plain_text(value).strip()
    if text and _HOST_PORT.match(text) is None:
        raise ValueError(f"expected 'HOST:PORT' or '' (off), got {value!r}")
    return text


MAX_POOL_LABEL_PATTERNS = 256


def pool_label_patterns(value: Any) -> tuple[str, ...] | None:
    """``server.metrics_pool_labels``: "auto" (None: decided by whether principals are
    configured), or pool name globs: a TOML list, or a comma-separated string
    (environment, flag; "" shows no pool)."""
    if value == "auto":
        return None
    items = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) > MAX_POOL_LABEL_PATTERNS:
        raise ValueError(
            f'expected "auto" or a list of at most {MAX_POOL_LABEL_PATTERNS} pool name globs '
            f'(["team-a/*"]), got {value!r}'
        )
    for item in items:
        if not isinstance(item, str) or not 0 < len(item) <= 256:
            raise ValueError(f"expected pool name globs of 1 to 256 characters, got {item!r}")
    return tuple(items)


_EVENT_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+|\*):([0-9]{1,5})$")
MAX_EVENT_NAMES = 256


def event_endpoint(value: Any) -> str:
    """``kv_events.endpoint`` / ``replay_endpoint``: '' (none), ``tcp://HOST:PORT`` or
    ``ipc:///abs/path`` (a ZeroMQ address)."""
    text = plain_text(value).strip()
    if not text:
        return ""
    if text.startswith("ipc://"):
        path = text[len("ipc://") :]
        if not os.path.isabs(path) or len(os.fsencode(path)) > 107:
            raise ValueError(f"expected ipc:///abs/path (at most 107 bytes), got {value!r}")
        return text
    match = _EVENT_TCP.match(text)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"expected '', 'tcp://HOST:PORT' or 'ipc:///abs/path', got {value!r}")
    return text


def name_list(value: Any) -> tuple[str, ...]:
    """A list of names (pools, engine identities): a TOML list, or a comma-separated
    string (environment); each 1 to 256 printable characters without '@' or spaces
    (a KV-event topic is kv@<identity>@<model>)."""
    items = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) > MAX_EVENT_NAMES:
        raise ValueError(f"expected a list of at most {MAX_EVENT_NAMES} names, got {value!r}")
    for item in items:
        if not isinstance(item, str) or not 0 < len(item) <= 256 or not item.isprintable():
            raise ValueError(f"expected names of 1 to 256 printable characters, got {item!r}")
        if "@" in item or " " in item:
            raise ValueError(f"a name cannot hold '@' or a space (kv@<name>@<model>): {item!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"a name is listed twice in {value!r}")
    return tuple(items)


def topic_part(value: Any) -> str:
    """``kv_events.model`` / ``identity``: printable, no '@' (a topic's separator)."""
    text = plain_text(value)
    if "@" in text or not text.isprintable() or len(text) > 256:
        raise ValueError(f"expected at most 256 printable characters without '@', got {value!r}")
    return text
