"""A KV-event subscriber for tests: what a router does with kvtierd's publisher.

:class:`EventReader` connects a SUB socket to the endpoint and a DEALER to the
replay endpoint; :meth:`EventReader.until` reads messages until a condition holds
on everything read, asking for a replay of whatever a sequence gap (or joining
late) left out, so a test sees every message from the first, in order."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

SEQ = struct.Struct(">Q")


@dataclass(frozen=True)
class Message:
    topic: str
    seq: int
    timestamp: float
    events: list[dict[str, Any]]
    rank: Any


def decode(topic: bytes, seq: bytes, payload: bytes) -> Message:
    timestamp, events, rank = msgpack.unpackb(payload, raw=False)
    return Message(topic.decode(), SEQ.unpack(seq)[0], timestamp, events, rank)


class EventReader:
    def __init__(self, endpoint: str, replay_endpoint: str = "") -> None:
        self.context = zmq.Context.instance()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = self.context.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(replay_endpoint)
        self.messages: dict[int, Message] = {}

    def close(self) -> None:
        self.sub.close(0)
        if self.replay is not None:
            self.replay.close(0)

    def __enter__(self) -> EventReader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def ordered(self) -> list[Message]:
        return [self.messages[seq] for seq in sorted(self.messages)]

    @property
    def events(self) -> list[dict[str, Any]]:
        return [event for message in self.ordered for event in message.events]

    def until(
        self, done: Callable[[list[dict[str, Any]]], bool], timeout: float = 20.0
    ) -> list[dict[str, Any]]:
        """Reads until ``done(every event so far, in sequence order)``; AssertionError
        with what was read after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not done(self.events):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; events so far: {self.events}")
            if self.sub.poll(int(min(left, 0.2) * 1000)):
                message = decode(*self.sub.recv_multipart())
                self.messages[message.seq] = message
            self._fill_gaps()
        return self.events

    def _fill_gaps(self) -> None:
        """Asks for a replay from the first missing sequence number (0 at first)."""
        if self.replay is None or not self.messages:
            return
        seqs = sorted(self.messages)
        missing = next((s for s in range(seqs[-1]) if s not in self.messages), None)
        if missing is None:
            return
        self.replay.send_multipart([b"", SEQ.pack(missing)])
        while self.replay.poll(5000):
            _empty, topic, seq, payload = self.replay.recv_multipart()
            if not topic:  # the end: seq -1
                return
            message = decode(topic, seq, payload)
            self.messages.setdefault(message.seq, message)
