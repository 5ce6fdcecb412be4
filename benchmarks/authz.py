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

On a loaded machine both rows move by a few percent between runs (two
daemons without principals, timed the same way, differ by up to 5 %), so the
work authorization adds to a call is also timed in-process, where nothing
else runs: the gate's check and the servicer's identification with a real
peer ticket, minus the identification of a call without principals.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable

from benchmarks.common import BenchDaemon, Row, cpu_seconds, percentile
from kvtierd.config import load_config
from kvtierd.security.state import SecurityState
from kvtierd_client.client import Client
from kvtierd_client.wire.peer_ticket import obtain_ticket, ticket_socket_path

POOL = "bench/authz"
BLOCK = 4096
KEYS = 32
ROUNDS = 20
ROUND_CALLS = 500
WARMUP = 300
PRINCIPALS = 8  # the caller's principal is the last one: the others are looked past
IN_PROCESS_CALLS = 100_000


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


class _FakeContext:
    """What ``SecurityState.identify`` reads of a grpc.aio call on a Unix socket."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def peer(self) -> str:
        return "unix:"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def _timed_per_call(fn: Callable[[], object], calls: int = IN_PROCESS_CALLS) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


async def _in_process_costs(principals_file: str) -> tuple[float, float]:
    """Seconds per call of the authorization work a call gets: with principals,
    the gate's ticket check plus the servicer's ``identify`` (a real ticket,
    obtained over a real ticket socket); without, ``identify`` alone. Fake
    contexts: grpc's own metadata handling is not in these numbers."""
    principals = load_config(principals_file, env={}).security.principals
    restricted = SecurityState(principals, "", max_ticket_holders=4)
    plain = SecurityState((), "", max_ticket_holders=4)
    with tempfile.TemporaryDirectory(prefix="kvtb-authz-") as directory:
        socket_path = os.path.join(directory, "kvtierd.sock")
        with socket.socket(socket.AF_UNIX) as stand_in:  # obtain_ticket checks its owner
            stand_in.bind(socket_path)
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(ticket_socket_path(socket_path))
            listener.listen()
            restricted.tickets.serve(listener)
            ticket = await asyncio.to_thread(obtain_ticket, socket_path, 5.0)
            assert ticket is not None and ticket.principal == "bench"
            metadata = (("user-agent", "grpc-python"), *ticket.metadata)
            context = _FakeContext(metadata)

            def restricted_call() -> object:
                assert restricted.admits_unix(metadata)
                return restricted.identify(context)  # type: ignore[arg-type]

            with_principals = _timed_per_call(restricted_call)
            without = _timed_per_call(lambda: plain.identify(context))  # type: ignore[arg-type]
            ticket.close()
            await restricted.tickets.close()
    return with_principals, without


def run() -> list[Row]:
    group = "authz, unix socket"
    with BenchDaemon() as plain_daemon:
        config = _principals_config(plain_daemon.workdir)
        with_principals, without = asyncio.run(_in_process_costs(config))
        with BenchDaemon("--config", config) as restricted_daemon:
            plain, restricted = _Side(plain_daemon), _Side(restricted_daemon)
            for i in range(ROUNDS):
                for side in (plain, restricted) if i % 2 == 0 else (restricted, plain):
                    side.round()
            plain.close()
            restricted.close()
    plain_p50 = statistics.median(plain.round_p50s)
    restricted_p50 = statistics.median(restricted.round_p50s)
    added = with_principals - without
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
        Row(group, "authorization work added per call (in-process: gate + identify)",
            added * 1e6, "us", f"no principals p50 {plain_p50 * 1e6:.0f} us",
            (plain_p50 + added) / plain_p50, "<= 1.05x"),
    ]  # fmt: skip


if __name__ == "__main__":
    from benchmarks.common import print_table

    print_table(run())
