"""TLS's cost on TCP: the same Lookup over TCP in plain text, with TLS and with
mutual TLS, side by side, plus what a new connection's handshake adds.

Three daemons run at once (a daemon's TCP listeners are all TLS or all plain):
plain TCP with a bearer token, TLS with the token, and mTLS where the client
certificate is the credential. Rounds alternate between them so that drift of
a shared machine falls on all three alike; the Unix socket of the plain daemon
is the reference every engine on the host uses. Certificates (P-256) come from
a CA made for the run (``tests/tls_ca.py``, needs ``cryptography``).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.common import BenchDaemon, Row, cpu_seconds, percentile
from kvtierd_client.client import DEFAULT_CHANNEL_OPTIONS, Client
from kvtierd_client.tls import TlsOptions
from tests.tls_ca import TestCA

POOL = "bench/tls"
BLOCK = 4096
KEYS = 32
ROUNDS = 6  # rounds per mode, alternating modes
CALLS_PER_ROUND = 400
WARMUP = 200
CONNECTS = 60  # new connections per mode (handshake rows)
TOKEN = "bench-token-0123456789abcdef"
PLAIN = "TCP, plain text + token"  # the floor of the rows
FRESH_CONNECTION = (*DEFAULT_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))


@dataclass
class Mode:
    name: str  # row label
    daemon: BenchDaemon
    make_client: Callable[[], Client]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(directory: str, ca: TestCA, started: list[BenchDaemon]) -> list[Mode]:
    """The daemons and how to reach each; every daemon started is appended to
    ``started`` at once (the caller stops them, whatever fails)."""
    tokens = os.path.join(directory, "tokens")
    with open(tokens, "w") as handle:
        handle.write(TOKEN + "\n")
    os.chmod(tokens, 0o600)
    server_cert, server_key = ca.issue("kvtierd", ip_addresses=("127.0.0.1",)).write(
        directory, "server"
    )
    ca_file = ca.write(os.path.join(directory, "ca.pem"))
    client = ca.issue("bench-client")
    trust = TlsOptions(root_certificates=ca.cert_pem)
    mutual = TlsOptions(ca.cert_pem, client.cert_pem, client.key_pem)
    tls_flags = ("--tls-cert-file", server_cert, "--tls-key-file", server_key)
    ports = [_free_port() for _ in range(3)]

    def daemon(port: int, *flags: str) -> BenchDaemon:
        started.append(
            BenchDaemon("--listen", f"127.0.0.1:{port}", "--tokens-file", tokens, *flags)
        )
        return started[-1]

    def client_for(address: str, tls: TlsOptions | None, token: str | None) -> Callable[[], Client]:
        return lambda: Client(address, tls=tls, token=token, channel_options=FRESH_CONNECTION)

    plain = daemon(ports[0])
    modes = [Mode(PLAIN, plain,
                  client_for(f"127.0.0.1:{ports[0]}", None, TOKEN))]  # fmt: skip
    tls = daemon(ports[1], *tls_flags)
    modes.append(Mode("TCP, TLS + token", tls, client_for(f"tls://127.0.0.1:{ports[1]}", trust,
                                                          TOKEN)))  # fmt: skip
    mtls = daemon(ports[2], *tls_flags, "--tls-client-ca-file", ca_file)
    modes.append(Mode("TCP, mTLS (client certificate)", mtls,
                      client_for(f"tls://127.0.0.1:{ports[2]}", mutual, None)))  # fmt: skip
    modes.append(Mode("Unix socket (reference)", plain, client_for(plain.address, None, None)))
    return modes


def _lookup_samples(modes: list[Mode]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Lookup(KEYS keys) latencies per mode, over one connection each, and the
    daemon's CPU seconds per Lookup (``/proc``, user + system) per mode."""
    keys = [f"hot-{i:04d}".encode() for i in range(KEYS)]
    sessions = {}
    clients = []
    for mode in modes:
        client = mode.make_client()
        clients.append(client)
        session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=1024)
        grant = session.prepare_store(keys)
        session.complete_store(grant.keys_to_store if grant else [])
        for _ in range(WARMUP):
            session.lookup(keys)
        sessions[mode.name] = session
    samples: dict[str, list[float]] = {mode.name: [] for mode in modes}
    daemon_cpu = dict.fromkeys(sessions, 0.0)
    for _ in range(ROUNDS):
        for mode in modes:
            session, pid = sessions[mode.name], mode.daemon.proc.pid
            cpu0 = cpu_seconds(pid)
            for _ in range(CALLS_PER_ROUND):
                t0 = time.perf_counter()
                session.lookup(keys)
                samples[mode.name].append(time.perf_counter() - t0)
            daemon_cpu[mode.name] += cpu_seconds(pid) - cpu0
    for session in sessions.values():
        session.close()
    for client in clients:
        client.close()
    calls = ROUNDS * CALLS_PER_ROUND
    return samples, {name: seconds / calls for name, seconds in daemon_cpu.items()}


def _connect_samples(modes: list[Mode]) -> dict[str, list[float]]:
    """New connection (TCP + TLS handshake) and a first GetStats, per mode."""
    samples: dict[str, list[float]] = {mode.name: [] for mode in modes}
    for _ in range(CONNECTS):
        for mode in modes:
            t0 = time.perf_counter()
            with mode.make_client() as client:
                client.get_stats(pool=POOL)
                samples[mode.name].append(time.perf_counter() - t0)
    return samples


def run() -> list[Row]:
    directory = tempfile.mkdtemp(prefix="kvtb-tls-", dir="/tmp")
    started: list[BenchDaemon] = []
    try:
        modes = _start(directory, TestCA("kvtierd-bench-ca"), started)
        lookups, daemon_cpu = _lookup_samples(modes)
        connects = _connect_samples(modes)
    finally:
        for daemon in started:
            daemon.close()
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    return _rows(lookups, daemon_cpu, connects)


def _rows(
    lookups: dict[str, list[float]], daemon_cpu: dict[str, float], connects: dict[str, list[float]]
) -> list[Row]:
    rows: list[Row] = []
    for label, samples, what in ((f"Lookup({KEYS} keys)", lookups, "p50"),
                                 ("connect + first GetStats", connects, "p50")):  # fmt: skip
        base = percentile(samples[PLAIN], 0.5)
        for name, values in samples.items():
            p50 = percentile(values, 0.5)
            compared = name != PLAIN
            rows.append(Row(
                "tls on tcp, 1 client", f"{label} {what}, {name}", p50 * 1e6, "us",
                f"plain TCP {base * 1e6:.0f} us" if compared else "",
                p50 / base if compared else None,
            ))  # fmt: skip
        if samples is lookups:
            rows += _cpu_rows(daemon_cpu)
    return rows


def _cpu_rows(daemon_cpu: dict[str, float]) -> list[Row]:
    base = daemon_cpu[PLAIN]
    return [
        Row("tls on tcp, 1 client", f"Lookup({KEYS} keys) daemon CPU, {name}", seconds * 1e6,
            "us/call", f"plain TCP {base * 1e6:.0f} us" if name != PLAIN else "",
            seconds / base if name != PLAIN else None)
        for name, seconds in daemon_cpu.items()
    ]  # fmt: skip


if __name__ == "__main__":
    from benchmarks.common import print_table

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print_table(run())
