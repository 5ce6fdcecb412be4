"""Principals and per-pool authorization against the real daemon, with real
users: throw-away accounts (created as root, removed at teardown) run client
calls in their own processes, so the daemon sees their kernel credentials.

Scenario of most tests: principals team-a (uid of user A), team-b (uid of user
B), admin (uid 0, every pool); the socket's group is a throw-away group both
users are members of, so the socket's permissions let them in and the
principals decide the rest.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_harness import (
    DaemonProcess,
    eventually,
    free_port,
    peak_rss_bytes,
    start_daemon,
    wait_ticket_refused,
)
from users_harness import Group, ThrowawayAccounts, User, principals_toml, run_as, start_shared

from kvtierd_client.client import Client
from kvtierd_client.errors import PermissionDenied, ResourceExhausted
from kvtierd_client.wire.peer_ticket import obtain_ticket
from kvtierd_client.wire.proto import pb2


@pytest.fixture
def two_teams(accounts: ThrowawayAccounts) -> Iterator[tuple[DaemonProcess, User, User, Group]]:
    group = accounts.group()
    a, b = accounts.user(group), accounts.user(group)
    config = principals_toml(
        {"name": "admin", "uids": [0], "pools": ["*"]},
        {"name": "team-a", "uids": [a.uid], "pools": ["team-a/*"]},
        {"name": "team-b", "uids": [b.uid], "pools": ["team-b/*"]},
    )
    daemon = start_shared(config, group)
    try:
        yield daemon, a, b, group
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def denied(result: dict[str, object], principal: str, pool: str) -> bool:
    details = str(result.get("details", ""))
    return (
        result.get("error") == "PERMISSION_DENIED"
        and f"principal {principal!r}" in details
        and repr(pool) in details
    )


def test_two_principals_cannot_open_flush_watch_or_stat_each_others_pools(two_teams):
    daemon, a, b, _ = two_teams
    first = run_as(a, daemon.address, [["open", "team-a/x"], ["lookup", "team-a/x"]])
    assert "ok" in first[0] and first[1] == {"ok": [1]}, first  # MISS
    session_a = first[0]["ok"]
    calls = [
        ["open", "team-b/y"],
        ["open", "team-a/z"],
        ["flush", "team-a/x"],
        ["watch", "team-a/x"],
        ["stats", "team-a/x"],
        ["explain", "team-a/x"],
        ["stats"],
        ["hijack_lookup", session_a],
        ["keepalive", session_a],
        ["close_session", session_a],
    ]
    results = run_as(b, daemon.address, calls)
    assert "ok" in results[0], results
    for call, result in zip(calls[1:6], results[1:6], strict=True):
        assert denied(result, "team-b", call[1]), (call, result)
    assert results[6] == {"ok": ["team-b/y"]}  # GetStats of all pools: only its own
    for call, result in zip(calls[7:], results[7:], strict=True):
        assert result["error"] == "PERMISSION_DENIED", (call, result)
        assert "belongs to principal 'team-a'" in str(result["details"]), result
    # team-a's session survived every attempt, and team-a reaches team-b's pool no more
    back = run_as(a, daemon.address, [["flush", "team-b/y"], ["watch", "team-b/y"]])
    assert all(denied(r, "team-a", "team-b/y") for r in back), back
    with Client(daemon.address) as admin:  # uid 0: principal admin, every pool
        assert sorted(p.name for p in admin.get_stats().pools) == ["team-a/x", "team-b/y"]
        # team-a's session was not closed by team-b's CloseSession
        assert admin.get_stats("team-a/x").pools[0].sessions == 1
    log = daemon.log()
    assert "audit session-opened" in log and "principal=team-a" in log
    assert "audit denied method=OpenSession principal=team-b" in log
    assert "pool=team-a/z" in log


def test_two_principals_cannot_map_each_others_regions(two_teams):
    """With principals, region files are the daemon's alone (0600): each team maps
    its own pool by descriptor, and neither reaches the other's, by descriptor
    (even holding the other's session id) or by path."""
    daemon, a, b, _ = two_teams
    first = run_as(a, daemon.address, [["open", "team-a/x"], ["map", "team-a/x"]])
    assert "ok" in first[0] and "ok" in first[1], first
    session_a, region = first[0]["ok"], first[1]["ok"]
    assert stat.S_IMODE(os.stat(region["path"]).st_mode) == 0o600
    results = run_as(
        b,
        daemon.address,
        [
            ["open", "team-b/y"],
            ["map", "team-b/y"],
            ["map_foreign", region["fd_socket"], session_a],
            ["open_path", region["path"]],
        ],
    )
    assert "ok" in results[1], results  # its own pool: mapped by descriptor
    refused = results[2]["ok"]
    assert refused.startswith("denied:") and "belongs to principal 'team-a'" in refused, refused
    assert results[3] == {"ok": "EACCES"}, results
    with Client(daemon.address) as admin:  # team-a's pool is unharmed
        assert admin.get_stats("team-a/x").pools[0].sessions == 1
    assert "region of pool 'team-a/x' refused" in daemon.log()


def test_an_unknown_unix_peer_is_refused_and_an_outsider_cannot_connect(accounts):
    group = accounts.group()
    member, outsider = accounts.user(group), accounts.user()
    config = principals_toml({"name": "admin", "uids": [0], "pools": ["*"]})
    daemon = start_shared(config, group)
    try:
        [unknown] = run_as(member, daemon.address, [["open", "any/pool"]])
        assert unknown["error"] == "PERMISSION_DENIED", unknown
        assert f"unknown unix peer (unix uid={member.uid}" in str(unknown["details"])
        [refused] = run_as(outsider, daemon.address, [["stats"]])
        assert refused["error"] == "UNAVAILABLE", refused  # the socket's mode: 0660
        log = daemon.log()
        assert f'audit denied method=peer-ticket principal=- peer="unix uid={member.uid}' in log
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_a_group_names_a_principal(accounts):
    """Scenario: a principal lists a gid; a user with that gid among its
    supplementary groups is that principal."""
    socket_group, team = accounts.group(), accounts.group()
    user = accounts.user(socket_group, team)
    config = principals_toml(
        {"name": "admin", "uids": [0], "pools": ["*"]},
        {"name": "team-g", "gids": [team.gid], "pools": ["g/*"]},
    )
    daemon = start_shared(config, socket_group)
    try:
        results = run_as(user, daemon.address, [["open", "g/one"], ["open", "h/two"]])
        assert "ok" in results[0], results
        assert denied(results[1], "team-g", "h/two"), results
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_memory_quota_bounds_a_principals_pools(tmp_path):
    """Scenario: team q has a 64 KiB quota over q/*; the third pool does not fit
    (RESOURCE_EXHAUSTED with the numbers), joining an existing pool still works,
    and other principals' pools do not count."""
    config = principals_toml(
        {"name": "q", "uids": [0], "pools": ["q/*", "shared/*"], "memory_quota": "64KiB"},
    )
    daemon = start_daemon(config=config)
    try:
        with Client(daemon.address) as client:
            client.open_session("q/a", block_bytes=4096, num_blocks=8)
            client.open_session("q/b", block_bytes=4096, num_blocks=8)
            with pytest.raises(ResourceExhausted) as info:
                client.open_session("q/c", block_bytes=4096, num_blocks=1)
            message = info.value.details
            assert "principal 'q' has a memory_quota of 64.0 KiB" in message
            assert "take 64.0 KiB in 2 pools (q/a, q/b)" in message and "4.0 KiB" in message
            client.open_session("q/a", block_bytes=4096)  # joining costs nothing
            assert [p.name for p in client.get_stats().pools] == ["q/a", "q/b"]
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_tokens_map_to_principals_over_tcp(tmp_path):
    """Scenario: "TOKEN PRINCIPAL" lines give team-a's token team-a's pools only;
    a bare "TOKEN" line reaches every pool, as before principals."""
    team_token, bare_token = "team-a-token-0123456789", "bare-token-0123456789abc"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# tokens\n{team_token} team-a\n{bare_token}\n")
    os.chmod(tokens, 0o600)
    config = principals_toml(
        {"name": "admin", "uids": [0], "pools": ["*"]},
        {"name": "team-a", "pools": ["team-a/*"]},
    )
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--tokens-file", str(tokens), "--listen", address, config=config)
    try:
        with Client(address, token=team_token) as team:
            team.open_session("team-a/x", block_bytes=4096, num_blocks=2)
            with pytest.raises(
                PermissionDenied, match="principal 'team-a' may not open pool 'b/y'"
            ):
                team.open_session("b/y", block_bytes=4096, num_blocks=2)
        with Client(address, token=bare_token) as bare:
            bare.open_session("b/y", block_bytes=4096, num_blocks=2)
            assert sorted(p.name for p in bare.get_stats().pools) == ["b/y", "team-a/x"]
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_a_token_naming_an_unknown_principal_stops_the_start(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("some-token-0123456789 nobody\n")
    os.chmod(tokens, 0o600)
    config = principals_toml({"name": "admin", "uids": [0], "pools": ["*"]})
    daemon = start_daemon("--tokens-file", str(tokens), config=config, wait=False)
    try:
        assert daemon.proc.wait(30) == 2
        assert "security.tokens_file" in daemon.log() and "'nobody'" in daemon.log()
    finally:
        daemon.cleanup()


def test_health_is_open_and_reflection_needs_a_token_over_tcp(tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    token = "reflection-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(token + "\n")
    os.chmod(tokens, 0o600)
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--tokens-file", str(tokens), "--listen", address)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        with grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            answer = check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
            with pytest.raises(grpc.RpcError) as info:
                list(reflect(iter([request]), timeout=5))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            bearer = (("authorization", f"Bearer {token}"),)
            [listed] = list(reflect(iter([request]), timeout=5, metadata=bearer))
            names = {s.name for s in listed.list_services_response.service}
            assert "kvtier.v1.KVTier" in names
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_a_ticket_ends_with_its_connection():
    """A peer ticket proves a process's identity only while the process holds
    its ticket connection; afterwards the same metadata is UNAUTHENTICATED."""
    config = principals_toml({"name": "admin", "uids": [0], "pools": ["*"]})
    daemon = start_daemon(config=config)
    try:
        ticket = obtain_ticket(daemon.socket_path, timeout=5)
        assert ticket is not None and ticket.principal == "admin"
        stub = daemon.stub()
        stub.GetStats(pb2.GetStatsRequest(), metadata=ticket.metadata, timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetStats(pb2.GetStatsRequest(), timeout=5)  # no ticket
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ticket.close()
        wait_ticket_refused(stub, ticket.metadata)
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_a_client_gets_a_new_ticket_after_a_daemon_restart():
    """The restarted daemon knows no ticket: the client's first call is refused
    UNAUTHENTICATED, it takes a new ticket and the call goes through."""
    config = principals_toml({"name": "admin", "uids": [0], "pools": ["*"]})
    first = start_daemon(config=config)
    second = None
    try:
        with Client(first.address) as client:
            client.open_session("r/one", block_bytes=4096, num_blocks=2, keepalive=False)
            assert first.stop() == 0
            second = first.restart()
            session = client.open_session("r/two", block_bytes=4096, num_blocks=2)
            assert session.lookup([b"k"]) == [1]
        assert second.stop() == 0
    finally:
        (second or first).cleanup()


def test_the_socket_directory_the_daemon_creates_gets_the_socket_group(accounts):
    """Scenario: the socket's directory does not exist; the daemon creates it (one
    level: its parent exists) with group socket_group, mode 0750, so a member of that
    group reaches the socket."""
    group = accounts.group()
    member = accounts.user(group)
    base = Path(tempfile.mkdtemp(prefix="kvt-sockdir-", dir="/tmp"))
    os.chmod(base, 0o711)
    socket_path = base / "kvtierd" / "kvtierd.sock"
    daemon = start_daemon("--socket-group", group.name, "--listen", f"unix://{socket_path}")
    try:
        info = socket_path.parent.stat()
        assert (info.st_gid, info.st_mode & 0o777) == (group.gid, 0o750)
        [stats] = run_as(member, f"unix://{socket_path}", [["stats"]])
        assert stats == {"ok": []}, stats
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def test_large_unauthenticated_requests_are_refused_unread(tmp_path):
    """Scenario: 8 concurrent 60 MB requests without a token (TCP), then 8 without
    a peer ticket (the Unix socket of a daemon with principals), each under the
    receive limit. All are UNAUTHENTICATED and the daemon's peak RSS stays flat:
    the gate answers before the body is read (read and parsed first, the 8 TCP
    ones took ~420 MiB)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("rss-token-0123456789abcdef\n")
    os.chmod(tokens, 0o600)
    address, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = principals_toml({"name": "admin", "uids": [0], "pools": ["*"]})
    daemon = start_daemon(
        "--tokens-file", str(tokens), "--listen", address, "--max-keys-per-call", "131072",
        "--metrics-address", metrics, config=config,
    )  # fmt: skip
    body = b"\x0a" * (60 << 20)
    options = [("grpc.max_send_message_length", -1)]
    try:
        before = peak_rss_bytes(daemon.proc.pid)
        for target in (address, daemon.target):
            codes: list[grpc.StatusCode] = []

            def send(target: str = target, codes: list[grpc.StatusCode] = codes) -> None:
                with grpc.insecure_channel(target, options=options) as channel:
                    lookup = channel.unary_unary("/kvtier.v1.KVTier/Lookup")
                    try:
                        lookup(body, timeout=60)
                    except grpc.RpcError as err:
                        codes.append(err.code())

            senders = [threading.Thread(target=send) for _ in range(8)]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join()
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8, (target, codes)
        grown = peak_rss_bytes(daemon.proc.pid) - before
        assert grown < 64 << 20, f"peak RSS grew by {grown >> 20} MiB"
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
            counted = response.read().decode()
        assert 'kvtierd_rpc_requests_total{code="UNAUTHENTICATED",method="Lookup"} 16.0' in counted
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_audit_log_records_sessions_and_rate_limits_denials():
    """One audit line per session opened, closed and expired, with principal,
    peer and pool; 20 denied calls of one kind within seconds log one line."""
    config = principals_toml({"name": "ops", "uids": [0], "pools": ["ops/*"]})
    daemon = start_daemon("--lease", "1s", config=config)
    try:
        with Client(daemon.address) as client:
            closed = client.open_session("ops/closed", block_bytes=4096, num_blocks=2)
            closed.close()
            client.open_session("ops/expired", block_bytes=4096, num_blocks=2, keepalive=False)
            for _ in range(20):
                with pytest.raises(PermissionDenied):
                    client.flush_pool("elsewhere/pool")
            eventually(lambda: "audit session-expired" in daemon.log(), 30, "the lease expired")
        lines = [line for line in daemon.log().splitlines() if " audit " in line]
        peer = f'peer="unix uid=0 gid=0 pid={os.getpid()}"'
        opened = [line for line in lines if "audit session-opened" in line]
        assert len(opened) == 2 and all(f"principal=ops {peer}" in line for line in opened)
        [closed_line] = [line for line in lines if "audit session-closed" in line]
        assert "pool=ops/closed" in closed_line and 'reason="closed by client"' in closed_line
        [expired_line] = [line for line in lines if "audit session-expired" in line]
        assert "pool=ops/expired" in expired_line and "lease expired" in expired_line
        [denial] = [line for line in lines if "audit denied" in line]
        assert "method=FlushPool principal=ops" in denial and "pool=elsewhere/pool" in denial
        assert "code=PERMISSION_DENIED" in denial
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
