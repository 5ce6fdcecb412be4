"""The daemon's lifecycle: start, serve, and an ordered shutdown.

Start: the C heap's mmap threshold fixed -> no other process serving its sockets
(checked first: that is what a second daemon is told) -> secondary tier roots checked
-> pools and sessions tables -> gRPC server with health (NOT_SERVING) -> listeners ->
supervisor (leases, loop lag, heap trims) -> health SERVING.
SIGHUP re-reads the tokens and TLS files (``security.reload``).
Shutdown (SIGTERM / SIGINT; a second signal forces exit): health NOT_SERVING ->
stop accepting calls and let in-flight ones finish (``server.shutdown_grace``) ->
close every session (pins released, reservations aborted) -> let the tier
jobs in flight finish (cascades reach the disk; ``server.shutdown_grace``) ->
join the tiers' I/O threads -> close pools (journals drained and closed; region
files unlinked, or kept for the next daemon with ``memory.warm_restart``) -> remove
the socket files. A step that fails skips none after it (``ShutdownSteps``): it is
logged by name, and the first failure is raised once all ran (exit code 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvtierd.api.fastlane import FastLane, first_unix_path, lane_socket_path
from kvtierd.api.grpc_service import GrpcService
from kvtierd.api.handlers import RequestHandlers
from kvtierd.api.server import (
    TransportServers,
    add_listeners,
    bind_unix_socket,
    build_server,
    max_receive_bytes,
    refuse_served_sockets,
    set_health,
)
from kvtierd.api.watch import WatchStreams
from kvtierd.config import Config, ConfigError
from kvtierd.config.loader import data_directory
from kvtierd.core.pools import PoolTable, region_access_text
from kvtierd.core.sessions import SessionTable
from kvtierd.errors import StartupError
from kvtierd.kvevents.service import KvEventsService
from kvtierd.ops.metrics import Metrics, pool_labels_for
from kvtierd.ops.metrics_endpoint import MetricsEndpoint
from kvtierd.ops.sdnotify import notify, watchdog_interval
from kvtierd.ops.shmdir import prepare_shm_dir
from kvtierd.ops.takeover import OPEN_WAIT, Takeover, find_running_daemon
from kvtierd.security import region_access
from kvtierd.security.own_dirs import remove_if_empty
from kvtierd.security.reload import credential_reloader
from kvtierd.security.state import SecurityState
from kvtierd.security.tls import ServerTls, TlsFiles
from kvtierd.security.tokens import TokensFileError
from kvtierd.tiers import registry
from kvtierd.tiers.configured import ConfiguredTier, TierCheckError
from kvtierd.tiers.iopool import JOIN_S as IO_JOIN_S
from kvtierd.util.heap import HeapTrimmer, tune_malloc
from kvtierd.util.sockets import PublishError, SocketPlacement
from kvtierd.util.units import format_bytes
from kvtierd_client.wire.peer_ticket import ticket_socket_path

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def resolve_group(name: str) -> int | None:
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError("server.socket_group", f"no such group: {name!r}") from None


class ShutdownSteps:
    """Runs the steps of a shutdown so that a step that fails skips none after it.

    A step that raises an ``Exception`` is logged once, at ERROR, with its name and
    traceback; the first such exception is kept and :meth:`raise_first` raises it
    again, once every step ran (the exit code then says the stop was not clean:
    ``kvtierd.ops.cli``). Anything else (``CancelledError``, ``SystemExit``) ends
    the shutdown at once, as it would any coroutine.
    """

    def __init__(self) -> None:
        self.failed: list[str] = []  # the names of the steps that raised, in order
        self._first: Exception | None = None

    def run(self, name: str, step: Callable[..., _T], *args: Any) -> _T | None:
        """``step(*args)``; its result, or None when it raised."""
        try:
            return step(*args)
        except Exception as exc:
            self._failed(name, exc)
            return None

    async def run_async(self, name: str, step: Awaitable[_T]) -> _T | None:
        """``await step``; its result, or None when it raised."""
        try:
            return await step
        except Exception as exc:
            self._failed(name, exc)
            return None

    def raise_first(self) -> None:
        """Raises the first failure again (marked logged: see :func:`logged`); nothing
        when every step succeeded."""
        if self._first is not None:
            setattr(self._first, _LOGGED, True)
            raise self._first

    def _failed(self, name: str, exc: Exception) -> None:
        log.error("shutdown step %r failed; going on with the others", name, exc_info=exc)
        self.failed.append(name)
        if self._first is None:
            self._first = exc


_LOGGED = "_kvtierd_logged_with_traceback"


def logged(exc: BaseException) -> bool:
    """Whether ``exc`` was logged with its traceback where it happened before being
    raised again (a failed shutdown step): the process's last handler then says it
    in one line instead of a second traceback."""
    return bool(getattr(exc, _LOGGED, False))


class Daemon:
    """Owns every long-lived object of one daemon process. Event-loop only."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.gid = resolve_group(config.server.socket_group)
        self.security = build_security(config)
        tls_files = TlsFiles.from_config(config.security)
        self.tls = ServerTls(tls_files) if tls_files is not None else None  # None: plain TCP
        self.tiers: list[ConfiguredTier] = [
            registry.configure(tier.type, tier.name, tier.settings) for tier in config.tiers
        ]
        # with principals, region files are the daemon's alone: other uids get a
        # descriptor for the pools they may reach (security.region_access)
        region_mode = 0o600 if self.security.restricted else 0o660
        self.pools = PoolTable(
            config.memory,
            config.limits,
            self.gid,
            self.tiers,
            region_mode=region_mode,
            # an adopted region's old writers: their lease, then the write fence
            warm_fence_seconds=config.sessions.lease + config.sessions.write_quarantine,
            region_access=region_access_text(region_mode, self.gid, config.security.principals),
        )
        self.sessions = SessionTable(
            config.sessions.lease,
            config.sessions.max_sessions,
            write_quarantine=config.sessions.write_quarantine,
        )
        # SIGHUP: the tokens go into the one token store, the security state's
        # Authorizer (rebuilt and swapped whole), then the TLS files are re-read
        self.reloader = credential_reloader(
            config.security.tokens_file, self.security.reload_tokens, self.tls
        )
        self.metrics = Metrics(
            self.pools,
            self.sessions,
            pool_labels_for(config.server.metrics_pool_labels, self.security.restricted),
        )
        # the fast lane and the region-descriptor socket live next to the first Unix
        # socket; both transports call the same request handlers
        listen_path = first_unix_path(config.server.listen)
        self.fast_lane = self._fast_lane(listen_path)
        self.handlers = RequestHandlers(
            self.pools,
            self.sessions,
            self.security,
            max_keys_per_call=config.limits.max_keys_per_call,
            region_fd_socket=region_access.socket_path_for(listen_path) if listen_path else "",
            offer_lane=self.fast_lane.offer if self.fast_lane is not None else None,
            observe=self.metrics.observe_rpc,
            remote_lookup_wait=config.limits.remote_lookup_wait,
        )
        self.service = GrpcService(
            self.handlers,
            self.security,
            WatchStreams(
                config.limits.max_watch_streams,
                config.limits.watch_write_timeout,
                max_unread=config.limits.max_unread_watch_streams,
                principals=[principal.name for principal in config.security.principals],
            ),
        )
        self.pools.observe_job = self.metrics.observe_job
        self.sessions.observe_session = self._session_event
        self.security.observe_refused = self.metrics.observe_rpc
        if self.security.quotas:
            self.pools.admit_pool = self.security.quotas.check
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._stop = asyncio.Event()
        self._server: TransportServers | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._sockets: list[str] = []  # unix socket paths this daemon serves
        self._socket_dirs: list[str] = []  # socket directories it made (removed when empty)
        # where they are bound, and which files are this daemon's (kvtierd.util.sockets)
        self._placement = SocketPlacement(staged=True)
        self._region_fds: region_access.RegionFdServer | None = None
        self._takeover_task: asyncio.Task[None] | None = None  # waits for the old daemon
        self.kv_events: KvEventsService | None = None  # [kv_events], once bound
        # freed C heap back to the kernel after bursts (docs/design/memory.md)
        self._heap = HeapTrimmer()

    async def start(self) -> None:
        prepare_shm_dir(self.config.memory.shm_dir, self.gid, private=self.security.restricted)
        warning = budget_warning(self.config.memory.budget, self.config.memory.shm_dir)
        if warning is not None:
            log.warning("%s", warning)
        takeover = self._takeover()
        if takeover is None:  # a daemon serving the socket is named first, not what it holds
            refuse_served_sockets(self.config.server.listen)
        self._check_tiers(lock=takeover is None)  # a takeover locks once the old one is gone
        if takeover is None:
            await self._start_metrics()
            await self._start_kv_events()
        server, self._health = build_server(self.service, self.config.limits, self.security)
        await set_health(self._health, serving=False)
        listen = self.config.server.listen
        unix = tuple(address for address in listen if address.startswith("unix://"))
        self._add_listeners(server, listen if takeover is None else unix)
        self._serve_tickets()
        self._region_fds = region_access.serve_next_to(
            self._sockets, self.sessions, self.gid, self.security, self._placement
        )
        await self._serve_fast_lane()
        await server.start()
        self._server = server
        if takeover is None:
            self._publish()
        else:
            self._begin_takeover(takeover, server, tuple(a for a in listen if a not in unix))
        self._supervisor = asyncio.create_task(self._supervise_forever(), name="kvtierd-supervisor")
        await set_health(self._health, serving=True)
        interval = watchdog_interval()
        if interval is not None:
            self._watchdog = asyncio.create_task(self._ping_watchdog(interval))
        notify(f"READY=1\nSTATUS=serving on {', '.join(self.config.server.listen)}")
        log.info(
            "kvtierd ready: pid %d, serving on %s, budget %s in %s, lease %gs",
            os.getpid(), ", ".join(self.config.server.listen),
            format_bytes(self.config.memory.budget), self.config.memory.shm_dir,
            self.config.sessions.lease,
        )  # fmt: skip

    async def _start_kv_events(self) -> None:
        """With ``[kv_events]``: starts the publisher's process (kvtierd.kvevents), which
        binds the endpoint, and hands it to the pool table, which attaches each
        published pool as it opens."""
        if not self.config.kv_events.enabled:
            return
        service = KvEventsService(
            self.config.kv_events, data_directory(os.environ), socket_gid=self.gid
        )
        try:
            await service.start()
        except OSError as exc:
            raise StartupError("kv_events.endpoint", str(exc)) from None
        self.kv_events = service
        self.pools.kv_events = service

    def _add_listeners(self, server: TransportServers, addresses: tuple[str, ...]) -> None:
        tls = self.tls.server_credentials if self.tls is not None else None
        add_listeners(
            server, addresses, self.gid, self._sockets, tls, self._placement, self._socket_dirs
        )

    def _publish(self) -> None:
        """The sockets at their paths from now on, all or none (kvtierd.util.sockets)."""
        try:
            self._placement.publish()
        except PublishError as exc:
            raise StartupError("server.listen", str(exc)) from None

    def _takeover(self) -> Takeover | None:
        """With ``server.takeover`` and a daemon of this user serving the first Unix
        listen path: the takeover of it, this daemon's sockets then bound at
        temporary names (``kvtierd.ops.takeover``). None: an ordinary start."""
        if not self.config.server.takeover:
            return None
        path = first_unix_path(self.config.server.listen)
        if path is None:
            raise ConfigError("server.takeover", "a takeover needs a unix:// listen address")
        old = find_running_daemon(path)
        if old is None:
            log.info("server.takeover: no daemon serves %s; starting as usual", path)
            return None
        self._placement = SocketPlacement(takeover=True)
        grace = self.config.server.shutdown_grace
        # the old daemon's stop: calls in flight, tier jobs, then its pools' journals
        return Takeover(old, self._placement, stop_timeout=3 * grace + 30.0)

    def _begin_takeover(
        self, takeover: Takeover, server: TransportServers, tcp: tuple[str, ...]
    ) -> None:
        """Publishes the sockets and stops the old daemon; OpenSession waits (at most
        ``OPEN_WAIT`` s a call) until it has exited and this daemon holds the tiers'
        locks, then what could not be shared starts: TCP listeners, metrics."""
        pools_ready = asyncio.Event()
        self.handlers.hold_pools_until(
            pools_ready,
            OPEN_WAIT,
            f"the daemon being replaced (pid {takeover.old.pid}) has not exited yet",
        )
        takeover.publish()
        self._takeover_task = asyncio.create_task(
            self._finish_takeover(takeover, server, tcp, pools_ready), name="kvtierd-takeover"
        )

    async def _finish_takeover(
        self,
        takeover: Takeover,
        server: TransportServers,
        tcp: tuple[str, ...],
        pools_ready: asyncio.Event,
    ) -> None:
        try:
            await takeover.wait_gone()
            self._lock_tiers()
        except ConfigError as exc:  # a third daemon holds a root: no pool may open
            log.error("after the takeover: %s; stopping", exc)
            self.request_stop()
            return
        except OSError:  # the pidfd failed: whether the old daemon is gone is unknown
            log.exception("the takeover cannot wait for the previous daemon; stopping")
            self.request_stop()
            return
        try:
            await self._start_kv_events()
        except StartupError as exc:  # the old daemon's endpoint not free yet, or taken
            log.error("after the takeover: %s; no KV events are published", exc)
        pools_ready.set()
        try:
            if tcp:
                self._add_listeners(server, tcp)
                await server.start()
            await self._start_metrics()
        except StartupError as exc:  # the old daemon's port not free yet, or taken
            log.error("after the takeover: %s", exc)

    def reload_credentials(self) -> None:
        """SIGHUP: re-read the tokens and TLS files (``security.reload``); nothing
        else changes and no session or connection is dropped."""
        self.reloader.reload_all()

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def shutdown(self) -> None:
        """Ordered shutdown (the module docstring); each step runs even if an earlier
        one failed (:class:`ShutdownSteps`): a tier whose ``shutdown()`` raises still
        leaves the pools closed and the sockets removed. Each failure is logged once,
        naming its step; the first is raised again once every step ran."""
        log.info("shutting down: refusing new calls, finishing in-flight ones")
        notify("STOPPING=1")
        steps = ShutdownSteps()
        steps.run("refuse new calls", self._refuse_calls)
        stopping = None
        if self._server is not None:
            await steps.run_async("health NOT_SERVING", set_health(self._health, serving=False))
            # GOAWAY first: a client's next call opens a new connection (to the
            # daemon that took over, if any: docs/operations/upgrades.md) ...
            stopping = steps.run("servers", self._begin_server_stop, self._server)
            await asyncio.sleep(0)
        if self.fast_lane is not None:
            # ... then every lane cut (their sessions close below): its clients learn
            # at once that the session is gone (NOT_FOUND) and reopen one there
            steps.run("fast lane", self.fast_lane.close)
        if stopping is not None:
            await steps.run_async("in-flight calls", stopping)
        await steps.run_async("background tasks", self._cancel_background_tasks())
        steps.run("sessions", self.sessions.close_all, "closed by daemon shutdown")
        await steps.run_async("peer tickets", self.security.tickets.close())
        await steps.run_async("tier jobs in flight", self._drain_tiers())
        for tier in self.tiers:
            # joins the tier's I/O threads: nothing of it touches a region after this.
            # One that failed may still copy rows: closing the regions is safe anyway
            # (a region's rows wait for the copies in flight, then refuse new ones:
            # kvtierd.primary.rows)
            steps.run(f"tier {tier.name}", tier.shutdown)
        steps.run("dropped tier jobs", self._report_dropped_jobs)
        await steps.run_async(
            "pools", self.pools.close_all(wait_for_creations=self.config.server.shutdown_grace)
        )
        if self.kv_events is not None:  # after the pools: their last events are sent
            await steps.run_async("kv events", self.kv_events.stop())
        if self._region_fds is not None:
            steps.run("region descriptor socket", self._region_fds.close)
        # never a socket a daemon that took over put there
        steps.run("socket files", self._placement.remove_own)
        for directory in self._socket_dirs:
            # kept while a daemon that took over serves there
            steps.run(f"socket directory {directory}", remove_if_empty, directory)
        if self._metrics_endpoint is not None:
            await steps.run_async("metrics endpoint", self._metrics_endpoint.close())
        if steps.failed:
            log.error(
                "shutdown done, but %d steps failed: %s (each logged above)",
                len(steps.failed), ", ".join(steps.failed),
            )  # fmt: skip
        else:
            log.info("shutdown complete")
        steps.raise_first()

    def _refuse_calls(self) -> None:
        """New calls refused; every watch stream ends."""
        self.handlers.stop_accepting()
        for pool in self.pools:
            pool.events.wake_all()

    def _begin_server_stop(self, server: TransportServers) -> asyncio.Future[None]:
        """The servers' stop begun (GOAWAY now); the future it returns ends when the
        calls in flight finished, or after ``server.shutdown_grace``."""
        return asyncio.ensure_future(server.stop(self.config.server.shutdown_grace))

    async def _cancel_background_tasks(self) -> None:
        for task in (self._supervisor, self._watchdog, self._takeover_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _report_dropped_jobs(self) -> None:
        dropped = sum(tier.dropped_jobs for tier in self.tiers)
        if dropped:
            log.warning(
                "stopping: %d queued tier jobs dropped (their cascades are not in the tier, "
                "their promotions answer MISS)", dropped,
            )  # fmt: skip

    def _session_event(self, event: str, session: Any, reason: str) -> None:
        """``SessionTable``'s hook: a session that ends ends its fast lane; every
        session opened, closed or expired is audited."""
        if self.fast_lane is not None:
            self.fast_lane.session_ended(event, session, reason)
        self.security.session_event(event, session, reason)

    def _fast_lane(self, listen_path: str | None) -> FastLane | None:
        """With ``server.fast_lane`` and a Unix socket to listen on, the lane next to it
        (``kvtierd.api.fastlane``): sessions opened over a Unix socket are offered it,
        and a session that ends ends its lane (``_session_event``). It serves from
        :meth:`start` on."""
        if not self.config.server.fast_lane or listen_path is None:
            return None
        lane = FastLane(
            lane_socket_path(listen_path),
            self.sessions,
            self.security,
            max_frame_bytes=max_receive_bytes(self.config.limits),
            max_connections=self.config.sessions.max_sessions + 64,
            # a lane reader that stalls is cut as a stalled WatchEvents reader is
            write_timeout=self.config.limits.watch_write_timeout,
        )
        return lane

    async def _serve_fast_lane(self) -> None:
        """The lane's socket bound and served, through the request handlers."""
        if self.fast_lane is None:
            return
        listener = bind_unix_socket(self.fast_lane.path, self.gid, "fast lane", self._placement)
        self._sockets.append(self.fast_lane.path)
        await self.fast_lane.serve(listener, self.handlers)

    def _serve_tickets(self) -> None:
        """With principals, a ticket socket next to each Unix socket: how local
        clients prove their uid (``kvtierd.security.tickets``)."""
        if not self.security.restricted:
            return
        for path in list(self._sockets):
            tickets = ticket_socket_path(path)
            self.security.tickets.serve(
                bind_unix_socket(tickets, self.gid, placement=self._placement)
            )
            self._sockets.append(tickets)

    async def _start_metrics(self) -> None:
        """The metrics endpoint (``kvtierd.ops.metrics_endpoint``): an exporter process
        serves it; the state is collected on this loop when it asks for a scrape."""
        address = self.config.server.metrics_address
        if not address:
            return
        endpoint = MetricsEndpoint(address, self.metrics.collect, self.metrics.render)
        try:
            endpoint.start()
        except OSError as exc:
            raise StartupError("server.metrics_address", metrics_refusal(address, exc)) from None
        self._metrics_endpoint = endpoint
        shown = self.metrics.pool_labels.patterns
        log.info(
            "metrics on http://%s/metrics (pool series: %s)",
            address, ", ".join(shown) if shown else "none (server.metrics_pool_labels)",
        )  # fmt: skip

    def _check_tiers(self, lock: bool = True) -> None:
        """Each configured tier checks its resources (and, with ``lock``, takes its
        locks: ``_lock_tiers``); the first refusal stops the start with exit code 2,
        naming the option at fault."""
        for configured, tier in zip(self.tiers, self.config.tiers, strict=True):
            try:
                configured.check() if lock else configured.check_unlocked()
            except TierCheckError as exc:
                raise ConfigError(f"{tier.key}.{exc.option}", str(exc)) from None
            log.info("tier %s: %s", tier.name, configured.describe())

    def _lock_tiers(self) -> None:
        """After a takeover: the locks ``_check_tiers(lock=False)`` left (fs roots)."""
        for configured, tier in zip(self.tiers, self.config.tiers, strict=True):
            try:
                configured.lock()
            except TierCheckError as exc:
                raise ConfigError(f"{tier.key}.{exc.option}", str(exc)) from None

    async def _drain_tiers(self) -> None:
        """Lets the tier jobs in flight finish, for at most ``server.shutdown_grace``;
        says how many had not (the queued ones are then dropped by the tiers'
        shutdown, the running ones get its bounded join)."""
        grace = self.config.server.shutdown_grace
        try:
            await asyncio.wait_for(self.pools.drain(), timeout=grace)
        except asyncio.TimeoutError:
            left = sum(pool.tiering.jobs_in_flight for pool in self.pools)
            log.warning(
                "stopping: %d tier jobs not finished within server.shutdown_grace (%gs); "
                "the queued ones are dropped, the running ones get %gs more",
                left, grace, IO_JOIN_S,
            )  # fmt: skip

    async def _ping_watchdog(self, interval: float) -> None:
        """Pings systemd's watchdog from the event loop: a stuck loop stops the pings."""
        while True:
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _supervise_forever(self) -> None:
        """Every tick: measure how late the loop woke us (its lag), credit a stall
        to every lease, free quarantined rows whose time came, expire leases, and
        let the heap trimmer look at the resident memory (once a second).

        A tick that wakes ``lag`` seconds late means nothing ran on the loop for
        that long (region creation used to block it for seconds): no client
        could be heard, so the leases are moved forward by the lag before any
        expiry is decided. A lease never expires because the daemon stalled.
        """
        tick = min(_SUPERVISOR_TICK, self.config.sessions.lease / 8)
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(tick)
            lag = loop.time() - before - tick
            try:
                self._supervise_once(lag)
            except Exception:  # a bug here must not stop lease enforcement
                log.exception("session supervisor failed; continuing")

    def _supervise_once(self, lag: float) -> None:
        self.metrics.observe_loop_lag(max(lag, 0.0))
        # A quarter of a short lease: a stall below 0.25 s can outlast a whole lease
        # of 0.1-0.25 s (sessions that kept themselves alive expired with it).
        if lag > min(_STALL_CREDITED_AFTER, self.config.sessions.lease / 4):
            self.sessions.credit_stall(lag)
            log.log(
                logging.WARNING if lag > _STALL_CREDITED_AFTER else logging.DEBUG,
                "the event loop stalled for %.3fs; every lease was extended by that", lag,
            )  # fmt: skip
        now = time.monotonic()
        for pool in self.pools:
            pool.release_quarantine(now)
        self.sessions.expire()
        self._heap.tick(now)


# The supervisor's period, and the loop lag above which a stall is credited to
# the leases (below it, lag is scheduling noise well inside any lease; for a
# lease under 1 s the bound is a quarter of the lease).
_SUPERVISOR_TICK = 0.1
_STALL_CREDITED_AFTER = 0.25


def metrics_refusal(address: str, exc: OSError) -> str:
    """What to say when the metrics endpoint cannot listen on ``address``: in use
    is most often a second daemon started with the default port."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on {address}: address already in use; another kvtierd may be "
            "running: stop it, or give this daemon another port (--metrics-address "
            "HOST:PORT) or none (--metrics-address '', server.metrics_address = \"\")"
        )
    # asyncio's message repeats the address; a resolver error (negative errno) has its own
    reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
    return f"cannot listen on {address}: {reason}"


def build_security(config: Config) -> SecurityState:
    """The security state of ``config``: its principals and its tokens file (read
    now; an unusable one is a ConfigError, exit code 2)."""
    security = config.security
    try:
        return SecurityState(
            security.principals,
            security.tokens_file,
            max_ticket_holders=config.sessions.max_sessions,
            # mTLS: the TCP transport verified every client's certificate, which
            # names the caller (``identity.tls_peer_names``)
            client_certificates=bool(security.tls_client_ca_file),
            unix_only=all(address.startswith("unix:") for address in config.server.listen),
        )
    except TokensFileError as exc:
        raise ConfigError("security.tokens_file", str(exc)) from None


def budget_warning(budget: int, shm_dir: str) -> str | None:
    """What to say when ``memory.budget`` is more than this machine's memory or the
    size of the file system of ``shm_dir`` (the region files live there): the
    daemon starts anyway (a pool is refused when its region cannot be made). None
    when it fits both."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mount = os.statvfs(shm_dir)
    shm_size = mount.f_blocks * mount.f_frsize
    over = []
    if budget > machine:
        over.append(f"this machine's memory ({format_bytes(machine)})")
    if budget > shm_size:
        over.append(f"the size of the file system of {shm_dir} ({format_bytes(shm_size)})")
    if not over:
        return None
    return (
        f"memory.budget ({format_bytes(budget)}) is more than {' and '.join(over)}: pools "
        "are refused (or the machine runs short of memory) before the budget is reached; "
        "lower memory.budget (--memory-budget)"
    )


async def serve(config: Config) -> None:
    """Runs the daemon until SIGTERM / SIGINT."""
    tune_malloc()  # before the daemon allocates what it keeps (kvtierd.util.heap)
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            log.warning("second %s: exiting immediately", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s received", signal.Signals(signum).name)
        daemon.request_stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload_credentials)
    try:
        try:
            await daemon.start()
        except BaseException as exc:
            refused: BaseException | None = exc
        else:
            refused = None
        if refused is not None:  # out of the except: the steps' logs don't chain to it
            # the start's error is the one to report; the shutdown's were logged
            with contextlib.suppress(Exception):
                await daemon.shutdown()
            raise refused
        await daemon.wait_stopped()
        await daemon.shutdown()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
