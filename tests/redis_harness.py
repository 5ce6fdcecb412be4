"""Real ``redis-server`` processes for the redis tier's tests.

:class:`RedisServer` runs one standalone server on a free loopback port in a temp
dir of its own (no persistence, no protected mode), and can be killed and started
again on the same port. The fixtures always stop what they started. Without a
``redis-server`` binary (``make test-tools`` installs it as root with apt), the
tests that need one skip and say why.

TLS: given a :class:`RedisTls` (certificates the test made with
``tests/tls_ca.py``), a server or a whole Cluster listens on TLS only (``--port
0 --tls-port``, Debian's redis-server is built with TLS; a Cluster's bus and
replication over TLS too) and asks clients for a certificate; the harness's own
connections (pings, ``redis-cli --cluster create``, admin clients) use TLS then.
ACL: :func:`restrict_user` makes a user that may run only the tier's commands
(``kvtierd.tiers.redis.access.ACL_COMMANDS``) on its key prefix, on every node.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from daemon_harness import eventually
from engine_harness import BLOCK, HIT, Engine

from kvtierd.tiers import blockformat
from kvtierd.tiers.redis.access import ACL_COMMANDS

START_TIMEOUT_S = 10.0
REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = "redis-server is not installed (`make test-tools` installs it as root with apt)"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (Redis wants <= 55535)."""
    for _ in range(1000):
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as first, socket.socket() as bus:
                first.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass(frozen=True)
class RedisTls:
    """A CA, a server certificate (for 127.0.0.1 and localhost) and a client
    certificate, as PEM files in one directory (private keys 0600)."""

    ca_file: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    @classmethod
    def make(cls, directory: str | os.PathLike[str], name: str = "redis") -> RedisTls:
        # imported here: every conftest imports this module, and the GPU check's machine
        # (benchmarks.gpu: torch, numpy, pytest; no registry) has no cryptography
        from tls_ca import TestCA

        ca = TestCA(f"{name}-ca")
        ca_file = ca.write(os.path.join(directory, f"{name}-ca.pem"))
        server = ca.issue("redis", dns_names=("localhost",), ip_addresses=("127.0.0.1",))
        client = ca.issue("kvtierd")
        return cls(ca_file, *server.write(directory, f"{name}-server"),
                   *client.write(directory, f"{name}-client"))  # fmt: skip

    def server_args(self, cluster: bool) -> list[str]:
        args = ["--tls-cert-file", self.server_cert, "--tls-key-file", self.server_key,
                "--tls-ca-cert-file", self.ca_file, "--tls-auth-clients", "yes"]  # fmt: skip
        if cluster:
            args += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        return args

    def cli_args(self) -> list[str]:
        return ["--tls", "--cacert", self.ca_file, "--cert", self.client_cert,
                "--key", self.client_key]  # fmt: skip

    def client_options(self) -> dict[str, Any]:
        """redis-py's arguments of an admin client."""
        return {"ssl": True, "ssl_ca_certs": self.ca_file, "ssl_certfile": self.client_cert,
                "ssl_keyfile": self.client_key}  # fmt: skip

    def tier_options(self, client_certificate: bool = True) -> dict[str, str]:
        """The redis tier's TLS options (for :func:`redis_config`)."""
        options = {"tls_ca_file": self.ca_file}
        if client_certificate:
            options |= {"tls_cert_file": self.client_cert, "tls_key_file": self.client_key}
        return options

    def wrap(self, sock: socket.socket) -> ssl.SSLSocket:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.client_cert, self.client_key)
        return context.wrap_socket(sock, server_hostname="127.0.0.1")


