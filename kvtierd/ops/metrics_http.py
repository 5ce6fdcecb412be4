"""The Prometheus endpoint: ``GET /metrics`` over HTTP/1.1, served from its own
thread so that no number of connections or requests can stall the daemon's
event loop.

Why a thread: anyone who can reach ``server.metrics_address`` (every local user,
on the default loopback address) may open connections and send requests. On the
event loop each of them cost loop time -- accepting, timers, reading, and a
render of every pool per scrape (~1.5 ms for one pool, 5-10 ms for eight): 233
scrapes a second from one user took the probe's Lookup p50 from 174 to 1,993 µs,
and thousands of idle connections stalled the loop for up to 0.9 s. Here the
event loop does one thing per scrape that is answered: it reads the pools'
state into metric families (``collect``, the part that must see the state the
loop owns, consistently); the endpoint's thread does everything else, the text
formatting (``render``) included.

Bounds, all fixed (:class:`EndpointLimits`):

* at most ``max_connections`` connections at once: past that the thread stops
  accepting (new ones wait in the kernel's listen backlog, holding no descriptor
  of the daemon);
* a request's head within ``head_timeout`` and ``max_head_bytes``; the answer
  written within ``write_timeout``; one request per connection (``Connection:
  close``);
* per peer address a token bucket of ``peer_burst`` requests refilled at
  ``peer_rate`` a second, and one of ``render_burst`` scrapes at ``render_rate``
  for every peer together: a request past either is answered ``429 Too Many
  Requests`` with ``Retry-After``, at no cost to the loop. Every local user
  shares 127.0.0.1, so a local flood can deny scrapes (the daemon's service stays
  untouched); Prometheus retries at its next interval.

Freshness: a scrape waits for a collection that starts after it arrived, so a
client that scrapes after its call returned always sees the call counted.
Scrapes arriving while a collection is queued on the loop share it.

``MetricsEndpoint`` is started and closed from the event loop; everything else
runs on its thread, except ``_collect_on_loop`` (the event loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

Families = list[Any]  # prometheus_client Metric objects, built fresh per collection


@dataclass(frozen=True, slots=True)
class EndpointLimits:
    """The endpoint's bounds (see the module doc)."""

    max_connections: int = 64
    backlog: int = 64
    head_timeout: float = 2.0  # seconds for the request line and headers
    write_timeout: float = 5.0  # seconds for the answer to be taken
    collect_timeout: float = 5.0  # seconds the event loop may take to collect (else 503)
    max_head_bytes: int = 8192
    peer_rate: float = 1.0  # requests a second per peer address ...
    peer_burst: int = 10  # ... after a burst of this many
    render_rate: float = 5.0  # scrapes a second, every peer together ...
    render_burst: int = 20  # ... after a burst of this many
    max_peers: int = 4096  # peer addresses remembered (least recently seen forgotten)


