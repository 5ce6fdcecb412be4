"""The security building blocks without a daemon: principals and their patterns,
the tokens file, the Authorizer's identity -> principal mapping, quotas, the
audit log's lines and rate limit, the pre-body gate, the ticket protocol."""

from __future__ import annotations

import logging
import os
import socket
from types import SimpleNamespace

import grpc
import pytest
from fake_clock import FakeClock

from kvtierd.config import ConfigError, load_config
from kvtierd.errors import ResourceExhausted
from kvtierd.security.access import AccessDenied
from kvtierd.security.audit import AuditLog, render
from kvtierd.security.authorizer import Authorizer, build_authorizer
from kvtierd.security.gate import AuthenticationGate
from kvtierd.security.identity import PeerCredentials, certificate_names, peer_credentials
from kvtierd.security.principals import (
    UNRESTRICTED,
    Principal,
    PrincipalOptionError,
    parse_principals,
)
from kvtierd.security.quotas import PoolQuotas
from kvtierd.security.state import SecurityState
from kvtierd.security.tokens import TokensFileError, read_token_lines
from kvtierd_client.wire.peer_ticket import (
    MAX_ANSWER_BYTES,
    TicketRefused,
    TicketSocketError,
    granted_line,
    obtain_ticket,
    parse_answer,
    refused_line,
    ticket_socket_path,
)

TEAM_A = {
    "name": "team-a",
    "uids": [1001],
    "gids": [],
    "pools": ["team-a/*"],
    "memory_quota": "8GiB",
}


def peer(uid: int, gid: int, *groups: int) -> PeerCredentials:
    return PeerCredentials(pid=42, uid=uid, gid=gid, groups=groups)


# ----------------------------------------------------------------- principals


def test_principal_patterns_match_whole_pool_names():
    principal = Principal("p", pools=("team-a/*", "exact"))
    assert principal.may_reach("team-a/x") and principal.may_reach("team-a/x/y")
    assert principal.may_reach("exact")
    assert not principal.may_reach("team-ab/x") and not principal.may_reach("exact2")
    assert not principal.may_reach("TEAM-A/x")  # case-sensitive
    assert not Principal("none", pools=()).may_reach("anything")
    assert UNRESTRICTED.may_reach("any/pool")


def test_principals_parse_from_the_normative_table():
    [principal] = parse_principals([TEAM_A])
    assert principal.name == "team-a" and principal.uids == frozenset({1001})
    assert principal.memory_quota == 8 << 30 and principal.pools == ("team-a/*",)


@pytest.mark.parametrize(
    ("tables", "key", "words"),
    [
        ([{**TEAM_A, "colour": 1}], "principals[0].colour", "unknown key"),
        ([{**TEAM_A, "name": "has space"}], "principals[0].name", "must be"),
        ([{k: v for k, v in TEAM_A.items() if k != "pools"}], "principals[0].pools", "missing"),
        ([{**TEAM_A, "uids": [-1]}], "principals[0].uids", "integers"),
        ([{**TEAM_A, "uids": "1001"}], "principals[0].uids", "list"),
        ([{**TEAM_A, "memory_quota": "lots"}], "principals[0].memory_quota", "lots"),
        ([TEAM_A, {**TEAM_A, "uids": []}], "principals[1].name", "duplicate"),
        ([TEAM_A, {**TEAM_A, "name": "b"}], "principals[1].uids", "uid 1001"),
        (
            [{**TEAM_A, "gids": [7]}, {**TEAM_A, "name": "b", "uids": [], "gids": [7]}],
            "principals[1].gids",
            "gid 7",
        ),
    ],
)
def test_bad_principal_tables_name_the_key(tables, key, words):
    with pytest.raises(PrincipalOptionError) as info:
        parse_principals(tables)
    assert info.value.key == key and words in info.value.message


