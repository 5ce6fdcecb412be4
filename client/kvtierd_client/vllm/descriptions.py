"""Descriptions of the manager's stores, from vLLM's own GPU KV events.

With ``kvtierd_events = "daemon"`` the daemon publishes the pool's blocks to routers
and needs each stored key's tokens (:mod:`kvtierd_client.engine_events`). vLLM's
``OffloadingManager`` API hands the manager keys only (an ``OffloadKey`` is the
chunk's last block hash and a group index); vLLM's own ``OffloadingEventsTracker``,
which snapshots a chunk's tokens from its ``Request``, is private to the connector's
scheduler and hands nothing to the manager. What vLLM does publish is every block
its GPU prefix cache caches, as a ``BlockStored`` event with token ids, parent hash
and 64-bit block hashes, on the endpoint of ``--kv-events-config`` (the same events
a KV-aware router reads): a block reaches the manager's ``complete_store`` at least
one engine step after vLLM published it. The manager's describer subscribes there,
decodes with vLLM's own event classes (``vllm.distributed.kv_events``) and describes
a chunk key by its last block's hash, walking ``blocks_per_chunk - 1`` parents back
(:class:`kvtierd_client.engine_events.Describer`).

A key it cannot describe is sent undescribed (the daemon then publishes it to no
router): its blocks' event was not received (yet, or at all: KV events off, another
endpoint), was forgotten for room (``kvtierd_description_bytes``), or its hash covers
more than its tokens (images, a cache salt, prompt embeddings). Engines with more
than one KV cache group (sliding-window or hybrid models) are not described.

The listener is a thread of its own; the scheduler thread only looks entries up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtierd_client.engine_events import Describer, StoredBlocks, listen, local_endpoint
from kvtierd_client.types import hash64
from kvtierd_client.vllm.common import log
from kvtierd_client.vllm.settings import PluginSettings

__all__ = ["decode_vllm_events", "key_hash", "start_describer"]

KV_EVENTS_HINT = (
    '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", '
    '"endpoint": "tcp://*:5557"}\''
)


def start_describer(settings: PluginSettings, config: Any, *, events_on: bool) -> Describer | None:
    """A describer listening to this engine's KV events, for ``kvtierd_events =
    "daemon"``; None (with one warning saying what to change) when vLLM publishes
    none (``events_on`` false) or the engine has more than one KV cache group."""
    if not events_on:
        log.warning(
            "kvtierd: kvtierd_events is \"daemon\" but vLLM's KV events are off: the "
            "daemon publishes none of this engine's stores to routers; turn them on "
            "with %s", KV_EVENTS_HINT,
        )  # fmt: skip
        return None
    groups = list(config.groups)
    if len(groups) != 1:
        log.warning(
            "kvtierd: this engine has %d KV cache groups; stores are described only "
            "for models with one (full attention): the daemon publishes none of them",
            len(groups),
        )  # fmt: skip
        return None
    endpoint = local_endpoint(settings.engine_events, int(config.parallel.data_parallel_index))
    return listen(
        endpoint,
        settings.description_bytes,
        decode_vllm_events,
        key_hash,
        blocks=int(config.cache.blocks_per_chunk),
        block_size=int(groups[0].tokens_per_block),
    )


def key_hash(key: bytes) -> tuple[int, int] | None:
    """An ``OffloadKey`` (the chunk's last block hash, then 4 bytes of group index):
    that block's 64-bit hash as vLLM publishes it, and the group."""
    if len(key) <= 4:
        return None
    return hash64(key[:-4]), int.from_bytes(key[-4:], "big")


_decoder: Any = None


def decode_vllm_events(payload: bytes) -> Iterable[StoredBlocks]:
    """The ``BlockStored`` events of one vLLM event message (vLLM's own
    ``KVEventBatch`` decoder, so whatever this vLLM publishes is read as it means it)."""
    global _decoder
    if _decoder is None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        _decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    from vllm.distributed.kv_events import BlockStored

    batch = _decoder.decode(payload)
    for event in batch.events:
        if isinstance(event, BlockStored):
            yield _stored(event)


def _stored(event: Any) -> StoredBlocks:
    lora = event.lora_name or ""
    hashes = [_int_hash(h) for h in event.block_hashes]
    parent = None if event.parent_block_hash is None else _int_hash(event.parent_block_hash)
    extra = event.extra_keys
    keyed: list[bool] = []
    if extra:
        plain = {None, (lora,)} if lora else {None}
        keyed = [(None if e is None else tuple(e)) not in plain for e in extra]
        if len(keyed) != len(hashes):  # cannot tell which block is which: none
            keyed = [True] * len(hashes)
    return StoredBlocks(
        block_hashes=hashes,
        parent=parent,
        token_ids=event.token_ids,
        block_size=int(event.block_size),
        lora_name=lora,
        keyed=keyed,
    )


def _int_hash(value: int | bytes) -> int:
    """vLLM publishes ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default) or
    the raw hash bytes; both as the 64-bit int routers read."""
    return hash64(value) if isinstance(value, bytes) else value
