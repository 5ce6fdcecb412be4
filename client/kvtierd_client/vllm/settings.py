"""What the vLLM plug-in reads from ``kv_connector_extra_config`` and how it derives its pool.

Pure functions over vLLM's ``OffloadingConfig`` (duck-typed: this module imports
nothing from vLLM, so it is importable and testable without it).

Pool identity (who shares blocks with whom):

* the pool *name* is ``vllm/<model>/<parallel layout>/<fingerprint hash>``; the
  fingerprint hash is part of the name, so engines with another model, dtype,
  block size, chunking, KV layout or world size land in *another* pool instead of
  failing against this one;
* the *layout* string (the daemon's pool fingerprint, compared on every join) spells
  out everything the bytes of a row depend on;
* data-parallel replicas and restarted engines of the same model and layout derive
  the same name and layout, so they share one pool and each other's blocks.

Row layout (``block_bytes`` = row stride, a multiple of 4096)::

    row (one chunk): [ rank 0 page | rank 1 page | ... | rank W-1 page | pad ]
    rank page:       [ sub-block 0 | sub-block 1 | ... | sub-block bpc-1 ]
    sub-block:       [ tensor 0 page | tensor 1 page | ... ]  (worker_kv_bytes_per_block)

so the pages of one GPU block are contiguous and rank ``r``'s sub-block ``j`` is
the copy engine "rank" ``r * blocks_per_chunk + j`` with ``page_bytes =
worker_kv_bytes_per_block``.
"""

from __future__ import annotations

import hashlib
import math
import re
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

__all__ = [
    "EXTRA_KEYS",
    "LAYOUT_VERSION",
    "PluginSettings",
    "PoolPlan",
    "plan_pool",
]

ROW_ALIGNMENT = 4096
LAYOUT_VERSION = "kvtierd-vllm/1"
"""Bumped whenever the row layout written by the worker changes."""
DEFAULT_FLUSH_AFTER = 0.1
"""Seconds (``kvtierd_flush_after``): longer than a scheduler step (10-50 ms), so a
stepping engine's completions ride on its next call instead of being sent alone."""

_POOL_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_POOL_NAME = 128

EXTRA_KEYS: dict[str, str] = {
    "kvtierd_address": "daemon address (unix:///abs/path, /abs/path or host:port); "
    "default $KVTIERD_ADDRESS or the daemon's default socket",
    "kvtierd_timeout": "seconds each RPC may take (default 5)",
    "kvtierd_start_timeout": "seconds the engine waits at start for the daemon to answer "
    "(default 10); then it fails with an error naming the address",
    "kvtierd_retry_interval": "seconds the scheduler serves misses after the daemon failed, "
    "before it tries again (default 1)",
    "kvtierd_stats_interval": "seconds between two GetStats calls feeding the pool gauges "
    "(default 10; 0 turns them off)",
    "kvtierd_flush_after": "seconds a queued completion (complete_store / complete_load / "
    "touch) may wait for the scheduler's next daemon call before it is sent alone "
    "(default 0.1); while the engine steps, completions ride on the next call or are "
    "sent at the latest two scheduler steps later",
    "kvtierd_pool": "pool name; default derived from the model and parallel layout",
    "kvtierd_token": "bearer token (TCP daemons only)",
    "cpu_bytes_to_use": "pool capacity in bytes (rows = this // row stride); "
    "absent: the daemon's default_pool_blocks",
    "eviction_policy": f"{POLICY_HELP}; fixed by the first engine that creates the pool",
    "kvtierd_store_ahead": "true (default): a request's first lookup also reserves the rows of "
    "its chain's missing blocks in the same round trip, and vLLM's prepare_store of them is "
    "answered without one (kvtierd_client.vllm.store_ahead); false: prepare_store asks",
    "kvtierd_events": 'who publishes the pool\'s blocks to KV-aware routers: "engine" '
    "(default: with vLLM's KV events on, vLLM republishes the pool's stores and removals, "
    'those of other engines as token-less placeholders) or "daemon" (the daemon\'s '
    "[kv_events] publisher does; vLLM publishes only its GPU blocks, and the plug-in "
    "describes each store with the tokens of vLLM's own GPU events)",
    "kvtierd_engine_events": 'with kvtierd_events = "daemon": the endpoint of vLLM\'s '
    '--kv-events-config as given there (default "tcp://*:5557"); the plug-in subscribes '
    "to it on this host (a wildcard host is 127.0.0.1; data-parallel ranks offset the port "
    "as vLLM does)",
    "kvtierd_description_bytes": 'with kvtierd_events = "daemon": bytes of the blocks '
    "remembered from vLLM's GPU events until they are stored (default 16 MiB; the least "
    "recently used go first; a store whose blocks were forgotten is sent undescribed)",
}
"""The ``kv_connector_extra_config`` keys this plug-in reads, with their meaning."""


@dataclass(frozen=True)
class PluginSettings:
    """The plug-in's extra config keys, validated."""

    address: str
    timeout: float
    start_timeout: float
    retry_interval: float
    stats_interval: float
    flush_after: float
    pool_name: str | None
    token: str | None
    capacity_bytes: int
    eviction_policy: str
    store_ahead: bool = True
    events: str = "engine"  # one of EVENT_PUBLISHERS
    engine_events: str = DEFAULT_ENGINE_EVENTS
    description_bytes: int = DEFAULT_DESCRIPTION_BYTES

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> PluginSettings:
        """Reads and checks the keys; ValueError naming the key for a bad value."""
        config = ExtraConfig(extra, lambda key: f"kv_connector_extra_config.{key}")
        return cls(
            address=config.address(),
            timeout=config.seconds("kvtierd_timeout", DEFAULT_TIMEOUT, minimum=0.001),
            start_timeout=config.seconds("kvtierd_start_timeout", 10.0, minimum=0.0),
            retry_interval=config.seconds("kvtierd_retry_interval", 1.0, minimum=0.0),
            stats_interval=config.seconds("kvtierd_stats_interval", 10.0, minimum=0.0),
            flush_after=config.seconds("kvtierd_flush_after", DEFAULT_FLUSH_AFTER, minimum=0.0),
            pool_name=config.name("kvtierd_pool"),
            token=config.name("kvtierd_token"),
            capacity_bytes=config.byte_count("cpu_bytes_to_use"),
            eviction_policy=config.eviction_policy(),
            store_ahead=_flag(config, "kvtierd_store_ahead", True),
            events=config.events_publisher(),
            engine_events=config.engine_events(),
            description_bytes=config.description_bytes(),
        )