def test_config_reads_principals_and_names_a_bad_key(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(
        '[[security.principals]]\nname = "team-a"\nuids = [1001]\npools = ["team-a/*"]\n'
    )
    config = load_config(str(good), env={})
    assert [p.name for p in config.security.principals] == ["team-a"]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[security.principals]]\nname = "x"\npools = "team-a/*"\n')
    with pytest.raises(ConfigError, match=r"^security\.principals\[0\]\.pools: "):
        load_config(str(bad), env={})
    assert load_config(None, env={}).security.principals == ()


# ----------------------------------------------------------------- tokens


def write_tokens(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_token_lines_with_and_without_principal(tmp_path):
    path = write_tokens(tmp_path, "# c\n\n  tok-0123456789abcdef  \ntok-fedcba9876543210 team-a\n")
    lines = read_token_lines(path)
    assert [(t.token, t.principal, t.line) for t in lines] == [
        ("tok-0123456789abcdef", "", 3), ("tok-fedcba9876543210", "team-a", 4),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "mode", "words"),
    [
        ("tok-0123456789abcdef\n", 0o644, "accessible by others"),
        ("short\n", 0o600, "line 1: tokens must be at least 16"),
        ("tok-0123456789abcdef a b\n", 0o600, "line 1: expected 'TOKEN' or 'TOKEN PRINCIPAL'"),
        ("# only a comment\n", 0o600, "must hold tokens"),
    ],
)
def test_bad_tokens_files_are_refused(tmp_path, text, mode, words):
    with pytest.raises(TokensFileError, match=words):
        read_token_lines(write_tokens(tmp_path, text, mode))


def test_authorizer_maps_tokens_to_principals(tmp_path):
    principals = parse_principals([TEAM_A])
    path = write_tokens(tmp_path, "bare-0123456789abcdef\nteam-0123456789abcdef team-a\n")
    authorizer = build_authorizer(principals, path)
    assert authorizer.for_token("bare-0123456789abcdef") is UNRESTRICTED
    assert authorizer.for_token("team-0123456789abcdef") is principals[0]
    assert authorizer.for_token("team-0123456789abcdeX") is None
    unknown = write_tokens(tmp_path, "team-0123456789abcdef team-b\n")
    with pytest.raises(TokensFileError, match="line 1: principal 'team-b' is not in"):
        build_authorizer(principals, unknown)
    twice = write_tokens(tmp_path, "same-0123456789abcdef\nsame-0123456789abcdef team-a\n")
    with pytest.raises(TokensFileError, match="line 2: this token is listed twice"):
        build_authorizer(principals, twice)


# ----------------------------------------------------------------- unix peers, certificates


def test_unix_peers_map_by_uid_then_by_group():
    principals = parse_principals(
        [
            {"name": "by-uid", "uids": [1001], "pools": ["a/*"]},
            {"name": "by-gid", "gids": [500], "pools": ["b/*"]},
            {"name": "other-gid", "gids": [600], "pools": ["c/*"]},
        ]
    )
    authorizer = Authorizer(principals)
    assert authorizer.for_unix_peer(peer(1001, 600)).name == "by-uid"  # the uid wins
    assert authorizer.for_unix_peer(peer(2000, 500)).name == "by-gid"  # primary group
    assert authorizer.for_unix_peer(peer(2000, 2000, 600)).name == "other-gid"  # supplementary
    with pytest.raises(AccessDenied, match=r"unknown unix peer \(unix uid=2000 gid=2000"):
        authorizer.for_unix_peer(peer(2000, 2000, 7))
    with pytest.raises(AccessDenied, match="ambiguous unix peer .* by-gid, other-gid"):
        authorizer.for_unix_peer(peer(2000, 500, 600))
    assert Authorizer().for_unix_peer(peer(2000, 2000)) is UNRESTRICTED  # no principals


def test_peer_credentials_come_from_the_kernel():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        credentials = peer_credentials(left)
    assert (credentials.pid, credentials.uid, credentials.gid) == (
        os.getpid(), os.geteuid(), os.getegid(),
    )  # fmt: skip
    assert set(credentials.groups) <= {os.getegid(), *os.getgroups()}


