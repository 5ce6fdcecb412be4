"""A real Redis Cluster for the benchmarks: ``redis-server`` masters on loopback ports.

:class:`BenchCluster` starts ``masters`` nodes (each in a temp dir of its own, no
persistence, ``cluster-require-full-coverage no``), joins them with ``redis-cli
--cluster create`` and waits until every node says ``cluster_state:ok``. Between
runs :meth:`BenchCluster.reset` empties it and sets its memory policy;
:meth:`BenchCluster.calibrate` measures what one value costs the server (key,
value, allocator rounding), so that a capacity in blocks becomes ``maxmemory``.
:meth:`BenchCluster.close` stops every node. A node can be killed, stopped
(SIGSTOP) and resumed for the fault runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from benchmarks.harnesses import free_cluster_port

START_TIMEOUT_S = 10.0
OK_TIMEOUT_S = 60.0
NODE_TIMEOUT_MS = 1000


class BenchNode:
    """One cluster node on 127.0.0.1:``port``."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.directory = tempfile.mkdtemp(prefix="kvtb-redis-")
        self.port = free_cluster_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", self.directory, "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--logfile", os.path.join(self.directory, "redis.log"),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "no",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as client:
                    client.ping()
                    return
            except redis.RedisError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=10)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        shutil.rmtree(self.directory, ignore_errors=True)


class BenchCluster:
    """A Redis Cluster of ``masters`` masters (module doc)."""

    def __init__(self, masters: int = 3) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise RuntimeError("redis-server / redis-cli not installed (make test-tools)")
        self.nodes: list[BenchNode] = []
        try:
            self.nodes = [BenchNode(server) for _ in range(masters)]
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                 "--cluster-yes"],
                capture_output=True, timeout=120, check=True,
            )  # fmt: skip
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{node.port}" for node in self.nodes]

    def wait_ok(self) -> None:
        deadline = time.monotonic() + OK_TIMEOUT_S
        for node in self.nodes:
            while True:
                with node.client() as client:
                    info = client.cluster("INFO")  # parsed: {"cluster_state": "ok", ...}
                if info.get("cluster_state") == "ok" and info.get("cluster_slots_assigned") in (
                    "16384",
                    16384,
                ):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster not ok on port {node.port}: {info!r}")
                time.sleep(0.05)

    def calibrate(self, value_bytes: int, values: int = 600) -> float:
        """Bytes of ``used_memory`` one value of ``value_bytes`` costs (key, value and
        allocator rounding included), measured by storing ``values`` of them."""
        self.reset(0, "noeviction", 5)
        before = self.used_memory()
        cluster = redis.RedisCluster.from_url(self.urls[0])
        try:
            payload = os.urandom(value_bytes)
            for i in range(values):
                cluster.set(f"kvtierd:calibrate:{i:08d}".encode(), payload)
            per_value = (self.used_memory() - before) / values
        finally:
            cluster.close()
        self.reset(0, "noeviction", 5)
        return per_value

    def used_memory(self) -> int:
        total = 0
        for node in self.nodes:
            with node.client() as client:
                total += int(client.info("memory")["used_memory"])
        return total

    def keys(self) -> int:
        total = 0
        for node in self.nodes:
            with node.client() as client:
                total += int(client.dbsize())
        return total

    def evicted(self) -> int:
        total = 0
        for node in self.nodes:
            with node.client() as client:
                total += int(client.info("stats")["evicted_keys"])
        return total

    def reset(self, data_bytes_per_node: int, policy: str, samples: int) -> None:
        """Empties every node and sets its memory policy: ``maxmemory`` is what the
        emptied node uses (measured after the flush) plus ``data_bytes_per_node`` (0:
        unbounded); the eviction counters start again from 0."""
        for node in self.nodes:
            with node.client() as client:
                client.config_set("maxmemory", 0)
                client.flushall()
                client.config_set("maxmemory-policy", policy)
                client.config_set("maxmemory-samples", samples)
                client.config_resetstat()
                if data_bytes_per_node:
                    empty = int(client.info("memory")["used_memory"])
                    client.config_set("maxmemory", empty + data_bytes_per_node)

    def announce(self, node: BenchNode, port: int | None) -> None:
        """Makes ``node`` announce ``port`` (a proxy in front of it; None: its own) to
        the cluster's clients, and waits until every node's slot map says so."""
        with node.client() as client:
            client.config_set("cluster-announce-port", port or 0)
            client.config_set("cluster-announce-bus-port", node.port + 10000 if port else 0)
        wanted = port or node.port
        deadline = time.monotonic() + OK_TIMEOUT_S
        for other in self.nodes:
            while True:
                with other.client() as client:
                    ports = {int(entry[2][1]) for entry in client.execute_command("CLUSTER SLOTS")}
                if wanted in ports:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {other.port} never announced port {wanted}")
                time.sleep(0.05)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
