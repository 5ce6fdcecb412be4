"""What the SGLang backend reads from ``--hicache-storage-backend-extra-config``.

Pure functions over a mapping (this module imports nothing from SGLang), so the
keys are checked and documented in one place. ``backend_name``, ``module_path``,
``class_name`` and ``interface_v1`` are SGLang's own (its dynamic backend factory
and its cache controller read them); the ``kvtierd_*`` keys and
``eviction_policy`` are this backend's. :data:`EXTRA_KEYS` is the table
docs/guides/sglang.md shows; a test checks that both list the same keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd_client._extra_config import (
    DEFAULT_DESCRIPTION_BYTES,
    DEFAULT_ENGINE_EVENTS,
    POLICY_HELP,
    ExtraConfig,
)
from kvtierd_client.client import DEFAULT_TIMEOUT

__all__ = ["EXTRA_KEYS", "SettingsError", "StorageSettings"]

EXTRA_KEYS: dict[str, str] = {
    "backend_name": '"kvtierd" (SGLang: the name it logs for a dynamic backend)',
    "module_path": '"kvtierd_client.sglang" (SGLang imports the class from it)',
    "class_name": '"KvtierdStorage"',
    "interface_v1": "1: SGLang's controller uses the zero-copy batch_exists / batch_get_v1 / "
    "batch_set_v1 (0 or absent: the generic get / set through flat staging pages)",
    "kvtierd_address": "daemon address (unix:///abs/path, /abs/path or host:port); default "
    "$KVTIERD_ADDRESS, else the daemon's default socket",
    "kvtierd_pool_bytes": "bytes of rows for this model on this daemon, all TP ranks together "
    "(MHA: each rank's pool gets this / tp_size; MLA: the one shared pool); absent: the "
    "daemon's default_pool_blocks per pool",
    "kvtierd_pool": "pool name prefix (default derived from the model and parallel layout)",
    "kvtierd_timeout": "seconds each RPC may take (default 5)",
    "kvtierd_retry_interval": "seconds of misses after the daemon failed or refused, before "
    "it is asked again (default 1)",
    "kvtierd_load_wait": "seconds batch_get_v1 waits for pages the daemon is still promoting "
    "from a secondary tier (HIT_PENDING) before it reports them not loaded (default 1)",
    "kvtierd_log_interval": "seconds between two log lines of one kind of failure "
    "(default 30); the next line says how many were left out",
    "kvtierd_token": "bearer token (TCP daemons only)",
    "eviction_policy": f"{POLICY_HELP}; fixed by the engine that creates the pool",
    "kvtierd_events": "\"daemon\": the daemon's [kv_events] publisher announces the pool's "
    "pages to KV-aware routers, and each stored page goes with its tokens and hashes, read "
    'from SGLang\'s own GPU KV events (--kv-events-config); "engine" (default): pages are '
    "stored undescribed (SGLang publishes none of its storage tier)",
    "kvtierd_engine_events": 'with kvtierd_events = "daemon": the endpoint of SGLang\'s '
    '--kv-events-config as given there (default "tcp://*:5557"); the backend subscribes to '
    "it on this host (a wildcard host is 127.0.0.1; attention-DP ranks offset the port as "
    "SGLang does)",
    "kvtierd_description_bytes": 'with kvtierd_events = "daemon": bytes of the pages '
    "remembered from SGLang's GPU events until they are stored (default 16 MiB; the least "
    "recently used go first; a page forgotten is stored undescribed)",
}
"""Every extra-config key this backend (and SGLang, for it) reads, with its meaning."""

_PREFIX = "--hicache-storage-backend-extra-config"


class SettingsError(ValueError):
    """An extra-config value this backend cannot use; the message names the key."""


@dataclass(frozen=True)
class StorageSettings:
    """The backend's extra-config keys, validated. Seconds are floats >= 0."""

    address: str
    pool_bytes: int  # 0: the daemon's default_pool_blocks per pool
    pool_prefix: str | None
    timeout: float
    retry_interval: float
    load_wait: float
    log_interval: float
    token: str | None
    eviction_policy: str
    interface_v1: bool
    events: str = "engine"  # "engine" or "daemon" (kvtierd_events)
    engine_events: str = DEFAULT_ENGINE_EVENTS
    description_bytes: int = DEFAULT_DESCRIPTION_BYTES

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        """Reads and checks the keys; :class:`SettingsError` naming the key otherwise."""
        config = ExtraConfig(extra, lambda key: f"{_PREFIX} {key}", SettingsError)
        return cls(
            address=config.address(),
            pool_bytes=config.byte_count("kvtierd_pool_bytes"),
            pool_prefix=config.name("kvtierd_pool"),
            timeout=config.seconds("kvtierd_timeout", DEFAULT_TIMEOUT, minimum=0.001),
            retry_interval=config.seconds("kvtierd_retry_interval", 1.0, minimum=0.0),
            load_wait=config.seconds("kvtierd_load_wait", 1.0, minimum=0.0),
            log_interval=config.seconds("kvtierd_log_interval", 30.0, minimum=0.0),
            token=config.name("kvtierd_token"),
            eviction_policy=config.eviction_policy(),
            interface_v1=_flag(config, "interface_v1"),
            events=config.events_publisher(),
            engine_events=config.engine_events(),
            description_bytes=config.description_bytes(),
        )


def _flag(config: ExtraConfig, key: str) -> bool:
    """SGLang's 1 or 0 (any integer, true/false, or their words as text); False when
    absent or empty."""
    raw = config.values.get(key)
    if raw is None:
        return False
    if isinstance(raw, (bool, int)):
        return bool(raw)
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", ""):
        return False
    config.fail(key, f"expected 1 or 0, got {raw!r}")
