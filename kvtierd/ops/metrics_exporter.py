"""The metrics exporter: the small process that serves ``server.metrics_address``.

Why a process: anyone who can reach the address (every local user, on the default
loopback address) may open connections and send requests. Served from a thread of
the daemon, every one of them still cost the daemon's interpreter (the lock its
event loop needs): 32 threads of one user, ~1,100 requests a second of which all
but 5 were answered 429, took the daemon from 31 to 77 % of a core and a probe's
Lookup p99 from 3.0-4.6 to 8.2-13.3 ms; and since the threads' peer was their
address, 128 addresses of 127.0.0.0/8 were 128 peers, and Prometheus, on
127.0.0.1 with them, got none of its scrapes through.

The daemon (``kvtierd.ops.metrics_endpoint``) binds the listening socket and starts
``python -m kvtierd.ops.metrics_exporter`` with it and one end of a socket pair.
This process does all the HTTP work (``kvtierd.ops.metrics_http``): it accepts,
finds the peer (the user owning the client's socket: ``kvtierd.util.tcpowner``),
refuses a peer past its bucket with a fixed 429 and closes the connection without
parsing it (once its Retry-After has passed: ``kvtierd.ops.metrics_http``), reads
and answers the others, and asks the daemon for a snapshot of the metrics only for
a scrape it will answer. It runs :data:`NICENESS` steps below
the daemon, so that on a small machine the CPU a flood costs it is taken from it
before it is taken from the daemon.

Invariants:

* The daemon's interpreter does one thing for an answered scrape (a collection and
  a render, at most ``render_rate`` a second and one at a time) and nothing for a
  connection.
* A scrape is answered with a snapshot the daemon began after the scrape arrived:
  a scrape joins the next ask to be sent, and one ask at a time is outstanding. So
  a client that scrapes after its call returned sees the call counted.
* Bounded: ``max_connections`` connections served at once (the rest wait in the
  kernel's backlog), ``max_held`` refused ones waiting for their answer, heads of
  ``max_head_bytes``, snapshots of ``max_text_bytes`` (a longer frame ends the
  exporter), sent without a copy per connection.
* It dies with the daemon: the kernel kills it when the daemon thread that started
  it ends (``kvtierd.util.workerproc``), and it exits at EOF of its channel.

Wire (one Unix stream socket): the exporter sends ``?`` (:data:`ASK`) for one
snapshot; the daemon answers each ask with one frame ``u32 length | u8 kind |
body`` (:data:`FRAME`): kind :data:`TEXT` (the exposition text), :data:`UNAVAILABLE`
(answered 503; the body says why) or :data:`FAILED` (answered 500; likewise).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence

from kvtierd.ops.metrics_http import (
    Answer,
    EndpointLimits,
    TokenBuckets,
    answer_for,
    response_head,
    route,
    too_many,
)
from kvtierd.util.ratelimit import RateLimitedLog
from kvtierd.util.tcpowner import TcpOwners, is_loopback
from kvtierd.util.workerproc import die_with

log = logging.getLogger("kvtierd.ops.metrics_exporter")  # its name also when run as __main__
_limited = RateLimitedLog(log)

ASK = b"?"
FRAME = struct.Struct("<IB")  # body length, kind
TEXT, UNAVAILABLE, FAILED = 0, 1, 2
_STATUS = {TEXT: "200 OK", UNAVAILABLE: "503 Service Unavailable"}
NICENESS = 10  # steps below the daemon's scheduling priority
ACCEPT_BATCH = 64  # connections accepted per wake-up, at most (then the loop runs others)
ACCEPT_RETRY_S = 0.1  # after accept failed (EMFILE and the like)
DROP_BYTES = 16384  # of a refused client's request, dropped unparsed before the close
HANDOVER_S = 5.0  # beyond collect_timeout: the daemon's render and the frame's transfer
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # kvtierd.ops.cli's


class ChannelClosed(ConnectionError):
    """The daemon closed the channel (or sent what it never sends)."""


class Snapshots:
    """The exporter's end of the channel: :meth:`fresh` is a snapshot the daemon
    began after the call. Event loop only."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_bytes: int
    ) -> None:
        self._reader, self._writer, self._max_bytes = reader, writer, max_bytes
        # Invariant: _sent is the one ask the daemon has not answered yet (None: none);
        # _next gathers the scrapes that arrived since it was sent.
        self._sent: asyncio.Future[tuple[int, bytes]] | None = None
        self._next: asyncio.Future[tuple[int, bytes]] | None = None

    async def fresh(self) -> tuple[int, bytes]:
        """The kind and body of a frame answering an ask sent after now."""
        waiting = self._next
        if waiting is None:
            waiting = self._next = asyncio.get_running_loop().create_future()
            if self._sent is None:
                self._send_next()
        return await asyncio.shield(waiting)  # one scrape timing out leaves the others

    def _send_next(self) -> None:
        self._sent, self._next = self._next, None
        self._writer.write(ASK)

    async def run(self) -> None:
        """Reads the daemon's frames until it closes the channel; then every scrape
        still waiting fails with :class:`ChannelClosed`."""
        try:
            while True:
                length, kind = FRAME.unpack(await self._reader.readexactly(FRAME.size))
                if length > self._max_bytes:
                    raise ChannelClosed(f"a frame of {length} bytes, over {self._max_bytes}")
                body = await self._reader.readexactly(length)
                sent, self._sent = self._sent, None
                if sent is None:
                    raise ChannelClosed("a frame nobody asked for")
                sent.set_result((kind, body))
                if self._next is not None:
                    self._send_next()
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            for waiting in (self._sent, self._next):
                if waiting is not None and not waiting.done():
                    waiting.set_exception(ChannelClosed(str(exc)))
                    waiting.exception()  # retrieved: the scrapes that wait for it see it
            if isinstance(exc, ChannelClosed):
                log.error("metrics exporter: the daemon's channel broke: %s; exiting", exc)


