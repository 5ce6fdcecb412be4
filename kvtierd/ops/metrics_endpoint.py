"""The daemon's side of the Prometheus endpoint: the listening socket, the exporter
process that serves it (``kvtierd.ops.metrics_exporter``: why a process) and the
snapshots that process asks for.

:meth:`MetricsEndpoint.start` binds ``server.metrics_address`` on the event loop
(the address taken or not local stops the daemon's start) and starts a thread,
``kvtierd-metrics``, which starts the exporter with the listening socket (a plain
exec of ``python -m kvtierd.ops.metrics_exporter``, as the daemon's other workers:
no fork of this gRPC-using process) and answers its asks: the state is collected on
the event loop (``collect``: the state the loop owns, read consistently, without a
lock), the text rendered on the thread (``render``), and handed over.

Invariants:

* Per answered scrape the daemon's interpreter collects and renders once; for a
  connection, or a request the exporter refuses, it does nothing.
* The exporter dies with this thread (``PR_SET_PDEATHSIG``), hence with the daemon.
  One that exits alone is started again, at most once every
  :data:`RESTART_SPACING_S`; the listening socket stays bound meanwhile (clients
  wait in its backlog).
* Each ask is answered with one frame; a collection the event loop has not run
  within ``collect_timeout`` is answered UNAVAILABLE and dropped; a text over
  ``max_text_bytes`` is answered FAILED, as a collection or render that raised.

``start`` and ``close`` run on the event loop; everything else on the thread,
except ``_collect_on_loop`` (the event loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtierd.ops.metrics_exporter import ASK, FAILED, FRAME, TEXT, UNAVAILABLE
from kvtierd.ops.metrics_http import EndpointLimits
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

Families = list[Any]  # prometheus_client Metric objects, built fresh per collection

RESTART_SPACING_S = 5.0  # an exporter started at most this often
STOP_WAIT_S = 5.0  # for an exporter to exit after its channel closed (then SIGKILL)


class MetricsEndpoint:
    """``GET /metrics`` on ``host:port``, served by an exporter process (see the
    module doc). ``collect`` runs on the event loop that called ``start`` and
    returns fresh metric families; ``render`` turns them into the exposition text
    on the endpoint's thread."""

    def __init__(
        self,
        address: str,
        collect: Callable[[], Families],
        render: Callable[[Families], bytes],
        limits: EndpointLimits | None = None,
    ) -> None:
        host, _, port = address.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._collect, self._render = collect, render
        self.limits = limits or EndpointLimits()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        # guards _closing being set against _channel being replaced: close() shuts
        # down the channel of the exporter running, never one started after it
        self._lock = threading.Lock()
        self._channel: socket.socket | None = None

    # -- the event loop's side ----------------------------------------------------------

    def start(self) -> None:
        """Binds and listens (``OSError`` when the address is taken or not local),
        then starts the thread that runs the exporter. Call from the daemon's loop."""
        self._loop = asyncio.get_running_loop()
        self._listener = socket.create_server(
            (self._host, self._port),
            family=socket.AF_INET6 if ":" in self._host else socket.AF_INET,
            backlog=self.limits.backlog,
        )
        self._thread = threading.Thread(target=self._run, name="kvtierd-metrics", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stops the exporter (it exits at the end of its channel; killed if it does
        not within ``STOP_WAIT_S``), then closes the listening socket."""
        with self._lock:
            self._closing.set()
            if self._channel is not None:
                _interrupt(self._channel)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, STOP_WAIT_S + 5.0)
        if self._listener is not None:
            self._listener.close()

    def _collect_on_loop(self, job: concurrent.futures.Future[Families]) -> None:
        if not job.set_running_or_notify_cancel():
            return  # the thread stopped waiting for it
        try:
            job.set_result(self._collect())
        except Exception as exc:  # a bug: the scrape answers 500, the loop goes on
            job.set_exception(exc)

    # -- the endpoint's thread ----------------------------------------------------------

    def _run(self) -> None:
        """Runs an exporter and answers it; starts another when one exits alone."""
        started = -math.inf
        while not self._closing.wait(max(0.0, started + RESTART_SPACING_S - time.monotonic())):
            started = time.monotonic()
            exporter = self._start_exporter()
            if exporter is None:
                continue
            process, channel = exporter
            self._answer_asks(channel)
            self._stop_exporter(process, channel)

    def _start_exporter(self) -> tuple[subprocess.Popen[bytes], socket.socket] | None:
        """A new exporter and this end of its channel; None when closing or when it
        cannot be started (logged; tried again later)."""
        assert self._listener is not None
        level = logging.getLevelName(logging.getLogger(__name__).getEffectiveLevel())
        with self._lock:
            if self._closing.is_set():
                return None
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            listen_fd = self._listener.fileno()
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", "kvtierd.ops.metrics_exporter", str(os.getpid()),
                     str(listen_fd), str(theirs.fileno()), str(level), CONTENT_TYPE_LATEST],
                    pass_fds=[listen_fd, theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                )  # fmt: skip
            except OSError as exc:
                ours.close()
                log.error(
                    "metrics endpoint: cannot start its exporter: %s; trying again in %gs",
                    exc, RESTART_SPACING_S,
                )  # fmt: skip
                return None
            finally:
                theirs.close()
            self._channel = ours
        log.debug("metrics exporter started: pid %d", process.pid)
        return process, ours

    def _answer_asks(self, channel: socket.socket) -> None:
        """One frame per ask, until the channel ends (the exporter exited, or
        ``close`` shut it down)."""
        while True:
            try:
                ask = channel.recv(1)
            except OSError:
                return
            if ask != ASK:
                if ask:
                    log.error("metrics exporter sent %r, not an ask; stopping it", ask)
                return
            kind, body = self._snapshot()
            try:
                channel.sendall(FRAME.pack(len(body), kind))
                channel.sendall(body)
            except OSError:
                return

    def _snapshot(self) -> tuple[int, bytes]:
        """The frame answering one ask: a collection that starts now, rendered."""
        assert self._loop is not None
        limits = self.limits
        job: concurrent.futures.Future[Families] = concurrent.futures.Future()
        try:
            self._loop.call_soon_threadsafe(self._collect_on_loop, job)
            families = job.result(timeout=limits.collect_timeout)
        except concurrent.futures.TimeoutError:
            job.cancel()
            return UNAVAILABLE, (
                f"the daemon's event loop did not collect the metrics within "
                f"{limits.collect_timeout:g}s; retry\n"
            ).encode()
        except RuntimeError:  # the event loop is closed: the daemon is stopping
            return UNAVAILABLE, b"the daemon is stopping\n"
        except Exception:
            log.exception("metrics collection failed")
            return FAILED, b"the metrics collection failed; the daemon's log says why\n"
        try:
            text = self._render(families)
        except Exception:
            log.exception("metrics rendering failed")
            return FAILED, b"the metrics rendering failed; the daemon's log says why\n"
        if len(text) > limits.max_text_bytes:
            _limited.log(
                logging.ERROR,
                ("metrics", "size"),
                "metrics endpoint: the metrics text is %d bytes, over the %d the exporter "
                "takes; narrow server.metrics_pool_labels",
                len(text), limits.max_text_bytes,
            )  # fmt: skip
            return FAILED, b"the metrics text is too long; the daemon's log says more\n"
        return TEXT, text

    def _stop_exporter(self, process: subprocess.Popen[bytes], channel: socket.socket) -> None:
        """Ends the exporter whose channel ended and reaps it; says so unless closing."""
        with self._lock:
            self._channel = None
        _interrupt(channel)
        channel.close()
        try:
            code = process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if not self._closing.is_set():
            log.warning(
                "metrics exporter (pid %d) exited with status %s; starting another",
                process.pid, code,
            )  # fmt: skip


def _interrupt(channel: socket.socket) -> None:
    """Wakes the thread blocked on ``channel`` and ends the exporter's side (EOF)."""
    try:
        channel.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
