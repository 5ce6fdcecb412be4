"""The ZeroMQ side of the KV-event publisher: one thread owns the PUB socket (and
the ROUTER socket answering replays), so nothing the event loop does waits on a
socket, a subscriber or msgpack.

The loop hands over lists of event *specs* (:meth:`EventPublisher.publish`: an
append under a lock, O(1), and a wake-up only when the thread is idle); the
thread turns them into events (``render``, given by the owner; it lets the loop
take the GIL every :data:`YIELD_EVERY` items and between messages), gathers what
arrives within :data:`GATHER_SECONDS` into one message per topic (as vLLM
publishes one batch per scheduler step), numbers it (``seq`` grows by one per
message from ``first_seq``: gap-free), sends it without blocking (a PUB socket drops for a
subscriber whose queue is full; that subscriber sees the gap and asks for a
replay) and keeps it in the replay window. So a store costs the request path an
append, never the packing, and the thread takes the GIL at most every
:data:`GATHER_SECONDS` under load.

Bounds: the hand-over queue holds at most ``queue_bytes`` of specs (by the
owner's ``cost``); past it a list is refused and
counted, and the thread's next message starts with ``on_lost()``'s events (the
owner's: ``AllBlocksCleared``, its state dropped: a router must never keep a
block a lost removal would have taken away). The
replay window holds at most ``replay_bytes`` of packed messages, oldest dropped
first. ``SNDHWM`` bounds what ZeroMQ queues per subscriber.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvtierd.kvevents import wireformat
from kvtierd.security.trusted_dirs import UntrustedPath, require_trusted_dir

log = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages ZeroMQ queues for one subscriber
IDLE_WAIT = 0.2  # seconds between replay-socket polls while nothing is published
GATHER_SECONDS = 0.005  # how long a first spec waits for others to share its message
MAX_EVENTS_PER_MESSAGE = 128  # a longer burst (a re-announce) is split
YIELD_EVERY = 1  # items the thread renders before it lets the loop run (an item: one call's keys)
MAX_REPLAY_ANSWER = 4096  # messages one replay request is answered with at most


@dataclass(frozen=True, slots=True)
class PublisherStats:
    messages: int  # sent (one per topic per list)
    events: int  # events handed over and sent
    refused_items: int  # handed over past the queue's bound (then on_lost)
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
        render: Callable[[Any], list[dict[str, Any]]] = lambda event: [event],
        cost: Callable[[Any], int] = wireformat.event_cost,
        on_lost: Callable[[], list[dict[str, Any]]] = lambda: [wireformat.ALL_BLOCKS_CLEARED],
        connect: bool = False,
        first_seq: int = 0,
        queue_bytes: int,
        replay_bytes: int,
        socket_mode: int = 0o660,
        socket_gid: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topics = tuple(topics)
        self._render = render
        self._cost = cost
        self._on_lost = on_lost
        self._connect = connect
        self._queue_bytes = queue_bytes
        self._replay_bytes = replay_bytes
        self._socket_mode = socket_mode
        self._socket_gid = socket_gid
        self._lock = threading.Condition()
        self._queue: deque[tuple[float, list[Any]]] = deque()
        self._queued_bytes = 0
        self._idle = False  # the thread waits for work: a publish wakes it
        self._stopping = False
        self.lost = False  # a list was refused: the thread sends on_lost() next
        self._refused_items = 0
        self._messages = 0
        self._events = 0
        self._replays = 0
        self._seq = first_seq - 1  # the last number sent
        self._context: zmq.Context[zmq.Socket[Any]] = zmq.Context.instance()
        self._pub = self._bind(zmq.PUB, endpoint)
        self._router = self._bind(zmq.ROUTER, replay_endpoint) if replay_endpoint else None
        self._window: deque[tuple[int, bytes, bytes]] = deque()  # (seq, topic, payload)
        self._window_bytes = 0
        self._thread = threading.Thread(target=self._run, name="kvtierd-kv-events", daemon=True)

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[Any]:
        binds_ipc = endpoint.startswith("ipc://") and not (self._connect and kind == zmq.PUB)
        if binds_ipc:
            _require_own_directory(endpoint[len("ipc://") :])
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
        if binds_ipc:
            path = endpoint[len("ipc://") :]
            if not stat.S_ISSOCK(os.lstat(path).st_mode):  # nobody else writes there
                sock.close(0)
                raise OSError(f"kv_events: {path} is not the socket just bound")
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

    def publish(self, specs: list[Any], *, bounded: bool = True, wait: bool = False) -> bool:
        """Hands ``specs`` over (rendered and sent by the thread, in order); False
        when the queue's bound refused them (:attr:`lost` is then set). ``wait``:
        waits for room instead (the caller's own input is then the bound). Not
        ``bounded``: taken past the bound (a re-announce, bounded by its source)."""
        if not specs:
            return True
        cost = sum(map(self._cost, specs))
        with self._lock:
            while wait and self._queued_bytes + cost > self._queue_bytes and self._queue:
                self._lock.wait()
            if bounded and self._queued_bytes + cost > self._queue_bytes and self._queue:
                self._refused_items += len(specs)
                self.lost = True
                return False
            self._queue.append((now(), specs))
            self._queued_bytes += cost
            if self._idle:
                self._lock.notify()
        return True

    @property
    def topics(self) -> tuple[bytes, ...]:
        return self._topics

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                self._messages, self._events, self._refused_items, self._replays, self._seq
            )

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._queue and not self._stopping:
                        self._idle = True
                        self._lock.wait(IDLE_WAIT)
                        self._idle = False
                    gather = bool(self._queue) and not self._stopping
                if gather:
                    time.sleep(GATHER_SECONDS)  # the GIL released: the loop goes on
                with self._lock:
                    batch = list(self._queue)
                    self._queue.clear()
                    self._queued_bytes = 0
                    self._lock.notify_all()  # a publisher waiting for room
                    stopping = self._stopping
                    lost, self.lost = self.lost, False
                events = self._on_lost() if lost else []
                done = 0
                for _ts, specs in batch:
                    for spec in specs:
                        events += self._render(spec)
                        done += 1
                        if done % YIELD_EVERY == 0:
                            time.sleep(0)  # the GIL to the event loop for a moment
                if events:
                    self._send(batch[0][0] if batch else now(), events)
                self._answer_replays()
                if stopping and not batch:
                    break
        except Exception:  # a bug: say so; the daemon goes on without events
            log.exception("the KV-event publisher stopped")
        finally:
            self._pub.close(0)
            if self._router is not None:
                self._router.close(0)

    def _send(self, timestamp: float, events: list[dict[str, Any]]) -> None:
        """``events`` as messages of at most MAX_EVENTS_PER_MESSAGE, each once per topic."""
        for start in range(0, len(events), MAX_EVENTS_PER_MESSAGE):
            part = events[start : start + MAX_EVENTS_PER_MESSAGE]
            body = wireformat.payload(timestamp, part)
            for topic in self._topics:
                self._seq += 1
                seq = wireformat.SEQ.pack(self._seq)
                try:
                    self._pub.send_multipart((topic, seq, body), flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:  # connect mode, no peer yet: the window keeps it
                    pass
                self._remember(self._seq, topic, body)
                self._messages += 1
            self._events += len(part)
            time.sleep(0)  # the GIL to the event loop between messages

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


def _require_own_directory(path: str) -> None:
    """An ipc endpoint's directory must be one nobody but the daemon's user (or
    root) may write, as the daemon's socket directory (docs/security.md): else
    another user could swap the socket routers connect to."""
    directory = os.path.dirname(path) or "/"
    try:
        require_trusted_dir(directory)
    except UntrustedPath as exc:
        raise OSError(f"kv_events: the directory of {path}: {exc}") from None
    except FileNotFoundError:
        raise OSError(
            f"kv_events: {directory}, where {path} would be bound, does not exist"
        ) from None


def now() -> float:
    """The events' timestamp: wall-clock seconds (what vLLM writes)."""
    return time.time()