class Exporter:
    """Serves ``listener`` (see the module doc) with ``snapshots`` of the daemon's
    metrics. Event loop only."""

    def __init__(
        self,
        listener: socket.socket,
        snapshots: Snapshots,
        owners: TcpOwners,
        content_type: str,
        limits: EndpointLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._listener, self._snapshots, self._owners = listener, snapshots, owners
        self._content_type = content_type
        self.limits = limits = limits or EndpointLimits()
        self._peers = TokenBuckets(limits.peer_rate, limits.peer_burst, limits.max_peers, clock)
        self._renders = TokenBuckets(limits.render_rate, limits.render_burst, 1, clock)
        self._tasks: set[asyncio.Task[None]] = set()  # Invariant: <= max_connections
        self._accepting = False
        self._backing_off = False  # accept failed: resumes after ACCEPT_RETRY_S
        # refused connections held until their Retry-After; Invariant: <= max_held
        self._held: set[socket.socket] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self) -> None:
        """Serves until the daemon closes the channel."""
        self._loop = asyncio.get_running_loop()
        self._listener.setblocking(False)
        self._start_accepting()
        try:
            await self._snapshots.run()
        finally:
            self._stop_accepting()
            for task in list(self._tasks):
                task.cancel()
            for connection in self._held:
                connection.close()
            self._held.clear()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._listener.close()

    # -- accepting ------------------------------------------------------------------

    def _start_accepting(self) -> None:
        if not self._accepting and self._loop is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept_some)
            self._accepting = True

    def _stop_accepting(self) -> None:
        if self._accepting and self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._accepting = False

    def _accept_some(self) -> None:
        """Accepts what the backlog holds, ``ACCEPT_BATCH`` at most; stops accepting
        while ``max_connections`` are served (the kernel's backlog holds the rest)."""
        for _ in range(ACCEPT_BATCH):
            if len(self._tasks) >= self.limits.max_connections:
                self._stop_accepting()
                return
            try:
                connection, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: keep serving the others
                _limited.warning(("metrics", "accept"), "metrics endpoint: accept failed: %s", exc)
                self._back_off()
                return
            self._admit(connection, peer)

    def _back_off(self) -> None:
        assert self._loop is not None
        self._stop_accepting()
        self._backing_off = True

        def resume() -> None:
            self._backing_off = False
            self._start_accepting()

        self._loop.call_later(ACCEPT_RETRY_S, resume)

    def _admit(self, connection: socket.socket, peer: tuple[str, int]) -> None:
        """Serves ``connection``, or refuses it before reading a byte of it."""
        who = self._peer_of(connection, peer)
        if who is None:  # a local client whose socket is already gone
            connection.close()
            return
        wait = self._peers.take(who)
        if wait:
            self._refuse(connection, who, wait)
            return
        assert self._loop is not None
        task = self._loop.create_task(self._serve_one(connection))
        self._tasks.add(task)
        task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._backing_off and len(self._tasks) < self.limits.max_connections:
            self._start_accepting()

    def _peer_of(self, connection: socket.socket, peer: tuple[str, int]) -> str | None:
        """Whose bucket a connection takes from: ``uid N`` when the client's socket
        is on this host, else its address; every loopback client together when
        this host does not tell owners; None when the client's socket is gone."""
        try:
            local = connection.getsockname()
        except OSError:
            return None
        uid = self._owners.owner(local[:2], peer[:2])
        if uid is not None:
            return f"uid {uid}"
        if not is_loopback(peer[0]):
            return str(peer[0])
        return None if self._owners.available else "loopback"

    def _refuse(self, connection: socket.socket, who: str, wait: float) -> None:
        """Answers 429 without reading the request: once its Retry-After has passed
        (a client that retries at once waits for it, instead of spinning on
        refusals), or now when ``max_held`` refusals wait already."""
        rate = self.limits.peer_rate
        _limited.warning(
            ("metrics", "peer"),
            "metrics endpoint: %s is over %g requests a second; answering 429",
            who, rate,
        )  # fmt: skip
        answer = too_many(wait, f"over {rate:g} requests a second")
        if len(self._held) >= self.limits.max_held or self._loop is None:
            _answer_and_close(connection, answer)
            return
        self._held.add(connection)
        self._loop.call_later(answer.retry_after, self._release, connection, answer)

    def _release(self, connection: socket.socket, answer: Answer) -> None:
        if connection in self._held:  # else closed by the end of serve()
            self._held.discard(connection)
            _answer_and_close(connection, answer)

    # -- serving one connection -------------------------------------------------------

    async def _serve_one(self, connection: socket.socket) -> None:
        assert self._loop is not None
        limits = self.limits
        try:
            connection.setblocking(False)
            head = await asyncio.wait_for(self._read_head(connection), limits.head_timeout)
            method, path = route(head)
            answer = answer_for(method, path) or await self._scrape()
            await asyncio.wait_for(
                self._send(connection, answer, with_body=method != "HEAD"), limits.write_timeout
            )
        except (asyncio.TimeoutError, ConnectionError, ValueError):
            pass  # a broken, slow or oversized request: nothing to answer
        except OSError:
            pass  # the client went away
        except Exception:
            log.exception("metrics request failed")
        finally:
            connection.close()

    async def _read_head(self, connection: socket.socket) -> bytes:
        """The request line and headers; ValueError past ``max_head_bytes``."""
        assert self._loop is not None
        head = bytearray()
        while b"\r\n\r\n" not in head:
            room = self.limits.max_head_bytes - len(head)
            if room <= 0:
                raise ValueError("request head too long")
            chunk = await self._loop.sock_recv(connection, room)
            if not chunk:
                raise ConnectionError("closed before the end of the request head")
            head += chunk
        return bytes(head)

    async def _send(self, connection: socket.socket, answer: Answer, with_body: bool) -> None:
        assert self._loop is not None
        await self._loop.sock_sendall(connection, response_head(answer))
        if with_body:
            await self._loop.sock_sendall(connection, memoryview(answer.body))

    async def _scrape(self) -> Answer:
        wait = self._renders.take("")
        if wait:
            return too_many(wait, f"over {self.limits.render_rate:g} scrapes a second")
        deadline = self.limits.collect_timeout + HANDOVER_S
        try:
            kind, body = await asyncio.wait_for(self._snapshots.fresh(), deadline)
        except asyncio.TimeoutError:
            why = f"the daemon did not hand over the metrics within {deadline:g}s; retry\n"
            return Answer("503 Service Unavailable", why.encode())
        if kind == TEXT:
            return Answer("200 OK", body, self._content_type)
        return Answer(_STATUS.get(kind, "500 Internal Server Error"), body)


