"""TLS credentials of the daemon (``kvtierd.security``) against a real grpc.aio
server in this process: the certificate fetcher, reloads that keep the old
credentials on a bad file, and the names a verified client certificate gives."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_ca import Issued, TestCA, write_atomically

from kvtierd.config import ConfigError
from kvtierd.security.identity import tls_peer_name, tls_peer_names
from kvtierd.security.reload import CredentialReloader
from kvtierd.security.tls import ServerTls, TlsFiles, read_tls_material
from kvtierd_client.tls import TlsOptions, aio_channel, resolve_tls

SERVER_SANS = {"dns_names": ("localhost",), "ip_addresses": ("127.0.0.1",)}
FRESH_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)  # never share a connection


@pytest.fixture(scope="module")
def ca() -> TestCA:
    return TestCA("unit-ca")


def _files(tmp_path: Any, ca: TestCA, server: Issued, *, client_ca: bool) -> TlsFiles:
    cert, key = server.write(tmp_path, "server")
    ca_file = ca.write(tmp_path / "clients-ca.pem") if client_ca else ""
    return TlsFiles(cert, key, ca_file)


# ----------------------------------------------------------------- reading files


def test_material_is_read_and_checked(tmp_path, ca):
    files = _files(tmp_path, ca, ca.issue("kvtierd", **SERVER_SANS), client_ca=True)
    material = read_tls_material(files)
    assert material.certificate_chain.startswith(b"-----BEGIN CERTIFICATE-----")
    assert material.client_ca == ca.cert_pem


def test_key_of_another_certificate_is_refused(tmp_path, ca):
    files = _files(tmp_path, ca, ca.issue("kvtierd"), client_ca=False)
    write_atomically(files.key_file, ca.issue("other").key_pem, 0o600)
    with pytest.raises(ConfigError, match=r"^security.tls_cert_file: .* not a PEM certificate"):
        read_tls_material(files)


def test_key_readable_by_others_is_refused(tmp_path, ca):
    files = _files(tmp_path, ca, ca.issue("kvtierd"), client_ca=False)
    os.chmod(files.key_file, 0o604)
    with pytest.raises(ConfigError, match=r"^security.tls_key_file: .* accessible by others"):
        read_tls_material(files)


@pytest.mark.parametrize("content", [b"", b"not a certificate\n"])
def test_client_ca_without_a_certificate_is_refused(tmp_path, ca, content):
    files = _files(tmp_path, ca, ca.issue("kvtierd"), client_ca=True)
    write_atomically(files.client_ca_file, content, 0o644)
    with pytest.raises(ConfigError, match=r"^security.tls_client_ca_file: "):
        read_tls_material(files)


def test_missing_file_is_named(tmp_path, ca):
    files = _files(tmp_path, ca, ca.issue("kvtierd"), client_ca=False)
    os.unlink(files.cert_file)
    with pytest.raises(ConfigError, match=r"^security.tls_cert_file: cannot read .*server.pem"):
        read_tls_material(files)


# ----------------------------------------------------------------- the fetcher


def test_fetcher_hands_each_reload_out_once(tmp_path, ca):
    files = _files(tmp_path, ca, ca.issue("kvtierd"), client_ca=False)
    tls = ServerTls(files)
    fetch = tls.fetcher()
    assert fetch() is None  # what the listener started with: unchanged
    ca.issue("kvtierd-2").write(tmp_path, "server")
    tls.reload()
    assert tls.generation == 1
    assert isinstance(fetch(), grpc.ServerCertificateConfiguration)
    assert fetch() is None
    late = tls.fetcher()  # a listener made after the reload starts with it
    assert late() is None


def test_bad_reload_keeps_the_previous_credentials(tmp_path, ca):
    files = _files(tmp_path, ca, ca.issue("kvtierd"), client_ca=False)
    tls = ServerTls(files)
    fetch = tls.fetcher()
    write_atomically(files.key_file, b"-----BEGIN PRIVATE KEY-----\ngarbage\n", 0o600)
    with pytest.raises(ConfigError, match="security.tls_cert_file"):
        tls.reload()
    assert tls.generation == 0
    assert fetch() is None  # nothing new for any listener


def test_reloader_runs_every_part_and_reports_the_refused(caplog):
    calls: list[str] = []

    def bad() -> None:
        calls.append("bad")
        raise ConfigError("security.tokens_file", "/x must hold tokens")

    reloader = CredentialReloader()
    reloader.add("tokens", bad)
    reloader.add("TLS", lambda: calls.append("tls"))
    outcome = reloader.reload_all()
    assert calls == ["bad", "tls"]
    assert outcome.reloaded == ("TLS",)
    assert outcome.refused == (("tokens", "security.tokens_file: /x must hold tokens"),)
    assert "keeping the previous tokens" in caplog.text


# ----------------------------------------------------------------- a real server


class _NamesHealth(health_pb2_grpc.HealthServicer):
    """Answers SERVING and records the certificate names of each caller."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[str, ...], str | None]] = []

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        self.seen.append((tls_peer_names(context), tls_peer_name(context)))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@asynccontextmanager
async def _server(tls: ServerTls) -> AsyncIterator[tuple[int, _NamesHealth]]:
    server = grpc.aio.server()
    servicer = _NamesHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    await server.start()
    try:
        yield port, servicer
    finally:
        await server.stop(None)


