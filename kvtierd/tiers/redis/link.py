"""The link of one configured redis tier to its server: a standalone server or a Cluster.

One :class:`RedisLink` per configured redis tier, shared by its pools, used on
I/O threads (every method but :meth:`RedisLink.route` may block up to
``timeout``; none of them is ever called on the event loop). It decides the
server's mode, routes each key to the node that owns it, and keeps the server's
health (nodes, round trips, memory).

Mode: ``cluster = false`` a :class:`redis.Redis` of the first URL; ``true`` a
:class:`redis.cluster.RedisCluster` seeded with every URL; ``"auto"`` asks the
URLs in turn (``INFO cluster``, ``cluster_enabled:1``) and picks. The client is
built lazily at the first call that needs it (a pool's ``prepare``, off the
loop): a server that is down then is a fault like any other, and the next call
(at most one try every :data:`RESOLVE_RETRY_S`) tries again.

Keys route with the library's slot map (redis-py's ``RedisCluster``: it follows
MOVED and ASK, and re-reads the topology after a connection error, a MOVED
streak or CLUSTERDOWN). The hot paths go to the owning node's own client
directly, so that

* a store sends the row as a separate buffer of one ``SET`` (no 2 MiB join);
* a presence probe is one pipeline of ``EXISTS`` per node, all written before
  any is read (one round trip in all), and a node that is down fails its own
  keys only (redis-py's cluster pipeline fails the whole batch when one node's
  connection cannot be had);
* a redirect (MOVED / ASK: a resharding or a failover) falls back to the
  cluster client for that key, which follows it and updates the slot map.

A connection error or timeout on a node asks for a topology refresh
(:meth:`_suspect_topology`: at most one every :data:`TOPOLOGY_REFRESH_S`), so
a failover's new master is found without waiting for a MOVED; a node restarted
on its address is used again at the next call (the pools reconnect).

A node's fault is logged once (a node that flaps is one fault), and a node that
timed out is skipped for ``max(timeout, 1 s)``, then tried by one call at a time:
:mod:`kvtierd.tiers.redis.nodefaults`. Why skip: every cascade pins its primary
block until the tier reports, and a node that stopped answering without a reset (a
hung host, a black-holed route) made each block wait ``timeout`` on a thread, which
throttled the primary's stores to ``threads / timeout`` blocks a second (an attack
test). No server reached at all (the client cannot be built) is one WARNING too.

:meth:`RedisLink.route` is the one method the event loop calls (the slot map only).

Multi-key commands are avoided: every block is one value under one key, and
the keys of one batch hash to different slots (different nodes), which a
multi-key command would refuse (CROSSSLOT) unless hash tags pinned them to one
slot, which would pin a pool's whole cache to one node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis._parsers.helpers import parse_info
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, RedisClusterException
from redis.retry import Retry

from kvtierd.tiers.redis.access import explain, tls_options, uses_tls
from kvtierd.tiers.redis.deadline import CallDeadlines, Watched, deadline_connection_class
from kvtierd.tiers.redis.health import NodeInfo, ServerHealth, summarize
from kvtierd.tiers.redis.nodefaults import NodeFaults
from kvtierd.tiers.redis.settings import RedisTierSettings

log = logging.getLogger(__name__)

RESOLVE_RETRY_S = 1.0  # a server that did not answer the mode question: asked again after
TOPOLOGY_REFRESH_S = 1.0  # at most one slot-map refresh per this, whatever fails
RTT_EWMA_WEIGHT = 0.2  # weight of a new round trip in the running average
CALL_DEADLINE_TIMEOUTS = 2  # a call's whole deadline, in socket timeouts (deadline.py)
NodeClient = redis.Redis

# what a per-node pipeline answers for one key: the reply, or the error of that key
Reply = Any
# one command of a pipeline: the key that routes it, and its arguments (the command first)
Command = tuple[bytes, Sequence[Any]]


def _is_cluster_reply(info: Any) -> bool:
    return isinstance(info, dict) and int(info.get("cluster_enabled", 0) or 0) == 1


class RedisLink:
    """The client of one configured redis tier (standalone or Cluster) and its health.

    Thread-safe: the I/O threads of every pool of the tier share it. ``_lock``
    guards ``_client``, ``_resolve_error`` and ``_health`` and is never held
    across I/O (the event loop takes it to read the health); ``_building``
    serializes the client's build, which talks to the servers. The libraries'
    clients are thread-safe themselves (a connection is used by one thread at a
    time).
    """

    def __init__(
        self,
        settings: RedisTierSettings,
        password: str | None,
        name: str = "redis",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``name``: the configured tier's (its log lines say it); ``clock``: monotonic
        seconds, for the times a node is skipped and its fault logged."""
        self.settings = settings
        self._clock = clock
        self.name = name
        self._password = password
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None
        self._resolved_at = 0.0  # monotonic time of the last failed try to build the client
        self._resolve_error: BaseException | None = None
        self._topology_refreshed_at = 0.0
        self._refreshing = threading.Lock()  # one topology refresh at a time
        self._building = threading.Lock()  # one client build at a time (I/O threads)
        self._health = ServerHealth()
        self._rtt_us = 0.0
        self._closed = False
        self._faults = NodeFaults(name, settings.timeout, self._node_text, clock)
        # a whole call (send and answer) is cut past twice the socket timeout
        self._deadlines = CallDeadlines(
            CALL_DEADLINE_TIMEOUTS * settings.timeout, _netloc(settings.urls[0])
        )
        self._connection_class = deadline_connection_class(self._deadlines, uses_tls(settings))

    # -- the client ----------------------------------------------------------------------

    @property
    def health(self) -> ServerHealth:
        """The last health seen, with the running round-trip average (any thread)."""
        with self._lock:
            health = self._health
            rtt = self._rtt_us
        return dataclasses.replace(health, round_trip_us=round(rtt))

    @property
    def is_cluster(self) -> bool:
        return isinstance(self._client, RedisCluster)

    def client(self) -> redis.Redis | RedisCluster:
        """The client, built at the first call (blocking: asks the server its mode).

        Raises redis.ConnectionError when the mode cannot be learned now (no URL
        answered); the next try is at most every :data:`RESOLVE_RETRY_S`."""
        built = self._client  # the usual case: built already (an attribute read)
        if built is not None:
            return built
        with self._building:  # one build at a time (I/O threads only wait here)
            with self._lock:
                if self._client is not None:
                    return self._client
                if self._closed:
                    raise redis.ConnectionError("the redis tier is shut down")
                if self._resolve_error is not None and (
                    self._clock() - self._resolved_at < RESOLVE_RETRY_S
                ):
                    raise redis.ConnectionError(
                        f"server not reached: {self._resolve_error}"
                    ) from self._resolve_error
            # the build talks to the servers: never under _lock, which the event loop
            # takes to read the health (a GetStats waited out a dead seed's timeout)
            try:
                client = self._build()
            except (redis.RedisError, RedisClusterException, OSError) as exc:
                with self._lock:
                    self._resolved_at = self._clock()
                    first = self._resolve_error is None
                    self._resolve_error = exc
                if first:  # once per streak; the tier's own lines about it are DEBUG
                    log.warning(
                        "redis tier %s: no server reached at %s (%s); every block of "
                        "the tier fails (MISS, writes dropped) until one answers",
                        self.name, ", ".join(_netloc(u) for u in self.settings.urls),
                        explain(exc, self.settings),
                    )  # fmt: skip
                raise redis.ConnectionError(f"server not reached: {exc}") from exc
            mode = "cluster" if isinstance(client, RedisCluster) else "standalone"
            health = ServerHealth(mode=mode, nodes_known=len(self._masters(client)))
            with self._lock:
                if self._closed:  # shut down while building
                    client.close()
                    raise redis.ConnectionError("the redis tier is shut down")
                self._client = client
                self._resolve_error = None
                self._health = health
            log.info(
                "redis tier: %s server at %s",
                mode, ", ".join(_netloc(u) for u in self.settings.urls),
            )  # fmt: skip
            return client

    def _build(self) -> redis.Redis | RedisCluster:
        mode = self.settings.cluster
        if mode == "auto":
            mode = "true" if self._asks_cluster() else "false"
        if mode == "false":
            return redis.Redis.from_url(self.settings.urls[0], **self._options())
        nodes = []
        for url in self.settings.urls:
            parts = urllib.parse.urlsplit(url)
            nodes.append(ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379))
        options = self._options()
        options.pop("retry")
        # the cluster builds its node clients itself (no connection_class): their
        # handshakes are bounded by the socket timeout only; every call is watched
        options.pop("connection_class", None)
        if uses_tls(self.settings):
            options["ssl"] = True
        return RedisCluster(
            startup_nodes=nodes,
            require_full_coverage=False,  # the nodes that are up serve their slots
            retry=Retry(NoBackoff(), 1),  # one retry, after the topology was re-read
            **options,
        )

    def _options(self) -> dict[str, Any]:
        s = self.settings
        return {
            # the handshake of a new connection under the call deadline too (TLS: its
            # TLS handshake is bounded by the connect timeout, the rest by the deadline)
            "connection_class": self._connection_class,
            **tls_options(s),
            "username": s.username or None,
            "password": self._password,
            "socket_timeout": s.timeout,
            "socket_connect_timeout": s.timeout,
            "max_connections": s.threads + 4,  # I/O threads, and probes sharing them
            "retry": Retry(NoBackoff(), 0),  # a fault fails the call; the tier counts it
            "health_check_interval": 0,
        }

    def _asks_cluster(self) -> bool:
        """``INFO cluster`` of the first URL that answers: ``cluster_enabled:1``?"""
        error: BaseException | None = None
        for url in self.settings.urls:
            probe = redis.Redis.from_url(url, **self._options())
            try:
                return _is_cluster_reply(probe.info("cluster"))
            except redis.RedisError as exc:
                error = exc
            finally:
                probe.close()
        raise redis.ConnectionError(f"no seed URL answered INFO: {error}") from error

    @staticmethod
    def _masters(client: redis.Redis | RedisCluster) -> list[tuple[str, NodeClient]]:
        """(name, node client) of every master the client knows (standalone: one)."""
        if isinstance(client, RedisCluster):
            return [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]
        return [("server", client)]

    def route(self, redis_key: bytes) -> str | None:
        """The name of the master owning ``redis_key`` from the slot map, or None before
        the client is built or for a slot no master covers. Never blocks (the event
        loop calls it: a CRC and a dictionary read)."""
        client = self._client
        if client is None:
            return None
        if isinstance(client, RedisCluster):
            try:
                return str(client.get_node_from_key(redis_key).name)
            except RedisClusterException:  # SlotNotCoveredError: its master is gone
                return None
        return "server"

    def node_for(self, redis_key: bytes) -> tuple[str, NodeClient]:
        """The name and client of the master owning ``redis_key`` (slot map, no I/O)."""
        client = self.client()
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(redis_key)
            return node.name, client.get_redis_connection(node)
        return "server", client

    # -- nodes that do not answer (I/O threads) -----------------------------------------

    def _node_text(self, name: str) -> str:
        return _netloc(self.settings.urls[0]) if name == "server" else name

    # -- commands (I/O threads) ----------------------------------------------------------

    def store_value(
        self, redis_key: bytes, chunks: Sequence[bytes | memoryview], value: Callable[[], bytes],
        args: Sequence[bytes],
    ) -> bool:  # fmt: skip
        """``SET redis_key <value> *args`` on the owning node, ``chunks`` being the
        whole command in RESP (the row unjoined). True when the value was written.
        A redirect is followed through the cluster client with ``value()`` (joined:
        the rare path)."""

        def exchange(conn: Any) -> Any:
            conn.send_packed_command(chunks)
            return conn.read_response()

        def redirected() -> Any:
            return self.client().execute_command("SET", redis_key, value(), *args)

        return bool(self._on_owner(redis_key, exchange, redirected))

    def get(self, redis_key: bytes, max_bytes: int) -> Any:
        """The value of ``redis_key`` on the owning node (a redirect followed), read
        bounded: at most ``max_bytes + 1`` bytes (``GETRANGE 0 max_bytes``), so a
        value planted far over a block's size never enters the daemon whole (a
        longer answer means "too long"). A missing key answers ``b""``."""

        def exchange(conn: Any) -> Any:
            conn.send_command("GETRANGE", redis_key, 0, max_bytes)
            return conn.read_response()

        return self._on_owner(
            redis_key, exchange, lambda: self.client().getrange(redis_key, 0, max_bytes)
        )

    def _on_owner(
        self, redis_key: bytes, exchange: Callable[[Any], Any], redirected: Callable[[], Any]
    ) -> Any:
        """``exchange(conn)`` on a pooled connection to the node owning ``redis_key``,
        under the call deadline; ``redirected()`` when the node answers ASK. Keeps the
        node's health: a connection or timeout failure marks it failed (and the
        topology suspect), any answer, an error reply included, marks it answering.
        A connection that may hold an unread reply is never reused."""
        name, node = self.node_for(redis_key)
        self._faults.check(name)
        pool = node.connection_pool
        try:
            conn = pool.get_connection()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._faults.failed(name, exc)
            self._suspect_topology()
            raise
        call = Watched()
        try:
            with self._deadlines.watch(conn) as call:
                answer = exchange(conn)
        except AskError:
            pool.release(conn)  # the reply was read whole: the connection is clean
            return redirected()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            conn.disconnect()
            pool.release(conn)
            failure = self._cut_if_expired(call, exc)
            self._faults.failed(name, failure)
            self._suspect_topology()
            raise failure from exc
        except redis.ResponseError as exc:
            pool.release(conn)
            self._faults.replied(name, exc)  # with an error of its own (OOM, WRONGTYPE, ...)
            raise
        except BaseException:
            conn.disconnect()  # a reply may be left unread: never reuse the connection
            pool.release(conn)
            raise
        if call.expired:  # answered as the watchdog cut it: the socket is shut down
            conn.disconnect()
        pool.release(conn)
        self._faults.answered(name)
        return answer

    def _cut_if_expired(
        self, call: Watched, exc: redis.ConnectionError | redis.TimeoutError
    ) -> redis.ConnectionError | redis.TimeoutError:
        """The error a failed call raises: a timeout when the deadline watchdog cut it
        (its node is then skipped), else its own."""
        if call.expired:
            return redis.TimeoutError(
                f"no whole answer within {self._deadlines.seconds:g}s "
                f"({CALL_DEADLINE_TIMEOUTS} x timeout): the call was cut"
            )
        return exc

    def node_client(self, redis_key: bytes) -> NodeClient:
        return self.node_for(redis_key)[1]

    def per_node(self, command: str, redis_keys: Sequence[bytes]) -> tuple[list[Reply], int]:
        """``command key`` for each key, as one pipeline per owning node
        (:meth:`pipelined`)."""
        return self.pipelined([(redis_key, (command, redis_key)) for redis_key in redis_keys])

    def pipelined(self, commands: Sequence[Command]) -> tuple[list[Reply], int]:
        """Each ``(route key, arguments)`` sent to the node owning its route key, as one
        pipeline per node: every pipeline written before any is read (one round trip in
        all). Returns each command's reply, or the exception it got (a node that fails
        fails its own commands only; a redirected command is sent again through the
        cluster client), and how many nodes failed."""
        replies: list[Reply] = [None] * len(commands)
        groups: dict[str, tuple[NodeClient, list[int]]] = {}
        for index, (redis_key, _) in enumerate(commands):
            name, node = self.node_for(redis_key)
            groups.setdefault(name, (node, []))[1].append(index)
        started = time.perf_counter()
        # every connection taken, with its watch and whether it must be dropped; given
        # back only once its watch ended (the watchdog may shut a watched socket down,
        # and must never reach a connection another thread took from the pool since)
        taken: list[tuple[Any, Any, Watched, bool]] = []
        with contextlib.ExitStack() as watches:
            failed_nodes = self._per_node_round_trip(commands, groups, replies, taken, watches)
        for pool, conn, call, broken in taken:
            if broken or call.expired:
                conn.disconnect()  # replies may be left unread
            pool.release(conn)
        if taken and not failed_nodes:
            self._note_round_trip(time.perf_counter() - started)
        if failed_nodes:
            self._suspect_topology()
        for i, reply in enumerate(replies):
            if isinstance(reply, AskError):  # resharding / failover: the cluster client follows
                try:
                    replies[i] = self.client().execute_command(*commands[i][1])
                except redis.RedisError as exc:
                    replies[i] = exc
        return replies, failed_nodes

    def _per_node_round_trip(
        self,
        commands: Sequence[Command],
        groups: dict[str, tuple[NodeClient, list[int]]],
        replies: list[Reply],
        taken: list[tuple[Any, Any, Watched, bool]],
        watches: contextlib.ExitStack,
    ) -> int:
        """:meth:`pipelined`'s pipelines: all written, then all read, each connection
        watched by the call deadline from its write to its last reply (``watches``)
        and listed in ``taken`` (True: drop it). Returns how many nodes failed."""
        failed_nodes = 0
        sent: list[tuple[str, Any, Watched, list[int], int]] = []  # (node, conn, call, indices, #)
        for name, (node, indices) in groups.items():
            try:
                self._faults.check(name)
                conn = node.connection_pool.get_connection()
            except (redis.RedisError, OSError) as exc:
                failed_nodes += 1
                self._faults.failed(name, exc)
                _fail(replies, indices, exc)
                continue
            call = watches.enter_context(self._deadlines.watch(conn))
            taken.append((node.connection_pool, conn, call, False))
            try:
                conn.send_packed_command(conn.pack_commands([commands[i][1] for i in indices]))
            except (redis.RedisError, OSError) as exc:
                failed_nodes += 1
                self._connection_failed(name, call, exc, replies, indices, taken)
                continue
            sent.append((name, conn, call, indices, len(taken) - 1))
        for name, conn, call, indices, slot in sent:
            done = 0
            refused: redis.ResponseError | None = None
            try:
                for i in indices:
                    try:
                        replies[i] = conn.read_response()
                    except redis.ResponseError as exc:
                        replies[i] = refused = exc
                    done += 1
            except (redis.RedisError, OSError) as exc:
                failed_nodes += 1
                self._connection_failed(name, call, exc, replies, indices[done:], taken, slot)
                continue
            self._faults.replied(name, refused)
        return failed_nodes

    def _connection_failed(
        self,
        name: str,
        call: Watched,
        exc: BaseException,
        replies: list[Reply],
        indices: Sequence[int],
        taken: list[tuple[Any, Any, Watched, bool]],
        slot: int = -1,
    ) -> None:
        """A pipeline's connection failed: its keys get the error (a timeout when the
        deadline cut it), the node may be skipped, the connection is dropped."""
        if isinstance(exc, redis.ConnectionError):
            exc = self._cut_if_expired(call, exc)
        self._faults.failed(name, exc)
        _fail(replies, indices, exc)
        pool, conn, _, _ = taken[slot]
        taken[slot] = (pool, conn, call, True)

    # -- health (I/O threads) ------------------------------------------------------------

    def refresh_health(self) -> ServerHealth:
        """PING and ``INFO memory`` / ``INFO stats`` every master: reachable nodes,
        round trips, memory. Never raises for a node that does not answer (it is
        counted unreachable); raises redis.ConnectionError when no client can be
        built yet."""
        client = self.client()
        masters = self._masters(client)
        answers: list[NodeInfo] = []
        for name, node in masters:
            try:
                self._faults.check(name)  # a skipped node: unreachable (or this is its trial)
                answers.append(self._node_health(node))
            except (redis.RedisError, OSError) as exc:
                self._faults.failed(name, exc)
                continue
            self._faults.answered(name)
        if len(answers) < len(masters):
            self._suspect_topology()
        mode = "cluster" if isinstance(client, RedisCluster) else "standalone"
        health = summarize(mode, len(masters), answers)
        with self._lock:
            self._health = health
        return self.health

    def _node_health(self, node: NodeClient) -> NodeInfo:
        """PING (its round trip noted), ``INFO memory`` and ``INFO stats`` of one node,
        on one connection under one call deadline (a node that trickles its answers
        must not hold an I/O thread for the minutes an INFO answer would take)."""
        pool = node.connection_pool
        conn = pool.get_connection()
        call = Watched()
        try:
            with self._deadlines.watch(conn) as call:
                started = time.perf_counter()
                conn.send_command("PING")
                conn.read_response()
                self._note_round_trip(time.perf_counter() - started)
                conn.send_command("INFO", "memory")
                memory = parse_info(conn.read_response())
                conn.send_command("INFO", "stats")
                stats = parse_info(conn.read_response())
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            conn.disconnect()
            pool.release(conn)
            raise self._cut_if_expired(call, exc) from exc
        except BaseException:
            conn.disconnect()  # a reply may be left unread: never reuse the connection
            pool.release(conn)
            raise
        if call.expired:
            conn.disconnect()
        pool.release(conn)
        return memory, stats

    def _note_round_trip(self, seconds: float) -> None:
        sample = seconds * 1e6
        with self._lock:
            if self._rtt_us == 0.0:
                self._rtt_us = sample
            else:
                self._rtt_us += RTT_EWMA_WEIGHT * (sample - self._rtt_us)

    def _suspect_topology(self) -> None:
        """A node failed: re-read the slot map (a failover's new master), at most
        once every :data:`TOPOLOGY_REFRESH_S`, by one thread (the others go on)."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return
        now = self._clock()
        if now - self._topology_refreshed_at < TOPOLOGY_REFRESH_S:
            return
        if not self._refreshing.acquire(blocking=False):
            return
        try:
            self._topology_refreshed_at = now
            client.nodes_manager.initialize()
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            log.debug("redis tier: topology refresh failed: %s", exc)
        finally:
            self._refreshing.release()

    def close(self) -> None:
        """Closes the connections; later calls fail. Idempotent."""
        self._deadlines.close()
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _fail(replies: list[Reply], indices: Sequence[int], exc: BaseException) -> None:
    for i in indices:
        replies[i] = exc


def _netloc(url: str) -> str:
    """``host:port`` of ``url`` (no user, no password: for logs)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379}"
