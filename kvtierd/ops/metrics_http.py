"""The Prometheus endpoint's HTTP rules: its bounds, its token buckets, and the
answers it writes. The metrics exporter process (``kvtierd.ops.metrics_exporter``)
applies them; the daemon's interpreter never does (``kvtierd.ops.metrics_endpoint``).

Bounds, all fixed (:class:`EndpointLimits`):

* at most ``max_connections`` connections served at once: past that the exporter
  stops accepting (new ones wait in the kernel's listen backlog of ``backlog``;
  past that the kernel drops their SYNs and the clients retry);
* per peer a token bucket of ``peer_burst`` connections refilled at ``peer_rate``
  a second, taken when the connection is accepted: a connection past it gets a
  fixed ``429 Too Many Requests`` with ``Retry-After`` and is closed, its request
  never parsed. The answer is given once the Retry-After has passed, so that a
  client that retries at once waits instead of spinning on refusals (32 threads
  of one user made 3,500 requests a second and took 70-86 % of a core of a
  2-vCPU machine, which the daemon then lacked); at most ``max_held`` refusals
  wait at once, the others are answered at once. The peer is the *user* that
  owns the client's socket when that socket is on this host
  (``kvtierd.util.tcpowner``), so one user is one peer whatever address of
  127.0.0.0/8 it connects from, and two users on 127.0.0.1 are two peers; a peer
  elsewhere is its address;
* a request's head within ``head_timeout`` and ``max_head_bytes``; the answer
  written within ``write_timeout``; one request per connection (``Connection:
  close``);
* one bucket of ``render_burst`` scrapes at ``render_rate`` a second for every
  peer together (each answered scrape costs the daemon a collection and a
  render): a scrape past it is answered ``429`` too.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EndpointLimits:
    """The endpoint's bounds (see the module doc)."""

    max_connections: int = 64
    backlog: int = 64
    head_timeout: float = 2.0  # seconds for the request line and headers
    write_timeout: float = 5.0  # seconds for the answer to be taken
    collect_timeout: float = 5.0  # seconds the event loop may take to collect (else 503)
    max_head_bytes: int = 8192
    peer_rate: float = 1.0  # connections a second per peer (user, or address) ...
    peer_burst: int = 10  # ... after a burst of this many
    render_rate: float = 5.0  # scrapes a second, every peer together ...
    render_burst: int = 20  # ... after a burst of this many
    max_peers: int = 4096  # peers remembered (least recently seen forgotten)
    max_held: int = 512  # refused connections held until their Retry-After (then: at once)
    max_text_bytes: int = 64 << 20  # the exposition text the daemon hands over, at most


class TokenBuckets:
    """Token buckets by key: ``take(key)`` is 0.0 when a token was taken, else the
    seconds until one is there. At most ``max_keys`` keys are remembered (the least
    recently used one is forgotten: it comes back with a full bucket). Not
    thread-safe."""

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


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP answer: its status line's tail, body and headers."""

    status: str
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    retry_after: int = 0


def route(head: bytes) -> tuple[str, str]:
    """The method and path (query left out) of a request head; ValueError when the
    request line is not ``METHOD PATH ...``."""
    method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    return method, path.split("?", 1)[0]


def answer_for(method: str, path: str) -> Answer | None:
    """The answer to anything but a scrape (``GET`` or ``HEAD`` of ``/metrics``): None."""
    if method not in ("GET", "HEAD"):
        return Answer("405 Method Not Allowed", b"GET only\n")
    if path == "/":
        return Answer("200 OK", b"kvtierd: metrics at /metrics\n")
    if path != "/metrics":
        return Answer("404 Not Found", b"not found; try /metrics\n")
    return None


def too_many(wait: float, why: str) -> Answer:
    """``429`` with ``Retry-After``: whole seconds, at least 1."""
    seconds = max(1, math.ceil(wait))
    body = f"too many requests: {why}; retry in {seconds}s\n".encode()
    return Answer("429 Too Many Requests", body, retry_after=seconds)


def response_head(answer: Answer) -> bytes:
    """The status line and headers of ``answer`` (its body follows, unless HEAD)."""
    retry = f"Retry-After: {answer.retry_after}\r\n" if answer.retry_after else ""
    return (
        f"HTTP/1.1 {answer.status}\r\nContent-Type: {answer.content_type}\r\n"
        f"Content-Length: {len(answer.body)}\r\n{retry}Connection: close\r\n\r\n"
    ).encode("latin-1")
