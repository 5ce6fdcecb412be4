"""What authorization adds to a call: Lookup over the Unix socket with and without
``[[security.principals]]``, side by side.

Two daemons run at once: one without principals (Unix peers trusted, as
before) and one with eight principals, the caller's uid among them: each of
its calls carries a peer ticket, passes the gate (ticket lookup before the
request is read), is identified again by the servicer and checked against the
session's principal. The same client process times Lookup(32 keys) on both in
alternating rounds of ROUND_CALLS calls (the machine's drift hits both alike);
the p50 of each side is the median of its rounds' p50s. The daemons' CPU per
call comes from ``/proc`` around each round, summed over the rounds.
"""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.common import BenchDaemon, Row, cpu_seconds, percentile
from kvtierd_client.client import Client

POOL = "bench/authz"
BLOCK = 4096
KEYS = 32
ROUNDS = 20
ROUND_CALLS = 500
WARMUP = 300
PRINCIPALS = 8  # the caller's principal is the last one: the others are looked past


def _principals_config(directory: str) -> str:
    path = os.path.join(directory, "principals.toml")
    tables = [
        f'[[security.principals]]\nname = "team-{i}"\nuids = [{50000 + i}]\n'
        f'pools = ["team-{i}/*", "shared-{i}/*"]\nmemory_quota = "1GiB"\n'
        for i in range(PRINCIPALS - 1)
    ]
    tables.append(
        f'[[security.principals]]\nname = "bench"\nuids = [{os.geteuid()}]\n'
        'pools = ["bench/*"]\nmemory_quota = "1GiB"\n'
    )
    with open(path, "w") as handle:
        handle.write("\n".join(tables))
    return path


def _keys(n: int) -> list[bytes]:
    return [f"authz-{i:012d}-".encode().ljust(36, b"k") for i in range(n)]


class _Side:
    """One daemon, its client and session, and what was measured on it."""

    def __init__(self, daemon: BenchDaemon) -> None:
        self.daemon = daemon
        self.client = Client(daemon.address)
        self.session = self.client.open_session(POOL, block_bytes=BLOCK, num_blocks=1024)
        self.keys = _keys(KEYS)
        grant = self.session.prepare_store(self.keys)
        self.session.complete_store(grant.keys_to_store)
        self.round_p50s: list[float] = []
        self.daemon_cpu = 0.0  # seconds, over every round
        self.calls = 0
        for _ in range(WARMUP):
            self.session.lookup(self.keys)

    def round(self) -> None:
        samples = []
        cpu_before = cpu_seconds(self.daemon.proc.pid)
        for _ in range(ROUND_CALLS):
            t0 = time.perf_counter()
            self.session.lookup(self.keys)
            samples.append(time.perf_counter() - t0)
        self.daemon_cpu += cpu_seconds(self.daemon.proc.pid) - cpu_before
        self.calls += ROUND_CALLS
        self.round_p50s.append(percentile(samples, 0.5))

    def close(self) -> None:
        self.session.close()
        self.client.close()


def run() -> list[Row]:
    group = "authz, unix socket"
    with BenchDaemon() as plain_daemon:
        config = _principals_config(plain_daemon.workdir)
        with BenchDaemon("--config", config) as restricted_daemon:
            plain, restricted = _Side(plain_daemon), _Side(restricted_daemon)
            for i in range(ROUNDS):
                for side in (plain, restricted) if i % 2 == 0 else (restricted, plain):
                    side.round()
            plain.close()
            restricted.close()
    plain_p50 = statistics.median(plain.round_p50s)
    restricted_p50 = statistics.median(restricted.round_p50s)
    plain_cpu = plain.daemon_cpu / plain.calls
    restricted_cpu = restricted.daemon_cpu / restricted.calls
    name = f"Lookup({KEYS} keys) p50"
    return [
        Row(group, f"{name}, no principals", plain_p50 * 1e6, "us"),
        Row(group, f"{name}, {PRINCIPALS} principals (peer ticket)", restricted_p50 * 1e6, "us",
            f"no principals {plain_p50 * 1e6:.0f} us", restricted_p50 / plain_p50, "<= 1.05x"),
        Row(group, "Lookup daemon CPU per call, no principals", plain_cpu * 1e6, "us"),
        Row(group, f"Lookup daemon CPU per call, {PRINCIPALS} principals", restricted_cpu * 1e6,
            "us", f"no principals {plain_cpu * 1e6:.0f} us", restricted_cpu / plain_cpu),
    ]  # fmt: skip


if __name__ == "__main__":
    from benchmarks.common import print_table

    print_table(run())