class RedisServer:
    """One redis-server on 127.0.0.1:``port``, files under ``directory``
    (a cluster node with ``cluster=True``: its port leaves room for the bus port;
    TLS only with ``tls``)."""

    def __init__(self, *extra: str, cluster: bool = False, tls: RedisTls | None = None) -> None:
        if REDIS_SERVER is None:
            pytest.skip(SKIP_REASON)
        self.directory = tempfile.mkdtemp(prefix="kvt-redis-")
        self.port = free_cluster_port() if cluster else _free_port()
        self.tls = tls
        self.extra = (*tls.server_args(cluster), *extra) if tls else extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    def client(self, **options: Any) -> redis.Redis:
        """An admin client of this server (TLS with the harness's certificate)."""
        tls = self.tls.client_options() if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, **tls, **options)

    def connect(self, timeout: float) -> socket.socket:
        """A raw connection (TLS-wrapped for a TLS server)."""
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        if self.tls is None:
            return conn
        try:
            return self.tls.wrap(conn)
        except BaseException:
            conn.close()
            raise

    @property
    def log_path(self) -> Path:
        return Path(self.directory) / "redis.log"

    def start(self) -> None:
        assert REDIS_SERVER is not None and self.proc is None
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else [
            "--port", str(self.port)
        ]  # fmt: skip
        args = [
            REDIS_SERVER,
            *ports,
            "--bind", "127.0.0.1",
            "--dir", self.directory,
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--logfile", str(self.log_path),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_path.read_text() if self.log_path.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{log}")
            if self.ping():
                return
            time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def ping(self) -> bool:
        """Whether the server answers (PONG, or NOAUTH from one with a password)."""
        try:
            with self.connect(0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server is gone at once (its keys with it: no persistence)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


@contextmanager
def stopped(server: RedisServer) -> Iterator[None]:
    """The server hangs (SIGSTOP: connections stay open, nothing answers) within."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the session (tests keep apart by key prefix)."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., RedisServer]]:
    """Servers of the test's own (to kill, to configure): all stopped afterwards."""
    servers: list[RedisServer] = []

    def make(*extra: str, tls: RedisTls | None = None) -> RedisServer:
        server = RedisServer(*extra, tls=tls)
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.close()


# ------------------------------------------------------------------ Redis Cluster

CLUSTER_NODE_TIMEOUT_MS = 1000  # a killed master is marked FAIL after this (and more)
CLUSTER_OK_TIMEOUT_S = 30.0
REDIS_CLI = shutil.which("redis-cli")


class RedisClusterNodes:
    """A Redis Cluster of ``masters`` masters (``replicas`` replicas each) on free loopback ports,
    each node a :class:`RedisServer` in its own temp dir (its ``nodes.conf`` there,
    so a node killed and started again on its port rejoins with its slots).

    ``cluster-require-full-coverage no``: the other masters keep serving their
    slots while one is down. Created with ``redis-cli --cluster create ...
    --cluster-yes`` and waited until every node says ``cluster_state:ok``.
    :meth:`close` stops every node (the fixtures call it, also on failure).
    """

    def __init__(
        self, masters: int = 3, *extra: str, replicas: int = 0, tls: RedisTls | None = None
    ) -> None:
        if REDIS_SERVER is None or REDIS_CLI is None:
            pytest.skip(SKIP_REASON)
        self.tls = tls
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters * (1 + replicas)):
                self.nodes.append(
                    RedisServer(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(CLUSTER_NODE_TIMEOUT_MS),
                        "--cluster-require-full-coverage",
                        "no",
                        *extra,
                        cluster=True,
                        tls=tls,
                    )  # fmt: skip
                )
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            assert REDIS_CLI is not None
            created = subprocess.run(
                [REDIS_CLI, *(tls.cli_args() if tls else ()), "--cluster", "create", *addresses,
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                capture_output=True, timeout=60, check=False,
            )  # fmt: skip
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout!r}")
            self.wait_ok()
            if replicas:
                self.wait_replicas_synced()
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(node.url for node in self.nodes)

    def info_cluster(self, node: RedisServer) -> str:
        """``CLUSTER INFO`` of ``node`` ('' when it does not answer)."""
        try:
            with node.connect(1.0) as conn:
                conn.sendall(b"CLUSTER INFO\r\n")
                conn.settimeout(1.0)
                reply = b""
                while b"cluster_state" not in reply or not reply.endswith(b"\r\n\r\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
                return reply.decode(errors="replace")
        except OSError:
            return ""

    def wait_ok(self, nodes: list[RedisServer] | None = None) -> None:
        """Until every node of ``nodes`` (all) says ``cluster_state:ok`` and knows
        every slot (``cluster_slots_assigned:16384``)."""
        deadline = time.monotonic() + CLUSTER_OK_TIMEOUT_S
        pending = list(nodes or self.nodes)
        while pending:
            info = self.info_cluster(pending[0])
            if "cluster_state:ok" in info and "cluster_slots_assigned:16384" in info:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok on port {pending[0].port}: {info!r}")
            time.sleep(0.05)

    def wait_replicas_synced(self) -> None:
        """Until every replica's link to its master is up (its first sync done): a
        replica that never synced is not elected when its master fails."""
        deadline = time.monotonic() + CLUSTER_OK_TIMEOUT_S
        for node in self.nodes:
            with node.client() as client:
                while True:
                    info = client.info("replication")
                    if info.get("role") != "slave" or info.get("master_link_status") == "up":
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"replica on port {node.port} never synced: {info}")
                    time.sleep(0.05)

    def move_slot(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """Reshards ``slot`` from ``source`` to ``target`` as ``redis-cli --cluster
        reshard`` does (IMPORTING / MIGRATING, MIGRATE its keys, SETSLOT NODE on every
        node): clients with the old slot map get MOVED from then on."""
        src, dst = source.client(), target.client()
        try:
            src_id, dst_id = (
                src.execute_command("CLUSTER MYID"),
                dst.execute_command("CLUSTER MYID"),
            )
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
            while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            for node in self.nodes:
                with node.client() as each:
                    each.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        finally:
            src.close()
            dst.close()

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """One 3-master cluster for the session (tests keep apart by key prefix)."""
    cluster = RedisClusterNodes()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def redis_cluster_factory() -> Iterator[Callable[..., RedisClusterNodes]]:
    """Clusters of the test's own (to kill nodes of, to configure): all stopped afterwards."""
    clusters: list[RedisClusterNodes] = []

    def make(
        masters: int = 3, *extra: str, replicas: int = 0, tls: RedisTls | None = None
    ) -> RedisClusterNodes:
        cluster = RedisClusterNodes(masters, *extra, replicas=replicas, tls=tls)
        clusters.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.close()


VALUE_BYTES = blockformat.HEADER_SIZE + BLOCK
# a [limits] table letting a lookup wait for the server as long as a busy test machine
# may take to answer (the wait ends with the answer: it costs what the probe takes)
WAIT_FOR_REDIS = '[limits]\nremote_lookup_wait = "1s"\n'


def restrict_user(
    servers: Iterable[RedisServer],
    name: str,
    password: str,
    key_prefix: str,
    commands: Iterable[str] = ACL_COMMANDS,
) -> None:
    """Makes (or resets) ACL user ``name`` on every server: ``password``, only keys
    ``<key_prefix>:*``, no channels, only ``commands``. The servers' ACL logs are
    cleared, so :func:`acl_denials` afterwards shows what this test was refused."""
    for server in servers:
        with server.client() as admin:
            admin.execute_command(
                "ACL", "SETUSER", name, "reset", "on", f">{password}", f"~{key_prefix}:*",
                "resetchannels", "-@all", *(f"+{command}" for command in commands),
            )  # fmt: skip
            admin.execute_command("ACL", "LOG", "RESET")


def acl_denials(servers: Iterable[RedisServer]) -> list[str]:
    """What the servers' ACLs refused since :func:`restrict_user` (reason, what, user)."""
    denials = []
    for server in servers:
        with server.client() as admin:
            for entry in admin.acl_log():
                denials.append(f"{entry['reason']} {entry['object']} {entry['username']}")
    return denials


def redis_config(url: str | tuple[str, ...], key_prefix: str, **options: object) -> str:
    """A redis tier's ``[[tiers]]`` table: ``url`` (or several: a Cluster's seeds)."""
    urls = ", ".join(f'"{u}"' for u in ((url,) if isinstance(url, str) else url))
    extra = "".join(f'{key} = "{value}"\n' for key, value in options.items())
    return (
        f'[[tiers]]\ntype = "redis"\nname = "redis"\nurls = [{urls}]\n'
        f'key_prefix = "{key_prefix}"\nthreads = 4\n{extra}'
    )


def redis_key(key_prefix: str, pool: str, key: bytes, layout: str = "L") -> bytes:
    fingerprint = blockformat.PoolIdentity(pool, BLOCK, layout).fingerprint
    return f"{key_prefix}:{fingerprint.hex()}:".encode() + key


def tier_warnings(log: str) -> list[str]:
    """The redis tier's WARNING lines of a daemon log: a fault is one line (the node that
    failed), however many calls it fails; the calls' own lines are DEBUG."""
    return [line for line in log.splitlines() if " WARNING kvtierd.tiers.redis." in line]


def promoted(engine: Engine, keys: list[bytes], timeout: float = 20.0) -> list[object]:
    """Looks keys up until every one is HIT or a settled MISS: the first lookup of a
    key the tier never heard of answers MISS and starts a probe; a later one sees it."""
    results: list[object] = []

    def all_hit() -> bool:
        results[:] = engine.wait_settled(keys)
        return all(r == HIT for r in results)

    eventually(all_hit, timeout, lambda: f"every key HIT; still {results}", interval=0.01)
    return results


class TrickleProxy:
    """A TCP proxy in front of a real redis-server on 127.0.0.1 (the attack tests'
    and the fleet benchmark's "trickling node"): once ``slow`` is set, the server's
    answers reach the client one byte every ``trickle_s`` seconds, so the connection
    stays alive and no socket timeout ever fires; cleared, bytes flow as they come
    (the rest of an answer being trickled included)."""

    def __init__(self, upstream_port: int, trickle_s: float = 0.5) -> None:
        self.upstream_port = upstream_port
        self.trickle_s = trickle_s
        self.slow = threading.Event()
        self.closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while not self.closed.is_set():
                data = source.recv(1 << 16)
                if not data:
                    return
                if answers and self.slow.is_set():
                    self._trickle(data, sink)
                else:
                    sink.sendall(data)
        except OSError:
            return

    def _trickle(self, data: bytes, sink: socket.socket) -> None:
        for i in range(len(data)):
            sink.sendall(data[i : i + 1])
            time.sleep(self.trickle_s)
            if not self.slow.is_set():
                sink.sendall(data[i + 1 :])
                return

    def close(self) -> None:
        self.closed.set()
        for each in self._sockets:
            each.close()
