"""TLS and mutual TLS on TCP listeners, and credentials re-read on SIGHUP, against
the real daemon over real sockets. Certificates come from CAs made by each test
(``tls_ca``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, eventually, free_port, start_daemon
from tls_ca import Issued, TestCA, write_atomically

from kvtierd_client.client import DEFAULT_CHANNEL_OPTIONS, Client, LookupResult
from kvtierd_client.errors import PermissionDenied, Unauthenticated, Unavailable
from kvtierd_client.tls import TlsOptions

BLOCK = 4096
TOKEN = "first-token-0123456789"
KVTIERCTL = str(Path(sys.executable).parent / "kvtierctl")
SERVER_SANS = {"dns_names": ("localhost",), "ip_addresses": ("127.0.0.1",)}
# each client its own connection: a new Client must make a new TLS handshake
FRESH_CONNECTION = (*DEFAULT_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))


@dataclass
class TlsDaemon:
    daemon: DaemonProcess
    port: int
    directory: Path  # server.pem, server.key, clients-ca.pem, tokens

    @property
    def address(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    def client(self, tls: TlsOptions | None, token: str | None = None) -> Client:
        address = self.address if tls is not None else f"127.0.0.1:{self.port}"
        return Client(address, tls=tls, token=token, timeout=5, channel_options=FRESH_CONNECTION)

    def sighup(self) -> None:
        os.kill(self.daemon.proc.pid, signal.SIGHUP)

    def log_says(self, text: str) -> None:
        eventually(lambda: text in self.daemon.log(), 30, f"daemon log says {text!r}")


@pytest.fixture
def start_tls_daemon(tmp_path) -> Iterator:
    """Starts a daemon with a TCP listener; ``server``: its certificate (None: plain
    TCP), ``client_ca``: mTLS, ``tokens``: the tokens file's lines."""
    started: list[DaemonProcess] = []

    def start(
        server: Issued | None,
        *,
        client_ca: TestCA | None = None,
        tokens: tuple[str, ...] | None = (TOKEN,),
        config: str = "",
    ) -> TlsDaemon:
        port = free_port()
        args = ["--listen", f"127.0.0.1:{port}"]
        if server is not None:
            cert, key = server.write(tmp_path, "server")
            args += ["--tls-cert-file", cert, "--tls-key-file", key]
        if client_ca is not None:
            args += ["--tls-client-ca-file", client_ca.write(tmp_path / "clients-ca.pem")]
        if tokens is not None:
            write_tokens(tmp_path / "tokens", *tokens)
            args += ["--tokens-file", str(tmp_path / "tokens")]
        daemon = start_daemon(*args, config=config)
        started.append(daemon)
        return TlsDaemon(daemon, port, tmp_path)

    yield start
    for daemon in started:
        try:
            assert daemon.stop() == 0, daemon.log()
        finally:
            daemon.cleanup()


def write_tokens(path: Path, *tokens: str, mode: int = 0o600) -> None:
    write_atomically(str(path), "".join(f"{token}\n" for token in tokens).encode(), mode)


def store(session, *keys: bytes) -> None:  # noqa: ANN001
    grant = session.prepare_store(list(keys))
    session.complete_store(grant.keys_to_store)


@pytest.fixture(scope="module")
def ca() -> TestCA:
    return TestCA("kvtierd-test-ca")


# ----------------------------------------------------------------- TLS


def test_tls_listener_serves_tls_only(start_tls_daemon, ca, pool_name):
    served = start_tls_daemon(ca.issue("kvtierd", **SERVER_SANS))
    trusted = TlsOptions(root_certificates=ca.cert_pem)
    with served.client(trusted, TOKEN) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=4)
        store(session, b"k")
        assert session.lookup([b"k"]) == [LookupResult.HIT]
    with served.client(None, TOKEN) as plain, pytest.raises(Unavailable):
        plain.get_stats()  # plain text on a TLS listener: the handshake fails
    with served.client(trusted) as anonymous, pytest.raises(Unauthenticated):
        anonymous.get_stats()  # TLS alone is not a credential: the token still is
    other = TlsOptions(root_certificates=TestCA("other-ca").cert_pem)
    with served.client(other, TOKEN) as mistrusting, pytest.raises(Unavailable):
        mistrusting.get_stats()  # the client checks the daemon's certificate
    with Client(served.daemon.address) as local:  # the Unix socket stays plain
        assert [p.name for p in local.get_stats().pools] == [pool_name]