@dataclass(frozen=True)
class PoolPlan:
    """The pool an engine opens and how its workers lay out rows.

    Invariant: ``block_bytes >= world_size * rank_page_bytes`` and is a multiple of
    4096; ``rank_page_bytes == blocks_per_chunk * sub_block_bytes``.
    """

    name: str
    block_bytes: int
    num_blocks: int  # 0: the daemon's default
    layout: str
    world_size: int
    blocks_per_chunk: int
    sub_block_bytes: int  # one GPU block of one rank: worker_kv_bytes_per_block

    @property
    def rank_page_bytes(self) -> int:
        return self.blocks_per_chunk * self.sub_block_bytes


def plan_pool(config: Any, settings: PluginSettings) -> PoolPlan:
    """The pool for vLLM's ``OffloadingConfig`` ``config``.

    Raises ValueError when the configuration cannot be offloaded to kvtierd (no KV
    bytes, canonical layout, a row over 1 GiB).
    """
    if getattr(config, "canonical_layout", False):
        raise ValueError(
            "kvtierd: canonical_layout=true is not supported by KvtierdOffloadingSpec; "
            "remove it from kv_connector_extra_config"
        )
    sub_block = int(config.worker_kv_bytes_per_block)
    parallel = config.parallel
    world = int(parallel.world_size)
    bpc = int(config.cache.blocks_per_chunk)
    if sub_block <= 0 or world <= 0 or bpc <= 0:
        raise ValueError(
            f"kvtierd: nothing to offload (worker_kv_bytes_per_block={sub_block}, "
            f"world_size={world}, blocks_per_chunk={bpc})"
        )
    block_bytes = _round_up(sub_block * bpc * world, ROW_ALIGNMENT)
    if block_bytes > 1 << 30:
        raise ValueError(
            f"kvtierd: a row of {block_bytes} bytes ({world} ranks x {bpc} blocks x "
            f"{sub_block} bytes) exceeds the daemon's 1 GiB limit; lower blocks_per_chunk"
        )
    layout = layout_fingerprint(config)
    digest = hashlib.sha256(layout.encode()).hexdigest()[:12]
    name = settings.pool_name or _default_pool_name(config.model.name, parallel, digest)
    return PoolPlan(
        name=name,
        block_bytes=block_bytes,
        num_blocks=settings.capacity_bytes // block_bytes,
        layout=layout,
        world_size=world,
        blocks_per_chunk=bpc,
        sub_block_bytes=sub_block,
    )


def layout_fingerprint(config: Any) -> str:
    """Everything the bytes of a row depend on, as one readable string (< 4 KiB).

    Model name and dtype, tokens per hash, blocks per chunk, per KV group its
    tokens per block and layers (hashed), the KV layout, the bytes of one GPU
    block, and the parallel layout except data parallelism (DP replicas hold
    identical KV and share the pool).
    """
    p = config.parallel
    groups = ";".join(
        f"g{g.group_id}:tpb{g.tokens_per_block}:L{len(g.layer_names)}:"
        + hashlib.sha256("\n".join(g.layer_names).encode()).hexdigest()[:12]
        for g in config.groups
    )
    model = config.model.name
    if len(model) > 512:
        model = "sha256:" + hashlib.sha256(model.encode()).hexdigest()
    return (
        f"{LAYOUT_VERSION}|model={model}|dtype={config.model.dtype}"
        f"|tokens_per_hash={config.cache.tokens_per_hash}"
        f"|blocks_per_chunk={config.cache.blocks_per_chunk}|groups={groups}"
        f"|kv_layout={config.kv_cache_layout}|block_kv_bytes={config.worker_kv_bytes_per_block}"
        f"|world={p.world_size}|tp={p.tp_size}|pp={p.pp_size}|pcp={p.pcp_size}|dcp={p.dcp_size}"
        f"|replicated={bool(config.replicated_layout)}"
    )


def _default_pool_name(model: str, parallel: Any, digest: str) -> str:
    base = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    base = _POOL_NAME_CHARS.sub("_", base).strip("_.") or "model"
    model_tag = hashlib.sha256(model.encode()).hexdigest()[:8]
    shape = f"tp{parallel.tp_size}-pp{parallel.pp_size}"
    if parallel.pcp_size != 1 or parallel.dcp_size != 1:
        shape += f"-pcp{parallel.pcp_size}-dcp{parallel.dcp_size}"
    suffix = f"/{model_tag}/{shape}/{digest}"
    head = "vllm/"
    room = _MAX_POOL_NAME - len(head) - len(suffix)
    return head + base[: max(room, 1)] + suffix


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def _flag(config: ExtraConfig, key: str, default: bool) -> bool:
    """true or false (also 1/0, yes/no, on/off as text); ``default`` when absent."""
    raw = config.values.get(key)
    if raw is None:
        return default
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    config.fail(key, f"expected true or false, got {raw!r}")
