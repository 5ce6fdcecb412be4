"""``python -m kvtierd.kvevents.worker``: the KV-event publisher's own process,
started by the daemon (:mod:`kvtierd.kvevents.service`) with one end of a
``SOCK_SEQPACKET`` socket pair.

Its own interpreter, so that turning events into vLLM's messages (parsing
descriptions, building maps, msgpack) never takes the daemon's interpreter lock:
the daemon's request path only writes a frame. It owns the
:class:`~kvtierd.kvevents.translator.Translator` (the description table) and the
:class:`~kvtierd.kvevents.publisher.EventPublisher` (its sockets and thread).

Frames (msgpack arrays), from the daemon:

- ``["setup", {config fields}, state_dir, socket_gid]`` first; answered ``["ready"]``
  or ``["error", message]`` (an endpoint that cannot be bound);
(each packet an array of the frames of one turn of the daemon's loop)

- ``["d", pool, serialized CompleteStoreRequest]``: keys and their descriptions;
- ``["e", pool, tier, medium, removed, [keys]]``: one of the pool's block events;
- ``["s", pool, [[key, raw description, [[tier, medium], ...]], ...]]``: a seed;
- ``["lost"]``: the daemon dropped frames (its socket buffer was full);
- ``["stop"]``: send what is queued, save the pools' descriptions, answer
  ``["stopped"]`` and exit.

To the daemon, every :data:`STATS_INTERVAL` seconds: ``["stats", {...}]``.
It exits at EOF (the daemon is gone), dies with the daemon
(``PR_SET_PDEATHSIG``), and runs at a lower priority (:data:`NICENESS`): on a
busy node the daemon and the engines get the CPU first, events wait.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from kvtierd.config.sections import KvEventsConfig
from kvtierd.contract import BlockEvent, Medium
from kvtierd.kvevents.publisher import EventPublisher
from kvtierd.kvevents.snapshots import save_snapshots
from kvtierd.kvevents.translator import Translator
from kvtierd.util.workerproc import die_with
from kvtierd_client.wire.proto import pb2

log = logging.getLogger("kvtierd.kvevents.worker")

MAX_FRAME = 1 << 16  # bytes of one frame; the daemon splits what is longer
STATS_INTERVAL = 1.0
NICENESS = 10  # below the daemon's and the engines' priority (CFS weight 110 of 1024)
STOP = "\0stop"  # serve's marker: the daemon asked to stop
KEY_COST = 320  # what a described key is assumed to take in the publisher's queue


def first_sequence() -> int:
    """The number of a daemon's first message: the wall clock in microseconds.

    A router keeps, per listener, the last number it applied and drops any message
    not above it: NVIDIA Dynamo's indexer (ai-dynamo-runtime 1.6.1) drops even an
    ``AllBlocksCleared`` so. A restarted daemon (or one taking over) is heard by
    the same listeners, so its numbers must start above its predecessor's, with no
    state to carry (a SIGKILL saves none): they do while the predecessor sent fewer
    messages than microseconds passed since it started (each message is a packed
    batch: far fewer) and the clock does not step back. The jump reads as a gap, and
    a listener with the replay endpoint asks for it: the answer starts at this
    daemon's first message."""
    return time.time_ns() // 1000


def item_cost(item: tuple[Any, ...]) -> int:
    """What an item is assumed to take in the publisher's queue (no key looked at)."""
    kind = item[0]
    if kind == "event":
        return 64 + KEY_COST * len(item[2].keys)
    return 64 + KEY_COST * len(item[2])