def test_client_certificates_name_principals_by_cn_or_dns_san():
    principals = parse_principals([TEAM_A, {"name": "team-b", "pools": ["team-b/*"]}])
    mtls = Authorizer(principals, client_certificates=True)
    names = certificate_names
    by_cn = names({"x509_common_name": [b"team-a"], "peer_dns": [b"host.example"]})
    assert mtls.for_certificate(by_cn) == (principals[0], "team-a")
    by_san = names({"x509_common_name": [b"host"], "peer_dns": [b"team-b"]})
    assert mtls.for_certificate(by_san) == (principals[1], "team-b")
    with pytest.raises(AccessDenied, match="names no"):
        mtls.for_certificate(names({"x509_common_name": [b"stranger"]}))
    with pytest.raises(AccessDenied, match="names several principals"):
        mtls.for_certificate(names({"x509_common_name": [b"team-a"], "peer_dns": [b"team-b"]}))
    assert mtls.for_certificate(names({})) is None  # no certificate on this connection
    assert Authorizer(principals).for_certificate(by_cn) is None  # mTLS off: ignored
    open_mtls = Authorizer(client_certificates=True)
    assert open_mtls.for_certificate(by_cn) == (UNRESTRICTED, "team-a")
    # CN first, then DNS SANs only (not IP or URI SANs), each name once
    mixed = {
        "x509_subject_alternative_name": [b"10.0.0.1", b"a"],
        "x509_common_name": [b"c"],
        "peer_dns": [b"a", b"c"],
    }
    assert certificate_names(mixed) == ("c", "a")


# ----------------------------------------------------------------- quotas


def test_quota_counts_the_pools_a_principal_may_reach():
    quotas = PoolQuotas(parse_principals([{**TEAM_A, "memory_quota": "64KiB"}]))
    charged = {"team-a/one": 32 << 10, "team-b/big": 1 << 30}
    quotas.check("team-a/two", 32 << 10, charged)  # exactly fits
    with pytest.raises(ResourceExhausted) as info:
        quotas.check("team-a/two", 36 << 10, charged)
    assert str(info.value) == (
        "pool 'team-a/two' needs 36.0 KiB but principal 'team-a' has a memory_quota of 64.0 KiB "
        "and its pools (team-a/*) take 32.0 KiB in 1 pools (team-a/one); free 32.0 KiB. Ask "
        "for fewer blocks or raise memory_quota"
    )
    quotas.check("team-b/other", 1 << 40, charged)  # no quota names it
    assert not PoolQuotas(parse_principals([{**TEAM_A, "memory_quota": 0}]))


# ----------------------------------------------------------------- audit


def test_audit_fields_are_quoted_when_not_plain():
    line = render({"principal": "team-a", "peer": 'unix uid=1 "x"', "pool": "a/b", "empty": ""})
    assert line == 'principal=team-a peer="unix uid=1 \\"x\\"" pool=a/b empty=""'


def test_audit_denials_are_rate_limited_per_kind(caplog):
    clock = FakeClock(0.0)
    audit = AuditLog(logging.getLogger("test.audit"), clock=clock)
    with caplog.at_level(logging.INFO, logger="test.audit"):
        for _ in range(5):
            audit.denied("FlushPool", "PERMISSION_DENIED", "team-b", "unix", "team-a/x", "no")
        audit.denied("OpenSession", "PERMISSION_DENIED", "team-b", "unix", "team-a/x", "no")
        audit.session("opened", "s1", "team-b", "unix", "team-b/y", client="c")
        clock.advance(60.0)
        audit.denied("FlushPool", "PERMISSION_DENIED", "team-b", "unix", "team-a/x", "no")
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" ")[:3] for line in lines] == [
        ["audit", "denied", "method=FlushPool"],
        ["audit", "denied", "method=OpenSession"],
        ["audit", "session-opened", "session=s1"],
        ["audit", "denied", "method=FlushPool"],
    ]
    assert lines[3].endswith("(4 similar lines suppressed since the previous one)")
    assert "principal=team-b peer=unix pool=team-a/x code=PERMISSION_DENIED reason=no" in lines[0]