class TokenBuckets:
    """Token buckets by key: ``take(key)`` is 0.0 when a token was taken, else the
    seconds until one is there. At most ``max_keys`` keys are remembered (the least
    recently used one is forgotten: it comes back with a full bucket). Not
    thread-safe: the endpoint's thread only."""

    def __init__(self, rate: float, burst: int, max_keys: int, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.max_keys, self._clock = rate, burst, max_keys, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when

    def take(self, key: str) -> float:
        now = self._clock()
        tokens, then = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens - 1.0 if not wait else tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait


@dataclass(eq=False)
class _Collection:
    """One collection asked of the event loop; ``started`` once the loop began it
    (from then on it may no longer see a later request's effects)."""

    future: concurrent.futures.Future[Families]
    started: bool = False


@dataclass(frozen=True, slots=True)
class _Answer:
    status: str
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    retry_after: int = 0


class MetricsEndpoint:
    """``GET /metrics`` on ``host:port`` (see the module doc). ``collect`` runs on
    the event loop that called ``start`` and returns fresh metric families;
    ``render`` turns them into the exposition text on the endpoint's thread."""

    def __init__(
        self,
        address: str,
        collect: Callable[[], Families],
        render: Callable[[Families], bytes],
        limits: EndpointLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        host, _, port = address.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._collect, self._render = collect, render
        self.limits = limits or EndpointLimits()
        self._peers = TokenBuckets(
            self.limits.peer_rate, self.limits.peer_burst, self.limits.max_peers, clock
        )
        self._renders = TokenBuckets(self.limits.render_rate, self.limits.render_burst, 1, clock)
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._pending: _Collection | None = None  # the last collection asked for

    # -- the event loop's side ----------------------------------------------------------

    def start(self) -> None:
        """Binds and listens (``OSError`` when the address is taken or not local),
        then serves from a new thread. Call from the daemon's event loop."""
        self._main_loop = asyncio.get_running_loop()
        self._listener = socket.create_server(
            (self._host, self._port),
            family=socket.AF_INET6 if ":" in self._host else socket.AF_INET,
            backlog=self.limits.backlog,
        )
        self._listener.setblocking(False)
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="kvtierd-metrics", daemon=True
        )
        self._thread.start()
        started.wait()

    async def close(self) -> None:
        """Stops serving: the thread stops accepting, drops its connections, ends."""
        if self._thread is None or self._loop is None or self._stopping is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop already ended
            self._loop.call_soon_threadsafe(self._stopping.set)
        await asyncio.to_thread(self._thread.join, 5.0)

    def _collect_on_loop(self, job: _Collection) -> None:
        job.started = True
        try:
            job.future.set_result(self._collect())
        except Exception as exc:  # a bug: the scrape answers 500, the loop goes on
            job.future.set_exception(exc)

    # -- the endpoint's thread ----------------------------------------------------------

    def _run(self, started: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._stopping = asyncio.Event()
        started.set()
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    async def _serve(self) -> None:
        assert self._listener is not None and self._stopping is not None
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.limits.max_connections)
        tasks: set[asyncio.Task[None]] = set()
        accepting = loop.create_task(self._accept(slots, tasks))
        await self._stopping.wait()
        accepting.cancel()
        for task in [accepting, *tasks]:
            task.cancel()
        await asyncio.gather(accepting, *tasks, return_exceptions=True)
        self._listener.close()

    async def _accept(self, slots: asyncio.Semaphore, tasks: set[asyncio.Task[None]]) -> None:
        """Accepts while fewer than ``max_connections`` are open (else the kernel's
        backlog holds the newcomers)."""
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            await slots.acquire()
            try:
                connection, peer = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and the like: keep serving the others
                slots.release()
                _limited.warning(("metrics", "accept"), "metrics endpoint: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve_one(connection, str(peer[0])))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(lambda _: slots.release())

    async def _serve_one(self, connection: socket.socket, peer: str) -> None:
        writer: asyncio.StreamWriter | None = None
        limits = self.limits
        try:
            reader, writer = await asyncio.open_connection(
                sock=connection, limit=limits.max_head_bytes
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), limits.head_timeout)
            method, answer = await self._answer(head, peer)
            writer.write(_response(answer, with_body=method != "HEAD"))
            await asyncio.wait_for(writer.drain(), limits.write_timeout)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError, ValueError):  # fmt: skip
            pass  # a broken, slow or oversized request: nothing to answer
        except Exception:
            log.exception("metrics request failed")
        finally:
            if writer is not None:
                writer.close()
            else:
                connection.close()

    async def _answer(self, head: bytes, peer: str) -> tuple[str, _Answer]:
        """The request's method and its answer."""
        method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        path = path.split("?", 1)[0]
        wait = self._peers.take(peer)
        if wait:
            _limited.warning(
                ("metrics", "peer"),
                "metrics endpoint: %s is over %g requests a second; answering 429",
                peer, self.limits.peer_rate,
            )  # fmt: skip
            return method, _too_many(wait, f"over {self.limits.peer_rate:g} requests a second")
        if method not in ("GET", "HEAD"):
            return method, _Answer("405 Method Not Allowed", b"GET only\n")
        if path == "/":
            return method, _Answer("200 OK", b"kvtierd: metrics at /metrics\n")
        if path != "/metrics":
            return method, _Answer("404 Not Found", b"not found; try /metrics\n")
        wait = self._renders.take("")
        if wait:
            return method, _too_many(wait, f"over {self.limits.render_rate:g} scrapes a second")
        return method, await self._scrape()

    async def _scrape(self) -> _Answer:
        try:
            families = await asyncio.wait_for(
                asyncio.wrap_future(self._collection().future), self.limits.collect_timeout
            )
        except (asyncio.TimeoutError, RuntimeError):  # RuntimeError: the loop is closed
            return _Answer(
                "503 Service Unavailable",
                f"the daemon's event loop did not collect the metrics within "
                f"{self.limits.collect_timeout:g}s; retry\n".encode(),
            )
        return _Answer("200 OK", self._render(families), CONTENT_TYPE_LATEST)

    def _collection(self) -> _Collection:
        """A collection that starts after now: the one queued on the loop if it has
        not started yet, else a new one."""
        pending = self._pending
        if pending is not None and not pending.started:
            return pending
        assert self._main_loop is not None
        job = _Collection(concurrent.futures.Future())
        self._pending = job
        self._main_loop.call_soon_threadsafe(self._collect_on_loop, job)
        return job


def _too_many(wait: float, why: str) -> _Answer:
    seconds = max(1, math.ceil(wait))
    body = f"too many requests: {why}; retry in {seconds}s\n".encode()
    return _Answer("429 Too Many Requests", body, retry_after=seconds)


def _response(answer: _Answer, with_body: bool) -> bytes:
    retry = f"Retry-After: {answer.retry_after}\r\n" if answer.retry_after else ""
    head = (
        f"HTTP/1.1 {answer.status}\r\nContent-Type: {answer.content_type}\r\n"
        f"Content-Length: {len(answer.body)}\r\n{retry}Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + (answer.body if with_body else b"")
