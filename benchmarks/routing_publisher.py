"""A simulated engine's own KV events, in vLLM's wire format (vllm/distributed/kv_events.py).

Each message is three frames ``[topic, seq, payload]``: the topic (vLLM's default,
empty), an 8-byte big-endian sequence number that grows by one per message from 0,
and the msgpack payload ``[ts, [events], data_parallel_rank]`` with map events (vLLM's
form since mid-2026). The socket is an XPUB bound on loopback: on the wire it is the
PUB vLLM binds, and it tells :meth:`GpuEventPublisher.wait_subscribed` when a
subscriber's subscription arrived, so no event is published into the void before
the router listens (vLLM would answer a gap from its replay buffer; here none opens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

MEDIUM_GPU = "GPU"


def block_stored(
    hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int
) -> dict[str, Any]:
    """vLLM's ``BlockStored`` for blocks now in the GPU prefix cache."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM_GPU,
        "lora_name": None,
        "extra_keys": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "locality": "LOCAL",
    }


def block_removed(hashes: Sequence[int]) -> dict[str, Any]:
    """vLLM's ``BlockRemoved`` for blocks evicted from the GPU prefix cache."""
    return {
        "type": "BlockRemoved",
        "block_hashes": list(hashes),
        "medium": MEDIUM_GPU,
        "group_idx": 0,
        "locality": "LOCAL",
    }


class GpuEventPublisher:
    """One engine's event socket. Not thread-safe (one engine, one thread)."""

    def __init__(self, context: zmq.Context[Any], host: str = "127.0.0.1") -> None:
        self._socket = context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:0")
        endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        self.seq = 0
        self.messages = 0
        self.events = 0

    def wait_subscribed(self, timeout_s: float) -> None:
        """Returns once a subscriber's subscription reached the socket; raises
        ``TimeoutError`` after ``timeout_s``."""
        if not self._socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"nobody subscribed to {self.endpoint} in {timeout_s:.0f} s")
        self._socket.recv()  # b"\x01" + topic: a subscription (never one to drop here)

    def publish(self, events: list[dict[str, Any]]) -> None:
        """One message of ``events`` (nothing when empty), as one vLLM scheduler step."""
        if not events:
            return
        payload = msgpack.packb([time.time(), events, None])
        self._socket.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
        self.messages += 1
        self.events += len(events)

    def close(self) -> None:
        self._socket.close(0)
