"""The shared tier's events for every engine of the fleet: a filter on a daemon's events.

A daemon publishes its pool's blocks with medium ``CPU`` (its primary) and ``STORAGE``
(its secondary tiers), and only blocks stored through it (it has their descriptions).
With a tier every node shares (the Redis Cluster), a block one node stored is loadable
by every engine of every node, but its ``STORAGE`` event reaches only the engines its
daemon is registered under: the others' view of the shared tier is empty. The daemon's
``CPU`` events cannot be registered under other nodes' engines (they would credit a
node's memory to engines that cannot read it).

:class:`StorageRelay` subscribes to one daemon's endpoint and republishes, in vLLM's
format with its own gap-free sequence, only the ``STORAGE`` events and
``AllBlocksCleared``; the benchmark registers it under the other nodes' engines (dp
rank 2 + node). It stands in for what the daemon does not offer (yet): an endpoint
carrying its shared tiers' events only, for the whole fleet. ``--shared-view none``
runs without it, to measure the gap.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import zmq

MEDIUM_STORAGE = "STORAGE"
POLL_MS = 50


def storage_only(events: list[Any]) -> list[Any]:
    """The events a fleet-wide view of the shared tier takes: ``STORAGE`` stores and
    removals, and ``AllBlocksCleared`` (the daemon forgot what it announced)."""
    kept = []
    for event in events:
        if not isinstance(event, dict):
            continue  # positional events: the daemon sends maps
        kind = event.get("type")
        if kind == "AllBlocksCleared" or (
            kind in ("BlockStored", "BlockRemoved") and event.get("medium") == MEDIUM_STORAGE
        ):
            kept.append(event)
    return kept


class StorageRelay:
    """One daemon's ``STORAGE`` events on an endpoint of their own (module doc)."""

    def __init__(self, context: zmq.Context[Any], source: str) -> None:
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind("tcp://127.0.0.1:0")
        endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        self.seq = 0
        self.relayed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="storage-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(POLL_MS, zmq.POLLIN):
                continue
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                continue
            ts, events, _rank = msgpack.unpackb(frames[2], raw=False)
            kept = storage_only(events)
            if not kept:
                continue
            payload = msgpack.packb([ts or time.time(), kept, None])
            self._pub.send_multipart([frames[0], self.seq.to_bytes(8, "big"), payload])
            self.seq += 1
            self.relayed += len(kept)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._pub.close(0)