# ----------------------------------------------------------------- gate


def test_gate_serves_admitted_calls_and_refuses_others_unread():
    real = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    refused: list[tuple[str, str]] = []
    gate = AuthenticationGate(
        {"/svc/M": real},
        admits=lambda metadata: ("ok", "1") in (metadata or ()),
        message="no",
        on_refused=lambda method, peer, message: refused.append((method, peer)),
    )
    ask = lambda method, metadata: gate.service(  # noqa: E731
        SimpleNamespace(method=method, invocation_metadata=metadata)
    )
    assert ask("/svc/M", (("ok", "1"),)) is real
    assert ask("/other/M", (("ok", "1"),)) is None
    refusal = ask("/svc/M", ())
    # a client-streaming handler without a deserializer: grpc hands it the request
    # stream unread, and it never reads it
    assert refusal.request_streaming and refusal.request_deserializer is None
    assert not refusal.response_streaming and refusal.stream_unary is not None


# ----------------------------------------------------------------- ticket protocol


def test_ticket_answers_round_trip():
    ticket = "ab" * 32
    assert parse_answer(granted_line(ticket, "team-a")) == (ticket, "team-a")
    with pytest.raises(TicketRefused, match="unknown unix peer"):
        parse_answer(refused_line("unknown unix peer\n(uid 7)"))
    long_reason = refused_line("x" * 5000)
    assert len(long_reason) == MAX_ANSWER_BYTES and long_reason.endswith(b"...\n")
    for garbage in (b"HTTP/1.1 400\n", b"KVTIER-TICKET/1 OK short team-a\n", b"\xff\n"):
        with pytest.raises(TicketSocketError):
            parse_answer(garbage)


def test_a_ticket_socket_owned_by_another_user_is_not_used(tmp_path):
    """Scenario: someone else's socket sits at PATH.tickets (it could hand out its
    own ticket and make this process's calls its own): the client refuses it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the planted socket another owner")
    daemon_socket = str(tmp_path / "kvtierd.sock")
    with socket.socket(socket.AF_UNIX) as daemon, socket.socket(socket.AF_UNIX) as planted:
        daemon.bind(daemon_socket)
        planted.bind(ticket_socket_path(daemon_socket))
        planted.listen()
        os.chown(ticket_socket_path(daemon_socket), 4242, 4242)
        with pytest.raises(TicketSocketError, match="owned by uid 4242"):
            obtain_ticket(daemon_socket, timeout=1)
    assert obtain_ticket(str(tmp_path / "absent.sock"), timeout=1) is None


def test_reloading_tokens_swaps_the_authorizer_and_a_bad_file_keeps_the_old(tmp_path):
    """Scenario: the tokens file changes; ``reload_tokens`` builds a new
    Authorizer (the old object is untouched: a call holding it is unaffected);
    a file that does not load raises and leaves the current one in place."""
    principals = parse_principals([TEAM_A])
    path = write_tokens(tmp_path, "old-0123456789abcdef team-a\n")
    security = SecurityState(principals, path, max_ticket_holders=4)
    before = security.authorizer
    write_tokens(tmp_path, "new-0123456789abcdef team-a\n")
    security.reload_tokens()
    assert security.authorizer is not before
    assert security.authorizer.for_token("new-0123456789abcdef") is principals[0]
    assert security.authorizer.for_token("old-0123456789abcdef") is None
    assert before.for_token("old-0123456789abcdef") is principals[0]
    current = security.authorizer
    write_tokens(tmp_path, "short\n")
    with pytest.raises(TokensFileError):
        security.reload_tokens()
    assert security.authorizer is current
