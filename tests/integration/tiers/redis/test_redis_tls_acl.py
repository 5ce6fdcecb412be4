"""The redis tier over TLS and as a restricted ACL user, against real servers.

Certificates come from a CA the test makes (tests/tls_ca.py); the servers listen on
TLS only and ask for a client certificate; a standalone server and a 3-master
Cluster (bus and replication over TLS too). The tier's user may run only
``ACL_COMMANDS`` on its key prefix: every store, load, probe, delete and health
check of the tests below goes through, and the servers' ACL logs stay empty (the
tier sends nothing else). What the server refuses -- a wrong password, a user the
ACL does not allow, a certificate the tier does not trust or does not present, a
plain connection to a TLS port -- is one clear WARNING naming the option to fix,
and the tier degrades (cascades fail, counted; the engine is served from the
primary); the daemon never stops. TLS files that cannot be used stop the start
with exit code 2 and one line naming the option.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, eventually, refused_start
from engine_harness import HIT, Engine, block_keys, payload
from redis_harness import (
    RedisClusterNodes,
    RedisServer,
    RedisTls,
    acl_denials,
    promoted,
    redis_config,
    redis_key,
    restrict_user,
)

from kvtierd.tiers import blockformat
from kvtierd.tiers.redis.access import ACL_COMMANDS

USER, PASSWORD = "kvtierd-tier", "tier-s3cret"
FAST = {"info_interval": "300ms", "timeout": "1s"}


@pytest.fixture
def tls(tmp_path: Path) -> RedisTls:
    directory = tmp_path / "tls"
    directory.mkdir()
    return RedisTls.make(directory)


def _password(tmp_path: Path, text: str = PASSWORD) -> Path:
    path = tmp_path / f"password-{text}"
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def _exercise(writer: Engine, reader: Engine, tag: str) -> None:
    """Every command of the tier: stores (SET), probes (EXISTS), promotions (GETRANGE),
    a damaged value deleted unless replaced (WATCH / MULTI / EXEC), evictions (DEL)."""
    keys = block_keys(tag, 6)
    writer.store(keys)
    writer.settle_cascades()
    assert writer.tier_stats().cascade_failures == 0, writer.daemon.log()
    promoted(reader, keys)  # unknown to the reader: probed, then promoted
    assert reader.load(keys) == [payload(k) for k in keys]  # bit-exact over TLS


def _clean(daemon: DaemonProcess) -> None:
    log = daemon.log()
    for word in ("NOPERM", "refused", "TLS with the server failed", "failed:"):
        assert word not in log, log


def test_rediss_to_a_standalone_server_as_a_restricted_acl_user(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    tls: RedisTls,
    tmp_path: Path,
):
    server = redis_factory(tls=tls)
    assert server.url.startswith("rediss://")
    restrict_user([server], USER, PASSWORD, key_prefix)
    config = redis_config(
        server.url, key_prefix, username=USER, password_file=_password(tmp_path),
        capacity=f"{4 * (blockformat.HEADER_SIZE + 65536)}", **tls.tier_options(), **FAST,
    )  # fmt: skip
    writer, reader = Engine(daemons(config), pool_name), Engine(daemons(config), pool_name)
    _exercise(writer, reader, "tls")  # 6 blocks in one job: held, though over a capacity of 4
    writer.store(block_keys("more", 2))
    writer.settle_cascades()
    assert writer.tier_stats().evictions == 4  # down to the capacity: 4 deleted (DEL)
    with server.client() as admin:
        eventually(lambda: admin.dbsize() == 4, 20, "the evicted values deleted")
    with server.client() as admin:
        name = redis_key(key_prefix, pool_name, b"tls-5")
        value = admin.get(name)
        assert isinstance(value, bytes)
        admin.set(name, value[:-1] + bytes([value[-1] ^ 1]))  # damaged: deleted at its load
    fresh = Engine(daemons(config), pool_name)
    eventually(lambda: fresh.session.lookup([b"tls-5"]) and fresh.tier_stats().checksum_failures,
               20, "the damaged value refused", interval=0.01)  # fmt: skip
    with server.client() as admin:
        assert admin.exists(redis_key(key_prefix, pool_name, b"tls-5")) == 0
    eventually(lambda: reader.tier_stats().nodes_reachable == 1, 20, "a health check (INFO)")
    assert acl_denials([server]) == []
    for engine in (writer, reader, fresh):
        _clean(engine.daemon)
        engine.close()


def test_rediss_to_a_cluster_as_a_restricted_acl_user(
    redis_cluster_factory: Callable[..., RedisClusterNodes],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    tls: RedisTls,
    tmp_path: Path,
):
    cluster = redis_cluster_factory(tls=tls)
    restrict_user(cluster.nodes, USER, PASSWORD, key_prefix)
    config = redis_config(
        cluster.urls, key_prefix, cluster="auto", username=USER, fleet_capacity="64MiB",
        password_file=_password(tmp_path), **tls.tier_options(), **FAST,
    )  # fmt: skip
    writer = Engine(daemons(config), pool_name, num_blocks=16)
    reader = Engine(daemons(config), pool_name, num_blocks=16)
    _exercise(writer, reader, "tls-cluster")
    holding = []
    for node in cluster.nodes:
        with node.client() as admin:
            index = admin.keys(f"{key_prefix}:lru:*")  # fleet_capacity's LRU index
            holding.append(admin.dbsize() - len(index))
    assert sum(holding) == 6 and sum(1 for n in holding if n) >= 2, holding  # spread
    eventually(lambda: reader.tier_stats().nodes_reachable == 3, 20, "health checks of 3 nodes")
    assert "redis tier: cluster server at" in reader.daemon.log()
    assert acl_denials(cluster.nodes) == []
    for engine in (writer, reader):
        _clean(engine.daemon)
        engine.close()


def _degraded(daemon: DaemonProcess, pool_name: str, words: str) -> None:
    """The tier refused by its server: a WARNING says ``words`` -- the store's, or the
    link's when the refusal came as the client was built (a wrong password: whichever
    call built it first, the health check's INFO or a store, says it once, and the
    calls after it are DEBUG lines); stores cascade to nothing (failures counted), the
    engine is served from the primary."""
    engine = Engine(daemon, pool_name)
    keys = block_keys("refused", 2)
    engine.store(keys)
    engine.settle_cascades()
    assert engine.tier_stats().cascade_failures >= 1
    assert engine.load(keys) == [payload(k) for k in keys]
    assert engine.session.lookup(keys) == [HIT, HIT]

    def said() -> bool:
        lines = daemon.log().split("\n")
        return any(" WARNING kvtierd.tiers.redis." in line and words in line for line in lines)

    eventually(said, 20, lambda: f"{words!r} in the tier's WARNING:\n{daemon.log()}")
    assert daemon.alive()
    engine.close()


def test_a_wrong_password_degrades_the_tier_with_a_clear_message(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    tmp_path: Path,
):
    server = redis_factory()
    restrict_user([server], USER, PASSWORD, key_prefix)
    config = redis_config(server.url, key_prefix, username=USER,
                          password_file=_password(tmp_path, "not-the-password"))  # fmt: skip
    daemon = daemons(config)
    _degraded(daemon, pool_name, "the server refused the credentials of user 'kvtierd-tier'")
    assert "(check username and password_file)" in daemon.log()
    assert "not-the-password" not in daemon.log()


def test_a_user_the_acl_does_not_allow_degrades_the_tier_with_a_clear_message(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    tmp_path: Path,
):
    """The user's key pattern is another prefix (a copy-paste of another fleet's)."""
    server = redis_factory()
    restrict_user([server], USER, PASSWORD, "another-prefix")
    config = redis_config(server.url, key_prefix, username=USER, password_file=_password(tmp_path))
    daemon = daemons(config)
    _degraded(daemon, pool_name, "the server's ACL refused user 'kvtierd-tier'")
    assert f"the key pattern {key_prefix}:*, see docs/guides/fleet.md" in daemon.log()
    assert any("key" in denial for denial in acl_denials([server]))


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("a CA that did not sign the server", "TLS with the server failed"),
        ("no client certificate", "TLS with the server failed"),
        ("redis:// to a TLS port", "(a TLS port? then use rediss:// URLs)"),
    ],
)
def test_a_tls_mismatch_degrades_the_tier_with_a_clear_message(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    tls: RedisTls,
    tmp_path: Path,
    case: str,
    words: str,
):
    server = redis_factory(tls=tls)
    if case.startswith("a CA"):
        stranger = RedisTls.make(tmp_path / "tls", "stranger")
        config = redis_config(server.url, key_prefix, **stranger.tier_options(), **FAST)
    elif case == "no client certificate":
        config = redis_config(server.url, key_prefix, **tls.tier_options(False), **FAST)
    else:
        config = redis_config(server.url.replace("rediss", "redis"), key_prefix, **FAST)
    _degraded(daemons(config), pool_name, words)


BAD_TLS_FILES = [
    ("a missing CA file", lambda t, d: {**t.tier_options(), "tls_ca_file": str(d / "none.pem")},
     "tls_ca_file: cannot load CA certificates"),
    ("a private key others may read", lambda t, d: t.tier_options(), "is open to others"),
    ("a key that is not the certificate's",
     lambda t, d: {**t.tier_options(), "tls_key_file": t.server_key},
     "tls_cert_file: cannot load the client certificate"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "words"), [c[1:] for c in BAD_TLS_FILES], ids=[c[0] for c in BAD_TLS_FILES]
)
def test_tls_files_that_cannot_be_used_stop_the_start_naming_the_option(
    tls: RedisTls,
    tmp_path: Path,
    make,
    words: str,  # noqa: ANN001
):
    options = make(tls, tmp_path)
    if "others" in words:
        Path(options["tls_key_file"]).chmod(0o644)
    config = tmp_path / "kvtierd.toml"
    config.write_text(redis_config("rediss://127.0.0.1:1", "p", **options))
    line = refused_start(config, tmp_path)
    assert "tiers[0].tls_" in line and words in line, line


def test_the_acl_commands_are_the_ones_the_docs_give() -> None:
    """The fleet guide's ACL line is the one the tests run with."""
    guide = (Path(__file__).resolve().parents[4] / "docs" / "guides" / "fleet.md").read_text()
    line = " ".join(f"+{command}" for command in ACL_COMMANDS)
    assert line in " ".join(guide.split()), line