def build(setup: Sequence[Any]) -> tuple[KvEventsConfig, str, Translator, EventPublisher]:
    """The translator and the bound publisher of a setup frame (OSError: not bound)."""
    _, fields, state_dir, socket_gid = setup
    fields["pools"] = tuple(fields["pools"])
    fields["engines"] = tuple(fields["engines"])
    config = KvEventsConfig(**fields)
    names = config.engines or (config.identity,)
    translator = Translator(config.max_description_bytes)
    publisher = EventPublisher(
        config.endpoint,
        config.replay_endpoint,
        [f"kv@{name}@{config.model}".encode() for name in names],
        render=translator.apply,
        cost=item_cost,
        on_lost=translator.clear,
        connect=config.connect,
        first_seq=first_sequence(),
        queue_bytes=config.replay_bytes,
        replay_bytes=config.replay_bytes,
        socket_gid=socket_gid,
    )
    return config, state_dir, translator, publisher


def stats_frame(translator: Translator, publisher: EventPublisher) -> bytes:
    published = publisher.stats()
    table = translator.table
    return pack(["stats", {
        "messages": published.messages, "events": published.events,
        "refused_items": published.refused_items, "replays": published.replays,
        "last_seq": published.last_seq, "described_keys": len(table),
        "description_bytes": table.used_bytes, "dropped_descriptions": table.dropped,
        "undescribed_stores": translator.undescribed_stores, "cleared": translator.cleared,
    }])  # fmt: skip


def pack(frame: list[Any]) -> bytes:
    packed: bytes = msgpack.packb(frame)
    return packed


def serve(channel: socket.socket, translator: Translator, publisher: EventPublisher) -> set[str]:
    """Hands the daemon's frames to the publisher until ``stop`` or EOF; returns the
    pools named (and the marker STOP when asked to stop)."""
    pools: set[str] = set()
    channel.settimeout(STATS_INTERVAL)
    while True:
        try:
            packet = channel.recv(MAX_FRAME)
        except TimeoutError:
            channel.sendall(stats_frame(translator, publisher))
            continue
        if not packet:
            return pools  # the daemon is gone
        for frame in msgpack.unpackb(packet, raw=False):  # one turn of the daemon's loop
            kind = frame[0]
            if kind == "stop":
                return pools | {STOP}
            if kind == "lost":
                publisher.lost = True
                continue
            item = _item(frame)
            if item is None:
                log.error("kv events: unknown frame %r from the daemon", kind)
                continue
            pools.add(frame[1])
            publisher.publish([item], wait=True)  # the socket's buffer is the bound


def _item(frame: list[Any]) -> tuple[Any, ...] | None:
    """The translator's item of a frame, or None for an unknown one."""
    kind = frame[0]
    if kind == "e":
        _, pool, tier, medium, removed, keys = frame
        return ("event", pool, BlockEvent(tuple(keys), Medium(medium), removed, tier))
    if kind == "d":
        request = pb2.CompleteStoreRequest.FromString(frame[2])
        return ("describe", frame[1], list(request.keys), request.descriptions)
    if kind == "s":
        kept = [(key, raw, [tuple(held) for held in holders]) for key, raw, holders in frame[2]]
        return ("seed", frame[1], kept)
    return None


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or not all(arg.isdigit() for arg in argv):
        print("usage: python -m kvtierd.kvevents.worker DAEMON_PID FD (started by kvtierd)",
              file=sys.stderr)  # fmt: skip
        return 2
    if not die_with(int(argv[0])):
        return 1
    os.nice(NICENESS)  # the request path first: publishing takes what CPU is left
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level="INFO")
    channel = socket.socket(fileno=int(argv[1]))
    setup = msgpack.unpackb(channel.recv(MAX_FRAME), raw=False)
    try:
        config, state_dir, translator, publisher = build(setup)
    except OSError as exc:
        channel.sendall(pack(["error", str(exc)]))
        return 2
    channel.sendall(pack(["ready"]))
    publisher.lost = True  # the first message: AllBlocksCleared
    publisher.start()
    pools = serve(channel, translator, publisher)
    stopping = STOP in pools
    publisher.stop()
    if stopping:
        named = [pool for pool in pools if pool in config.pools]
        table = translator.table
        save_snapshots(state_dir, {p: [(k, e.raw) for k, e in table.entries(p)] for p in named})
        channel.sendall(stats_frame(translator, publisher))
        channel.sendall(pack(["stopped"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
