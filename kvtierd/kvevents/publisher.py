"""The ZeroMQ side of the KV-event publisher: one thread owns the PUB socket (and
the ROUTER socket answering replays), so nothing the event loop does waits on a
socket, a subscriber or msgpack.

The loop hands over lists of events (:meth:`EventPublisher.publish`: an append
under a lock, O(1)); the thread packs each list into one message per topic,
numbers it (``seq`` grows by one per message: gap-free), sends it without
blocking (a PUB socket drops for a subscriber whose queue is full; that
subscriber sees the gap and asks for a replay) and keeps it in the replay
window.

Bounds: the hand-over queue holds at most ``queue_bytes`` of events (by
:func:`~kvtierd.kvevents.wireformat.event_cost`); past it a list is refused and
counted, and :attr:`EventPublisher.lost` tells the owner to re-announce (a
router must never keep a block a lost removal would have taken away). The
replay window holds at most ``replay_bytes`` of packed messages, oldest dropped
first. ``SNDHWM`` bounds what ZeroMQ queues per subscriber.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvtierd.kvevents import wireformat

log = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages ZeroMQ queues for one subscriber
IDLE_WAIT = 0.05  # seconds the thread sleeps between replay-socket polls when idle
MAX_REPLAY_ANSWER = 4096  # messages one replay request is answered with at most


@dataclass(frozen=True, slots=True)
class PublisherStats:
    messages: int  # sent (one per topic per list)
    events: int  # events handed over and sent
    refused_events: int  # handed over past the queue's bound (re-announced instead)
    replays: int  # replay requests answered
    last_seq: int


class EventPublisher:
    """One endpoint's sockets and thread. ``publish`` and ``stats`` are called from
    the event loop; everything else of the sockets happens on the thread."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        topics: Sequence[bytes],
        *,
        connect: bool = False,
        queue_bytes: int,
        replay_bytes: int,
        socket_mode: int = 0o660,
        socket_gid: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topics = tuple(topics)
        self._connect = connect
        self._queue_bytes = queue_bytes
        self._replay_bytes = replay_bytes
        self._socket_mode = socket_mode
        self._socket_gid = socket_gid
        self._lock = threading.Condition()
        self._queue: deque[tuple[float, list[dict[str, Any]], int]] = deque()
        self._queued_bytes = 0
        self._stopping = False
        self.lost = False  # a list was refused: the owner re-announces (then clears it)
        self._refused_events = 0
        self._messages = 0
        self._events = 0
        self._replays = 0
        self._seq = -1
        self._context: zmq.Context[zmq.Socket[Any]] = zmq.Context.instance()
        self._pub = self._bind(zmq.PUB, endpoint)
        self._router = self._bind(zmq.ROUTER, replay_endpoint) if replay_endpoint else None
        self._window: deque[tuple[int, bytes, bytes]] = deque()  # (seq, topic, payload)
        self._window_bytes = 0
        self._thread = threading.Thread(target=self._run, name="kvtierd-kv-events", daemon=True)

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        try:
            if self._connect and kind == zmq.PUB:
                sock.connect(endpoint)
            else:
                sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise OSError(f"kv_events: cannot bind {endpoint}: {exc}") from None
        if endpoint.startswith("ipc://") and not (self._connect and kind == zmq.PUB):
            path = endpoint[len("ipc://") :]
            os.chmod(path, self._socket_mode)
            if self._socket_gid is not None:
                os.chown(path, -1, self._socket_gid)
        return sock

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the sockets (and removes ipc files)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint.startswith("ipc://") and not (self._connect and endpoint == self.endpoint):
                try:
                    os.unlink(endpoint[len("ipc://") :])
                except FileNotFoundError:
                    pass

    # -- the loop's side ----------------------------------------------------------

    def publish(self, events: list[dict[str, Any]], timestamp: float) -> bool:
        """Hands ``events`` over (one message per topic); False when the queue's bound
        refused them (:attr:`lost` is then set)."""
        if not events:
            return True
        cost = sum(map(wireformat.event_cost, events))
        with self._lock:
            if self._queued_bytes + cost > self._queue_bytes and self._queue:
                self._refused_events += len(events)
                self.lost = True
                return False
            self._queue.append((timestamp, events, cost))
            self._queued_bytes += cost
            self._lock.notify()
        return True

    def publish_unbounded(self, events: list[dict[str, Any]], timestamp: float) -> None:
        """Hands ``events`` over past the queue's bound: the re-announce after a
        refusal, bounded by what the description table holds."""
        with self._lock:
            self._queue.append((timestamp, events, 0))
            self._lock.notify()

    @property
    def topics(self) -> tuple[bytes, ...]:
        return self._topics

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                self._messages, self._events, self._refused_events, self._replays, self._seq
            )

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._queue and not self._stopping:
                        self._lock.wait(IDLE_WAIT)
                    batch = list(self._queue)
                    self._queue.clear()
                    self._queued_bytes = 0
                    stopping = self._stopping
                for timestamp, events, _cost in batch:
                    self._send(timestamp, events)
                self._answer_replays()
                if stopping:
                    break
        except Exception:  # a bug: say so; the daemon goes on without events
            log.exception("the KV-event publisher stopped")
        finally:
            self._pub.close(0)
            if self._router is not None:
                self._router.close(0)

    def _send(self, timestamp: float, events: list[dict[str, Any]]) -> None:
        body = wireformat.payload(timestamp, events)
        for topic in self._topics:
            self._seq += 1
            seq = wireformat.SEQ.pack(self._seq)
            try:
                self._pub.send_multipart((topic, seq, body), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # connect mode, no peer yet: the window keeps it for a replay
                pass
            self._remember(self._seq, topic, body)
            self._messages += 1
        self._events += len(events)

    def _remember(self, seq: int, topic: bytes, body: bytes) -> None:
        self._window.append((seq, topic, body))
        self._window_bytes += len(body) + len(topic) + 64
        while self._window_bytes > self._replay_bytes and len(self._window) > 1:
            _, old_topic, old_body = self._window.popleft()
            self._window_bytes -= len(old_body) + len(old_topic) + 64

    def _answer_replays(self) -> None:
        router = self._router
        if router is None:
            return
        while router.poll(0):
            frames = router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request; nothing to answer
            start = wireformat.SEQ.unpack(frames[2])[0]
            identity = frames[0]
            answered = 0
            for seq, topic, body in list(self._window):
                if seq < start:
                    continue
                if answered == MAX_REPLAY_ANSWER:
                    break
                router.send_multipart((identity, b"", topic, wireformat.SEQ.pack(seq), body))
                answered += 1
            router.send_multipart((identity, b"", b"", wireformat.REPLAY_END_SEQ, b""))
            self._replays += 1


def now() -> float:
    """The events' timestamp: wall-clock seconds (what vLLM writes)."""
    return time.time()
