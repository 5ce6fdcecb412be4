"""SGLang plug-in: kvtierd as HiCache's L3 storage backend (``KvtierdStorage``).

Requires SGLang (0.5.23); nothing else in ``kvtierd_client`` imports this package,
so the client works without SGLang installed. SGLang loads the backend with
``--hicache-storage-backend dynamic`` and the extra-config keys of
``kvtierd_client.sglang.settings.EXTRA_KEYS`` (docs/guides/sglang.md).
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
