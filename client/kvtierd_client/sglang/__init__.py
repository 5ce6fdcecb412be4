"""SGLang plug-in: kvtierd as HiCache's L3 storage backend (``KvtierdStorage``).

Requires SGLang (0.5.23); nothing else in ``kvtierd_client`` imports this package,
so the client works without SGLang installed. SGLang loads the backend with
``--hicache-storage-backend dynamic`` and the extra-config keys of
``kvtierd_client.sglang.settings.EXTRA_KEYS`` (docs/guides/sglang.md).

- ``storage``: ``KvtierdStorage``, the backend SGLang calls;
- ``settings``: what it reads from ``--hicache-storage-backend-extra-config``;
- ``pool_plan``: which kvtierd pool a rank stores its pages in, and its keys;
- ``host_pages``: an SGLang host pool's pages, per layout, as views the copy engine moves;
- ``link``: the connection to kvtierd (session generations, reconnects, failures);
- ``transfers``: one generation's data path (look pages up, load, store);
- ``metrics``: the transfer counters and SGLang's ``StorageMetrics`` made from them;
- ``quiet_log``: one log line per kind of failure and period;
- ``descriptions``: the stored pages' tokens and hashes, from SGLang's own KV events
  (``kvtierd_events = "daemon"``).

Invariants: the data path never raises into SGLang: a daemon that is down or refuses
a call turns into misses and failed stores, logged once per kind and period; a
configuration SGLang cannot serve is refused at start with one line saying what to
change.

May import: SGLang, torch and the client's public modules (``client``, ``region``,
``copy_engine``, ``engine_events``, ``errors``, ``types``, ``wire``); never
``kvtierd_client.vllm`` or the daemon.
"""

from __future__ import annotations

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without SGLang
    raise ImportError(
        "kvtierd_client.sglang is the SGLang plug-in and needs SGLang (pip install "
        "sglang); the rest of kvtierd_client works without it"
    ) from exc

from kvtierd_client.sglang.storage import KvtierdStorage, StorageStatistics

__all__ = ["KvtierdStorage", "StorageStatistics"]
