"""Descriptions of the backend's stored pages, from SGLang's own GPU KV events.

With ``kvtierd_events = "daemon"`` the daemon publishes the pool's pages to routers
and needs each page's tokens (:mod:`kvtierd_client.engine_events`). SGLang's
``batch_set_v1`` hands the backend page keys only (and the keys before them in
``extra_info.prefix_keys``): never the tokens. A page key is the page's SHA-256
chain hash in hex (``get_hash_str`` of its tokens and the previous page's hash),
and SGLang's radix cache publishes every page it caches on the GPU as a
``BlockStored`` event whose 64-bit hash is the first 16 hex digits of that same
hash (``hash_str_to_int64``: signed; the description carries it modulo 2**64),
with the page's tokens and the previous page's hash, on the endpoint of
``--kv-events-config``, long before the page is backed up to storage (a page goes
to the host tier, then to storage). So the backend subscribes there, decodes with
SGLang's own event classes (``sglang.srt.disaggregation.kv_events``) and describes
a page key by its hash.

A page it cannot describe is stored undescribed (the daemon then publishes it to
no router): its event was not received (KV events off, another endpoint), was
forgotten for room (``kvtierd_description_bytes``), or the page is namespaced (a
LoRA adapter, a cache salt: SGLang seeds its storage keys and its event hashes
differently then, so no event matches the key).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvtierd_client.engine_events import Describer, StoredBlocks, listen, local_endpoint
from kvtierd_client.sglang.settings import StorageSettings

__all__ = ["decode_sglang_events", "key_hash", "start_describer"]

log = logging.getLogger(__name__)

_HEX = frozenset(b"0123456789abcdef")


def start_describer(settings: StorageSettings, storage_config: Any, page_size: int) -> Describer:
    """A describer listening to this rank's SGLang KV events (``kvtierd_events =
    "daemon"``): the endpoint of ``kvtierd_engine_events``, its port offset by the
    attention-DP rank as SGLang offsets each rank's publisher."""
    rank = int(getattr(storage_config, "dp_rank", 0) or 0)
    endpoint = local_endpoint(settings.engine_events, rank)
    log.info("kvtierd: stored pages are described from SGLang's KV events at %s", endpoint)
    return listen(
        endpoint,
        settings.description_bytes,
        decode_sglang_events,
        key_hash,
        blocks=1,
        block_size=page_size,
    )


def key_hash(key: bytes) -> tuple[int, int] | None:
    """A page key (64 hex digits, as the backend stores it): the 64-bit hash SGLang's
    events give the page, group 0; None for another key."""
    if len(key) != 64 or not _HEX.issuperset(key):
        return None
    return int(key[:16], 16), 0


_decoder: Any = None


def decode_sglang_events(payload: bytes) -> Iterable[StoredBlocks]:
    """The ``BlockStored`` events of one SGLang event message (SGLang's own
    ``KVEventBatch`` decoder)."""
    global _decoder
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch

    if _decoder is None:
        import msgspec

        _decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    for event in _decoder.decode(payload).events:
        if isinstance(event, BlockStored):
            salted = getattr(event, "cache_salt", None) is not None
            yield StoredBlocks(
                block_hashes=event.block_hashes,
                parent=event.parent_block_hash,
                token_ids=event.token_ids,
                block_size=int(event.block_size),
                lora_name=event.lora_name or "",
                keyed=[salted] * len(event.block_hashes),
            )