def test_mtls_accepts_only_certificates_the_client_ca_signed(start_tls_daemon, ca, pool_name):
    clients_ca = TestCA("clients-ca")
    served = start_tls_daemon(ca.issue("kvtierd", **SERVER_SANS), client_ca=clients_ca, tokens=None)

    def presenting(issued: Issued | None) -> TlsOptions:
        if issued is None:
            return TlsOptions(root_certificates=ca.cert_pem)
        return TlsOptions(ca.cert_pem, issued.cert_pem, issued.key_pem)

    with served.client(presenting(clients_ca.issue("team-a"))) as client:  # no token needed
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=4)
        store(session, b"k")
        assert session.lookup([b"k"]) == [LookupResult.HIT]
    with served.client(presenting(clients_ca.issue(None, dns_names=("team-b.x",)))) as by_san:
        assert by_san.get_stats().pools
    with served.client(presenting(None)) as without, pytest.raises(Unavailable):
        without.get_stats()
    foreign = TestCA("foreign-ca").issue("team-a")
    with served.client(presenting(foreign)) as impostor, pytest.raises(Unavailable):
        impostor.get_stats()
    nameless = clients_ca.issue(None, ip_addresses=("10.0.0.1",))
    with served.client(presenting(nameless)) as no_one, pytest.raises(Unauthenticated):
        no_one.get_stats()  # signed, but names no one (no CN, no DNS name)


TEAMS = """
[[security.principals]]
name = "team-a"
pools = ["team-a/*"]

[[security.principals]]
name = "team-b"
pools = ["team-b/*"]
"""


def test_mtls_certificates_and_reloaded_tokens_name_principals(start_tls_daemon, ca):
    """Scenario: principals with mTLS and a tokens file. A certificate whose CN is
    team-a is team-a without a token (its pools only); one naming no principal is
    refused; a certificate naming nothing falls back to the token. After SIGHUP a
    new token line naming team-b is team-b and the old token is refused: the
    tokens live in one place, the daemon's authorizer."""
    clients_ca = TestCA("clients-ca")
    server = ca.issue("kvtierd", **SERVER_SANS)
    served = start_tls_daemon(
        server, client_ca=clients_ca, tokens=(f"{TOKEN} team-a",), config=TEAMS
    )

    def presenting(issued: Issued) -> TlsOptions:
        return TlsOptions(ca.cert_pem, issued.cert_pem, issued.key_pem)

    with served.client(presenting(clients_ca.issue("team-a"))) as team_a:
        session = team_a.open_session("team-a/llama", block_bytes=BLOCK, num_blocks=4)
        store(session, b"k")
        with pytest.raises(PermissionDenied, match="'team-a' may not open pool 'team-b/x'"):
            team_a.open_session("team-b/x", block_bytes=BLOCK, num_blocks=4)
        assert [p.name for p in team_a.get_stats().pools] == ["team-a/llama"]
    stranger = presenting(clients_ca.issue("stranger"))
    with served.client(stranger) as no_one, pytest.raises(PermissionDenied, match="names no"):
        no_one.get_stats()
    nameless = presenting(clients_ca.issue(None, ip_addresses=("10.0.0.1",)))
    with served.client(nameless, TOKEN) as by_token:
        assert [p.name for p in by_token.get_stats().pools] == ["team-a/llama"]

    new_token = "second-token-0123456789"
    write_tokens(served.directory / "tokens", f"{new_token} team-b")
    served.sighup()
    served.log_says("SIGHUP: tokens reloaded")
    with served.client(nameless, new_token) as team_b:
        team_b.open_session("team-b/x", block_bytes=BLOCK, num_blocks=4)
        with pytest.raises(PermissionDenied):
            team_b.get_stats("team-a/llama")
    with served.client(nameless, TOKEN) as old, pytest.raises(Unauthenticated):
        old.get_stats()


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--tls-cert-file", "/etc/kvtierd/server.pem"], "security.tls_key_file"),
        (["--tls-client-ca-file", "/etc/kvtierd/ca.pem"], "security.tls_client_ca_file"),
        (["--tls-cert-file", "{dir}/server.pem", "--tls-key-file", "{dir}/other.key"],
         "security.tls_cert_file"),
        (["--tls-cert-file", "{dir}/server.pem", "--tls-key-file", "{dir}/open.key"],
         "security.tls_key_file"),
    ],
    ids=["cert-without-key", "client-ca-without-tls", "key-of-another-cert", "key-readable"],
)  # fmt: skip
def test_bad_tls_configuration_refuses_the_start(tmp_path, ca, flags, key):
    ca.issue("kvtierd").write(tmp_path, "server")
    ca.issue("other").write(tmp_path, "other")
    cert, open_key = ca.issue("kvtierd").write(tmp_path, "open")
    os.replace(cert, tmp_path / "server.pem")  # open.key belongs to server.pem now
    os.chmod(open_key, 0o644)
    daemon = start_daemon(*(flag.format(dir=tmp_path) for flag in flags), wait=False)
    try:
        assert daemon.proc.wait(30) == 2, daemon.log()
        assert key in daemon.log()
    finally:
        daemon.cleanup()


