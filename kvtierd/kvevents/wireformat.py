"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``), the one llm-d's
and Dynamo's routers read: what each message's three frames hold and how one
event is written. Pure: no sockets, no state.

A message is ``[topic, seq, payload]``: ``topic`` ``kv@<identity>@<model>``,
``seq`` an 8-byte big-endian counter that grows by one per message on a socket,
``payload`` the msgpack array ``[ts, [event, ...], data_parallel_rank]`` (the rank
nil: a subscriber credits the endpoint's registration). Events are maps with a
``"type"`` key (both routers decode them; the positional form is older).
A replay answer ends with ``[identity, "", "", -1 (8 bytes, signed), ""]``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgpack

MEDIUM_CPU = "CPU"  # the primary tier (host memory)
MEDIUM_STORAGE = "STORAGE"  # the fs and redis tiers (both routers: disk)
SEQ = struct.Struct(">Q")
REPLAY_END_SEQ = struct.pack(">q", -1)
ALL_BLOCKS_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def topic(identity: str, model: str) -> bytes:
    """A message's first frame: ``kv@<identity>@<model>`` (llm-d reads the pod and
    the model from it; Dynamo reads every topic)."""
    return f"kv@{identity}@{model}".encode()


def block_stored(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str,
    lora_name: str,
    group_idx: int,
) -> dict[str, Any]:
    """A ``BlockStored`` event, every field vLLM writes."""
    return {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent_block_hash,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name or None,
        "extra_keys": None,
        "group_idx": group_idx,
        "kv_cache_spec_kind": "full_attention",
        "locality": "LOCAL",
    }


def block_removed(block_hashes: Sequence[int], medium: str, group_idx: int) -> dict[str, Any]:
    """A ``BlockRemoved`` event."""
    return {
        "type": "BlockRemoved",
        "block_hashes": list(block_hashes),
        "medium": medium,
        "group_idx": group_idx,
        "locality": "LOCAL",
    }


def payload(timestamp: float, events: Sequence[dict[str, Any]]) -> bytes:
    """A message's third frame: ``[ts, events, None]`` in msgpack."""
    packed: bytes = msgpack.packb([timestamp, list(events), None], use_bin_type=True)
    return packed


def event_cost(event: dict[str, Any]) -> int:
    """About what ``event`` takes packed (a bound's unit; no packing done): its
    hashes at 9 bytes, its tokens at 5, and 96 for the rest."""
    return 96 + 9 * len(event.get("block_hashes", ())) + 5 * len(event.get("token_ids", ()))