def _answer_and_close(connection: socket.socket, answer: Answer) -> None:
    """Writes ``answer`` if the socket takes it at once, and closes the socket. What
    the client sent is dropped unparsed first, so that the close is an end of
    stream after the answer (bytes left unread make it a reset, which may reach a
    client before it read the answer)."""
    try:
        connection.recv(DROP_BYTES, socket.MSG_DONTWAIT)
    except OSError:
        pass  # nothing sent yet (EAGAIN)
    try:
        connection.send(response_head(answer) + answer.body, socket.MSG_DONTWAIT)
    except OSError:
        pass  # gone, or not taking even that: closed all the same
    finally:
        connection.close()


async def _serve(listener: socket.socket, channel: socket.socket, content_type: str) -> None:
    limits = EndpointLimits()
    reader, writer = await asyncio.open_connection(sock=channel)
    owners = TcpOwners()
    if not owners.check(listener):
        log.warning(
            "metrics endpoint: this host does not tell who owns a local connection "
            "(NETLINK_SOCK_DIAG); every local user shares one request bucket"
        )
    try:
        snapshots = Snapshots(reader, writer, limits.max_text_bytes)
        await Exporter(listener, snapshots, owners, content_type, limits).serve()
    finally:
        owners.close()
        writer.close()


def main(argv: Sequence[str]) -> int:
    """``DAEMON_PID LISTEN_FD CHANNEL_FD LOG_LEVEL CONTENT_TYPE`` (started by kvtierd)."""
    try:
        daemon_pid, listen_fd, channel_fd = (int(arg) for arg in argv[:3])
        level, content_type = argv[3], argv[4]
    except (ValueError, IndexError):
        print("usage: python -m kvtierd.ops.metrics_exporter DAEMON_PID LISTEN_FD CHANNEL_FD "
              "LOG_LEVEL CONTENT_TYPE (started by kvtierd)", file=sys.stderr)  # fmt: skip
        return 2
    if not die_with(daemon_pid):
        return 1  # the daemon thread that started us is already gone
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    try:
        os.nice(NICENESS)
    except OSError:
        pass  # refused (a seccomp filter): serve at the daemon's priority
    listener = socket.socket(fileno=listen_fd)
    channel = socket.socket(fileno=channel_fd)
    asyncio.run(_serve(listener, channel, content_type))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