def test_a_new_connection_waits_out_a_slow_handshake(start_tls_daemon, ca):
    """A daemon that answers a new connection's handshake late (descheduled on a
    loaded host; stopped here for 0.3 s) still serves that connection's first
    call: the client's connection attempt is not cut at 100 ms (it was, through
    ``grpc.min_reconnect_backoff_ms``, and the call failed with Unavailable)."""
    served = start_tls_daemon(ca.issue("kvtierd", **SERVER_SANS))
    pid = served.daemon.proc.pid
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(0.3, os.kill, (pid, signal.SIGCONT))
    resume.start()
    try:
        assert _reaches(served, TlsOptions(ca.cert_pem))
    finally:
        resume.join()
        os.kill(pid, signal.SIGCONT)


# ----------------------------------------------------------------- SIGHUP


def test_sighup_rotates_the_server_certificate_and_keeps_sessions(start_tls_daemon, ca, pool_name):
    """Scenario: the daemon's certificate is replaced by one of another CA and
    SIGHUP sent. New connections get the new certificate (a client trusting only
    the old CA now fails its handshake); a client connected before keeps its
    connection and its session. A bad key file later keeps the new credentials."""
    served = start_tls_daemon(ca.issue("kvtierd", **SERVER_SANS))
    old_trust, new_ca = TlsOptions(ca.cert_pem), TestCA("next-year-ca")
    new_trust = TlsOptions(new_ca.cert_pem)
    with served.client(old_trust, TOKEN) as before:
        session = before.open_session(pool_name, block_bytes=BLOCK, num_blocks=4)
        store(session, b"k")
        new_ca.issue("kvtierd", **SERVER_SANS).write(served.directory, "server")
        served.sighup()
        eventually(lambda: _reaches(served, new_trust), 30, "a new handshake uses the new cert")
        assert not _reaches(served, old_trust)
        # The connection made before the reload still carries this session: had it
        # been dropped, reconnecting with the old CA's trust would fail.
        assert session.lookup([b"k"]) == [LookupResult.HIT]

        write_atomically(str(served.directory / "server.key"), b"not a key\n", 0o600)
        served.sighup()
        served.log_says("keeping the previous TLS")
        assert _reaches(served, new_trust)
        assert session.lookup([b"k"]) == [LookupResult.HIT]
    assert served.daemon.alive()


