"""The engines' extra config, read the same way for both plug-ins: vLLM's
``kv_connector_extra_config`` (:mod:`kvtierd_client.vllm.settings`) and SGLang's
``--hicache-storage-backend-extra-config`` (:mod:`kvtierd_client.sglang.settings`).

:class:`ExtraConfig` reads the keys both plug-ins share (the daemon's address, the
pool's eviction policy) and the kinds of value both check alike (seconds, byte
counts, names); a bad value raises the plug-in's error with a message naming the
key as its engine's docs spell it. What only one engine means by a key (a flag's
spelling) stays in that plug-in's settings.

Pure: nothing from vLLM or SGLang is imported, nothing is done but reading.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from kvtierd_client.wire.address import default_address, to_grpc_target
from kvtierd_client.wire.results import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES

POLICY_HELP = " or ".join(
    [f"'{DEFAULT_EVICTION_POLICY}' (default)"]
    + [f"'{name}'" for name in EVICTION_POLICIES if name != DEFAULT_EVICTION_POLICY]
)
"""The eviction policies as the plug-ins' key tables word them: "'lru' (default) or 'arc'"."""

EVENT_PUBLISHERS = ("engine", "daemon")
"""Values of ``kvtierd_events``: who publishes the pool's blocks to KV-aware routers."""
DEFAULT_ENGINE_EVENTS = "tcp://*:5557"
"""The engines' default KV-event endpoint (vLLM's and SGLang's ``--kv-events-config``)."""
DEFAULT_DESCRIPTION_BYTES = 16 << 20
MIN_DESCRIPTION_BYTES = 64 << 10


class ExtraConfig:
    """One engine's extra config (a mapping of keys to what the engine passed).

    ``where(key)`` is how the engine's docs name a key in a message
    (``kv_connector_extra_config.kvtierd_timeout``); ``error`` is the ValueError the
    plug-in raises for a bad value.
    """

    def __init__(
        self,
        values: Mapping[str, Any] | None,
        where: Callable[[str], str],
        error: type[ValueError] = ValueError,
    ) -> None:
        self.values: Mapping[str, Any] = dict(values or {})
        self._where = where
        self._error = error

    def fail(self, key: str, message: str) -> NoReturn:
        """Raises the plug-in's error: ``<where key>: <message>``."""
        raise self._error(f"{self._where(key)}: {message}")

    def address(self) -> str:
        """``kvtierd_address``: where the daemon listens (default ``$KVTIERD_ADDRESS``,
        else the daemon's default socket), checked as a gRPC target."""
        address = str(self.values.get("kvtierd_address") or default_address())
        try:
            to_grpc_target(address)
        except ValueError as err:
            self.fail("kvtierd_address", str(err))
        return address

    def eviction_policy(self) -> str:
        """``eviction_policy``: one of the daemon's policies (any case), the default
        when absent or empty."""
        raw = self.values.get("eviction_policy")
        policy = str(raw or DEFAULT_EVICTION_POLICY).lower()
        if policy not in EVICTION_POLICIES:
            supported = " and ".join(f"'{name}'" for name in EVICTION_POLICIES)
            self.fail("eviction_policy", f"kvtierd supports {supported}, got {raw!r}")
        return policy

    def seconds(self, key: str, default: float, minimum: float) -> float:
        """A finite number of seconds >= ``minimum`` (``default`` when absent)."""
        raw = self.values.get(key)
        if raw is None:
            return default
        try:
            value = float(raw)
        except (TypeError, ValueError):
            value = float("nan")
        if isinstance(raw, bool) or not value >= minimum or math.isinf(value):
            self.fail(key, f"expected seconds >= {minimum}, got {raw!r}")
        return value

    def byte_count(self, key: str) -> int:
        """A whole number >= 0 (0 when absent)."""
        raw = self.values.get(key)
        if raw is None:
            return 0
        try:
            value = int(raw)
        except (TypeError, ValueError):
            value = -1
        if value < 0 or isinstance(raw, bool) or (isinstance(raw, float) and raw != value):
            self.fail(key, f"expected a non-negative integer, got {raw!r}")
        return value

    def events_publisher(self) -> str:
        """``kvtierd_events``: "engine" (default) or "daemon" (any case)."""
        raw = self.values.get("kvtierd_events")
        value = str(raw or "engine").strip().lower()
        if value not in EVENT_PUBLISHERS:
            self.fail("kvtierd_events", f'expected "engine" or "daemon", got {raw!r}')
        return value

    def engine_events(self) -> str:
        """``kvtierd_engine_events``: the engine's KV-event endpoint as its config
        spells it (``tcp://HOST:PORT`` or ``ipc://PATH``; default ``tcp://*:5557``)."""
        key = "kvtierd_engine_events"
        value = str(self.values.get(key) or DEFAULT_ENGINE_EVENTS)
        if value.startswith("ipc://") and len(value) > 6:
            return value
        host, _, port = value.removeprefix("tcp://").rpartition(":")
        if not value.startswith("tcp://") or not host or not port.isdigit():
            self.fail(key, f"expected tcp://HOST:PORT or ipc://PATH, got {value!r}")
        return value

    def description_bytes(self) -> int:
        """``kvtierd_description_bytes``: at least 64 KiB (default 16 MiB)."""
        key = "kvtierd_description_bytes"
        value = self.byte_count(key) or DEFAULT_DESCRIPTION_BYTES
        if value < MIN_DESCRIPTION_BYTES:
            self.fail(key, f"expected at least {MIN_DESCRIPTION_BYTES} bytes, got {value}")
        return value

    def name(self, key: str) -> str | None:
        """The value as text, None when absent or empty."""
        raw = self.values.get(key)
        return str(raw) if raw else None