async def _check(port: int, options: TlsOptions | None) -> grpc.StatusCode:
    """One Check over a connection of its own; OK or the failure's code."""
    channel = aio_channel(f"127.0.0.1:{port}", FRESH_CONNECTION, options)
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as err:
        return err.code()
    finally:
        await channel.close()
    return grpc.StatusCode.OK


def _run(scenario: Callable[[], Any]) -> None:
    asyncio.run(scenario())


def test_mtls_names_come_from_cn_then_dns_sans(tmp_path, ca):
    tls = ServerTls(_files(tmp_path, ca, ca.issue("kvtierd", **SERVER_SANS), client_ca=True))
    named = ca.issue("team-a", dns_names=("team-a.example", "team-a"))
    sans_only = ca.issue(None, dns_names=("team-b.example",))
    foreign = TestCA("foreign").issue("team-a")

    async def scenario() -> None:
        async with _server(tls) as (port, servicer):

            def client(issued: Issued | None) -> TlsOptions:
                chain = issued.cert_pem if issued else None
                key = issued.key_pem if issued else None
                return TlsOptions(ca.cert_pem, chain, key)

            assert await _check(port, client(named)) == grpc.StatusCode.OK
            assert await _check(port, client(sans_only)) == grpc.StatusCode.OK
            assert await _check(port, client(None)) == grpc.StatusCode.UNAVAILABLE
            assert await _check(port, client(foreign)) == grpc.StatusCode.UNAVAILABLE
            assert await _check(port, None) == grpc.StatusCode.UNAVAILABLE  # plain text
            assert servicer.seen == [
                (("team-a", "team-a.example"), "team-a"),
                (("team-b.example",), "team-b.example"),
            ]

    _run(scenario)


def test_tls_without_client_ca_names_no_one(tmp_path, ca):
    tls = ServerTls(_files(tmp_path, ca, ca.issue("kvtierd", **SERVER_SANS), client_ca=False))
    client = ca.issue("team-a")

    async def scenario() -> None:
        async with _server(tls) as (port, servicer):
            presented = TlsOptions(ca.cert_pem, client.cert_pem, client.key_pem)
            assert await _check(port, presented) == grpc.StatusCode.OK
            assert await _check(port, TlsOptions(ca.cert_pem)) == grpc.StatusCode.OK
            assert servicer.seen == [((), None), ((), None)]  # never asked for, never used

    _run(scenario)


def test_reload_serves_new_handshakes_and_keeps_connections(tmp_path, ca):
    """Scenario: the server certificate moves to another CA. A connection made
    before keeps working; new connections get the new certificate."""
    tls = ServerTls(_files(tmp_path, ca, ca.issue("kvtierd", **SERVER_SANS), client_ca=False))
    new_ca = TestCA("new-ca")

    async def scenario() -> None:
        async with _server(tls) as (port, _):
            old = aio_channel(f"127.0.0.1:{port}", FRESH_CONNECTION, TlsOptions(ca.cert_pem))
            stub = health_pb2_grpc.HealthStub(old)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            new_ca.issue("kvtierd", **SERVER_SANS).write(tmp_path, "server")
            tls.reload()
            assert await _check(port, TlsOptions(new_ca.cert_pem)) == grpc.StatusCode.OK
            assert await _check(port, TlsOptions(ca.cert_pem)) == grpc.StatusCode.UNAVAILABLE
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # still connected
            await old.close()

    _run(scenario)


# ----------------------------------------------------------------- client options


def test_client_tls_options():
    with pytest.raises(ValueError, match="private key"):
        TlsOptions(certificate_chain=b"x")
    assert resolve_tls("127.0.0.1:1", "127.0.0.1:1", None) is None
    assert resolve_tls("tls://127.0.0.1:1", "127.0.0.1:1", None) == TlsOptions()
    with pytest.raises(ValueError, match="Unix socket"):
        resolve_tls("unix:///x.sock", "unix:/x.sock", TlsOptions())
    assert TlsOptions(server_name="kvtierd").channel_options() == (
        ("grpc.ssl_target_name_override", "kvtierd"),
    )
