"""What asking Redis in the lookup costs: Lookup latency on a local 3-master Redis Cluster.

``python -m benchmarks.fleet_latency [--lookups 400] [--keys 32]``: a writer daemon
stores chains of ``--keys`` blocks (4 KiB) into the cluster; a reader daemon on the
same cluster, and a primary-only daemon, answer prefix Lookups (the fast lane), one
of each kind per round, in an order that turns every round:

* ``primary only``: a chain nobody has, on the daemon without a remote tier: the floor;
* ``no remote tier needed``: a chain in the reader's primary (HITs): must cost what the
  floor costs;
* ``known absent``: a chain whose first key the reader found absent a moment ago (its
  negative answer, ``presence_ttl``): answered at once, nothing asked;
* ``goes to Redis``: a chain only the cluster holds: the Lookup asks every master
  owning some of its keys (one pipelined ``EXISTS`` each, in parallel) and answers
  HIT_PENDING.

Next to them: the same ``EXISTS`` pipelines sent by redis-py from this process (every
node's written, then read: the round trip the daemon's probe cannot beat), and the
presence round trips the reader made per Lookup that went to Redis.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import redis

from benchmarks.common import BenchDaemon, machine, percentile
from benchmarks.rediscluster import BenchCluster

BLOCK = 4096
POOL = "bench/fleet-latency"
KINDS = ("primary only", "no remote tier needed", "known absent", "goes to Redis")


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode() for i in range(n)]


def _config(directory: str, urls: list[str], wait: str) -> str:
    quoted = ", ".join(f'"{url}"' for url in urls)
    limits = f'[limits]\nremote_lookup_wait = "{wait}"\n' if wait else ""
    path = os.path.join(directory, f"redis-{wait or 'default'}.toml")
    Path(path).write_text(
        f'{limits}[[tiers]]\ntype = "redis"\nname = "fleet"\nurls = [{quoted}]\n'
        'cluster = true\nkey_prefix = "kvtb-latency"\npresence_ttl = "1h"\n'
    )
    return path


def _raw_round_trip(cluster: redis.RedisCluster, keys: list[bytes]) -> float:
    """Seconds for one EXISTS per key, pipelined per owning node, all written first."""
    groups: dict[str, list[bytes]] = {}
    for key in keys:
        groups.setdefault(cluster.get_node_from_key(key).name, []).append(key)
    conns = []
    t0 = time.perf_counter()
    for name, batch in groups.items():
        node = cluster.get_redis_connection(cluster.get_node(node_name=name))
        conn = node.connection_pool.get_connection()
        conn.send_packed_command(conn.pack_commands([("EXISTS", k) for k in batch]))
        conns.append((node, conn, len(batch)))
    for _, conn, count in conns:
        for _ in range(count):
            conn.read_response()
    seconds = time.perf_counter() - t0
    for node, conn, _ in conns:
        node.connection_pool.release(conn)
    return seconds


def measure(lookups: int, width: int) -> tuple[dict[str, list[float]], float]:
    """Seconds per Lookup of each kind, and presence round trips per remote Lookup."""
    from kvtierd_client.client import Client, LookupResult

    cluster = BenchCluster(3)
    work = tempfile.mkdtemp(prefix="kvtb-latency-")
    samples: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "redis-py EXISTS")}
    try:
        config = _config(work, cluster.urls, "")
        with (
            BenchDaemon("--config", config, "--memory-budget", "256MiB") as writer,
            BenchDaemon("--config", config, "--memory-budget", "256MiB") as reader,
            BenchDaemon("--memory-budget", "256MiB") as plain,
        ):
            clients = [Client(d.address, timeout=60) for d in (writer, reader, plain)]
            blocks = lookups * width + 64
            w, r, p = (c.open_session(POOL, block_bytes=BLOCK, num_blocks=blocks) for c in clients)
            chains = [_keys(f"remote{i}", width) for i in range(lookups)]
            for chain in chains:
                grant = w.prepare_store(chain)
                w.complete_store(grant.keys_to_store)
            local = _keys("local", width)
            r.complete_store(r.prepare_store(local).keys_to_store)
            raw = redis.RedisCluster.from_url(cluster.urls[0])
            _wait_cascades(clients[0])
            for i in range(20):  # warm-up: every channel, connection and probe thread
                p.lookup(_keys(f"warm{i}", width), prefix=True)
                r.lookup(_keys(f"warm{i}", width), prefix=True)
            before = _probes(clients[1])
            for i, chain in enumerate(chains):
                calls = {
                    "primary only": (p, _keys(f"nobody{i}", width)),
                    "no remote tier needed": (r, local),
                    "known absent": (r, _keys(f"warm{i % 20}", width)),
                    "goes to Redis": (r, chain),
                }
                order = list(calls)
                order = order[i % 4 :] + order[: i % 4]
                for kind in order:
                    session, keys = calls[kind]
                    time.sleep(0.002)
                    t0 = time.perf_counter()
                    answer = session.lookup(keys, prefix=True)
                    samples[kind].append(time.perf_counter() - t0)
                    if kind == "goes to Redis" and answer[0] != LookupResult.HIT_PENDING:
                        samples.setdefault("ran out", []).append(1.0)
                time.sleep(0.002)
                samples["redis-py EXISTS"].append(
                    _raw_round_trip(raw, [f"kvtb-latency:x:{k.decode()}".encode() for k in chain])
                )
            probes = (_probes(clients[1]) - before) / lookups
            raw.close()
            for client in clients:
                client.close()
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    return samples, probes


def _probes(client: object) -> int:
    return int(client.get_stats(POOL).pools[0].tiers[1].probes)  # type: ignore[attr-defined]


def _wait_cascades(client: object) -> None:
    deadline = time.monotonic() + 120
    while client.get_stats(POOL).pools[0].tiers[1].jobs_in_flight:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError("cascades did not finish")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fleet_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--lookups", type=int, default=400)
    parser.add_argument("--keys", type=int, default=32)
    args = parser.parse_args(argv)
    samples, probes = measure(args.lookups, args.keys)
    floor = percentile(samples["primary only"], 0.5)
    print(f"machine: {machine()}; {args.lookups} Lookups of {args.keys} keys per kind\n")
    print("| Lookup | p50 | p99 | p50 - primary-only p50 |\n|---|---|---|---|")
    for kind, values in samples.items():
        if kind == "ran out":
            continue
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        print(f"| {kind} | {p50 * 1e6:.0f} us | {p99 * 1e6:.0f} us | "
              f"{(p50 - floor) * 1e6:+.0f} us |")  # fmt: skip
    ran_out = len(samples.get("ran out", []))
    print(
        f"\npresence round trips per Lookup that went to Redis: {probes:.2f} (one per master "
        f"owning some of its keys); its wait ran out {ran_out} times of {args.lookups}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