def test_sighup_rotates_the_client_ca(start_tls_daemon, ca, pool_name):
    """Scenario: client certificates move to a new CA. After SIGHUP a certificate
    of the old CA no longer connects, one of the new CA does, and a client that
    connected with the old CA's certificate keeps its connection and session."""
    old_ca, new_ca = TestCA("clients-2025"), TestCA("clients-2026")
    served = start_tls_daemon(ca.issue("kvtierd", **SERVER_SANS), client_ca=old_ca, tokens=None)
    old_cert, new_cert = old_ca.issue("team-a"), new_ca.issue("team-a")
    old_client = TlsOptions(ca.cert_pem, old_cert.cert_pem, old_cert.key_pem)
    new_client = TlsOptions(ca.cert_pem, new_cert.cert_pem, new_cert.key_pem)
    assert not _reaches(served, new_client)
    with served.client(old_client) as before:
        session = before.open_session(pool_name, block_bytes=BLOCK, num_blocks=4)
        store(session, b"k")
        new_ca.write(served.directory / "clients-ca.pem")
        served.sighup()
        eventually(lambda: _reaches(served, new_client), 30, "the new client CA is used")
        assert not _reaches(served, old_client)
        assert session.lookup([b"k"]) == [LookupResult.HIT]


def test_sighup_reloads_tokens(start_tls_daemon, pool_name):
    """Scenario: the tokens file is rewritten and SIGHUP sent. The new token is
    accepted; the removed one is refused for every later call, on a connection
    made before too. A tokens file readable by others is refused and the tokens
    loaded before stay."""
    served = start_tls_daemon(None, tokens=(TOKEN,))
    new_token = "second-token-0123456789"
    with served.client(None, TOKEN) as before:
        session = before.open_session(pool_name, block_bytes=BLOCK, num_blocks=4)
        store(session, b"k")
        write_tokens(served.directory / "tokens", new_token)
        served.sighup()
        eventually(lambda: _reaches(served, None, new_token), 30, "the new token is accepted")
        with pytest.raises(Unauthenticated):
            session.lookup([b"k"])
        with pytest.raises(Unauthenticated):
            before.get_stats()
        assert not _reaches(served, None, TOKEN)

    write_tokens(served.directory / "tokens", "third-token-0123456789", mode=0o644)
    served.sighup()
    served.log_says("keeping the previous tokens")
    assert _reaches(served, None, new_token)
    assert not _reaches(served, None, "third-token-0123456789")


def _reaches(served: TlsDaemon, tls: TlsOptions | None, token: str | None = TOKEN) -> bool:
    """Whether a new connection with ``tls`` and ``token`` gets an answer."""
    try:
        with served.client(tls, token) as client:
            client.get_stats()
    except (Unavailable, Unauthenticated):
        return False
    return True


# ----------------------------------------------------------------- kvtierctl


def test_kvtierctl_over_mtls(start_tls_daemon, ca, tmp_path):
    clients_ca = TestCA("clients-ca")
    served = start_tls_daemon(ca.issue("kvtierd", **SERVER_SANS), client_ca=clients_ca, tokens=None)
    cert, key = clients_ca.issue("operator").write(tmp_path, "operator")
    ca_file = ca.write(tmp_path / "daemon-ca.pem")

    def ctl(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KVTIERCTL, "--address", served.address, "--timeout", "5", *flags, "status"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    done = ctl("--tls-ca", ca_file, "--tls-cert", cert, "--tls-key", key)
    assert done.returncode == 0, done.stderr
    assert "kvtierd" in done.stdout
    refused = ctl("--tls-ca", ca_file)
    assert refused.returncode == 1
    assert "UNAVAILABLE" in refused.stderr
    usage = ctl("--tls-ca", ca_file, "--tls-cert", cert)
    assert usage.returncode == 2
    assert "private key" in usage.stderr


def test_client_refuses_tls_on_a_unix_socket(tmp_path):
    with pytest.raises(ValueError, match="Unix socket"):
        Client(f"unix://{tmp_path}/kvtierd.sock", tls=TlsOptions())
    with pytest.raises(ValueError, match="tls:// must be followed by host:port"):
        Client(f"tls://{tmp_path}/kvtierd.sock")
