"""A client that truncates its pool's region file cannot kill the daemon.

Every client of a pool holds the region file writable (the descriptor the daemon
passes), so it can ``ftruncate`` it. A page of the daemon's mapping past the new
end raises SIGBUS when the daemon's own code touches it (hashing a row, sending
it to a socket from the mapping, copying a promoted block into it), and SIGBUS
kills the daemon: every pool and session of every user. The daemon now copies
row bytes only through system calls (``kvtierd.primary.rows``): the block whose
row is gone fails, with one rate-limited WARNING naming the pool and the region,
and nothing else does.

Each scenario runs against a real daemon process, a real truncated file and each
secondary tier that moves row bytes: the redis tier (``redis-server``), the fs
tier with its block I/O on the daemon's own threads (``io_processes = 0``) and
the fs tier with I/O worker processes (the default: a worker that dies of SIGBUS
is replaced; a regression guard). The journal's path is
``test_attack_wave3.py::test_a_client_that_truncates_the_region_cannot_kill_the_daemon``.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from daemon_harness import DaemonProcess, eventually, fs_tiers_config, start_daemon
from engine_harness import HIT, MISS, Engine, block_keys, payload
from redis_harness import RedisServer, redis_config

from kvtierd_client.client import Client, LookupResult

TIERS = ["redis", "fs-inline", "fs-workers"]


@pytest.fixture(params=TIERS)
def tiered_daemon(
    request: pytest.FixtureRequest, tmp_path: Path, key_prefix: str
) -> Iterator[tuple[str, DaemonProcess, Callable[[], int]]]:
    """(tier kind, a daemon with that one secondary tier, how many blocks the tier holds)."""
    kind = request.param
    held: Callable[[], int]
    client: redis.Redis | None = None
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        config = redis_config(server.url, key_prefix)
        client = redis.Redis.from_url(server.url)

        def held() -> int:
            assert client is not None
            return sum(1 for _ in client.scan_iter(match=f"{key_prefix}:*"))
    else:
        root = tmp_path / "fs"
        root.mkdir()
        io = {"io_processes": 0} if kind == "fs-inline" else {}
        config = fs_tiers_config(root, **io)

        def held() -> int:
            return sum(1 for _ in root.rglob("*.kvb"))

    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        yield kind, daemon, held
    finally:
        daemon.stop(signal.SIGKILL)
        daemon.cleanup()
        if client is not None:
            client.close()


def _region_lines(daemon: DaemonProcess, pool: str, kind: str) -> list[str]:
    """The daemon's WARNING lines saying a ``kind`` of ``pool`` failed on its region."""
    return [
        line
        for line in daemon.log().splitlines()
        if "WARNING" in line and f"pool {pool}: {kind} failed" in line and "region" in line
    ]


def test_a_store_into_a_truncated_region_fails_those_blocks_only(tiered_daemon, pool_name):
    """Scenario: an engine truncates its pool's region to 0 bytes, then completes a
    store of 4 keys (never written: the rows are gone). The cascade of each to the
    secondary tier reads a row past the end: it used to be hashed / sent through
    the daemon's mapping (SIGBUS, the daemon died). Now those 4 stores fail, one
    WARNING names the pool and the region, the file stays 0 bytes (nothing grows
    it back), and another pool's engine stores and loads bit-exact through the
    same tier afterwards."""
    kind, daemon, held = tiered_daemon
    engine = Engine(daemon, pool_name)
    bystander = Engine(daemon, pool_name + "-other")
    try:
        before = block_keys("before", 2)
        engine.store(before)
        engine.settle_cascades()
        assert held() == 2
        failures_before = engine.tier_stats().failures

        os.truncate(engine.session.region.path, 0)
        cut = block_keys("cut", 4)
        engine.session.prepare_store(cut)
        engine.session.complete_store(cut)  # cascaded: each row is read past the end
        engine.settle_cascades()

        assert daemon.alive(), f"the daemon died ({daemon.proc.returncode}):\n{daemon.log()}"
        assert engine.tier_stats().failures - failures_before == 4
        assert held() == 2, "a block whose row was cut off reached the tier"
        assert os.stat(engine.session.region.path).st_size == 0  # never grown back
        lines = _region_lines(daemon, pool_name, "store")
        assert len(lines) == 1, daemon.log()  # 4 failures, one line
        assert engine.session.region.path in lines[0]
        assert "is gone (exit status" not in daemon.log()  # fs-workers: no worker crashed

        others = block_keys("other", 3)
        bystander.store(others)
        bystander.settle_cascades()
        assert bystander.load(others) == [payload(k) for k in others]
        assert held() == 5
    finally:
        engine.close()
        bystander.close()


def test_a_promotion_into_a_truncated_region_fails_and_never_grows_the_file(
    tiered_daemon, pool_name
):
    """Scenario: 4 blocks reach the tier and are evicted from a 4-row primary; the
    engine truncates the region to 0 bytes; a Lookup of them starts promotions,
    which copy each verified block into its row: that write used to go through
    the daemon's mapping (SIGBUS on write, the daemon died). Now the promotions
    fail (the keys answer MISS, never HIT), the tier keeps the blocks (the file
    and the value are good; only the row is gone), a WARNING names the pool and
    the region, and the region file stays 0 bytes: nothing grows it back, so no
    reader can find zeros where the daemon lists a block."""
    kind, daemon, held = tiered_daemon
    engine = Engine(daemon, pool_name, num_blocks=4)
    try:
        first, second = block_keys("a", 4), block_keys("b", 4)
        engine.store(first)
        engine.settle_cascades()
        engine.store(second)  # evicts `first` from the primary
        engine.settle_cascades()
        assert held() == 8

        os.truncate(engine.session.region.path, 0)
        results: list[object] = []

        def all_failed() -> bool:
            results[:] = engine.wait_settled(first)
            return engine.tier_stats().promotion_failures >= 4 and results == [MISS] * 4

        eventually(all_failed, 30, lambda: f"the promotions failed; lookups {results}")
        assert daemon.alive(), f"the daemon died ({daemon.proc.returncode}):\n{daemon.log()}"
        assert HIT not in engine.session.lookup(first)
        assert os.stat(engine.session.region.path).st_size == 0  # never grown back
        assert held() == 8, "a good block was dropped because its row was cut off"
        lines = _region_lines(daemon, pool_name, "promotion")
        assert lines, daemon.log()
        assert engine.session.region.path in lines[0]
        assert re.search(r"could not be written|past the end", lines[0])
        assert "is gone (exit status" not in daemon.log()
    finally:
        engine.close()


WARM_BLOCK = 8192


def test_a_region_truncated_while_the_daemon_was_down_starts_its_pool_cold(pool_name):
    """Scenario: the daemon stops (warm restart keeps the region and its journal);
    a client of the old daemon, still holding the file, truncates it; the next
    daemon's adoption checks the size before anything reads the rows (and hashes
    them with ``preadv`` anyway): the pool starts cold with one line saying why, the
    daemon serves it and every other pool."""
    daemon = start_daemon("--lease", "2s", "--write-quarantine", "1s")
    daemons = [daemon]
    try:
        with Client(daemon.address) as client:
            session = client.open_session(pool_name, block_bytes=WARM_BLOCK, num_blocks=16)
            grant = session.prepare_store([b"kept"])
            assert grant is not None
            with open(session.region.path, "r+b") as region:
                os.pwrite(region.fileno(), b"k" * WARM_BLOCK, grant.block_ids[0] * WARM_BLOCK)
            session.complete_store([b"kept"])
            path = session.region.path
        assert daemon.stop() == 0, daemon.log()
        os.truncate(path, 3 * WARM_BLOCK)
        daemon = daemon.restart()
        daemons.append(daemon)
        with Client(daemon.address) as client:
            session = client.open_session(pool_name, block_bytes=WARM_BLOCK, num_blocks=16)
            assert session.lookup([b"kept"]) == [MISS]
            grant = session.prepare_store([b"new"])
            assert grant is not None
            session.complete_store([b"new"])
            assert session.lookup([b"new"]) == [HIT]
        assert daemon.alive(), daemon.log()
        lines = [line for line in daemon.log().splitlines() if "starting cold" in line]
        assert len(lines) == 1 and f"is {3 * WARM_BLOCK} bytes, expected" in lines[0], lines
    finally:
        for each in daemons:
            each.stop(signal.SIGKILL)
        daemons[-1].cleanup()


def test_a_client_that_truncates_the_region_cannot_kill_the_daemon():
    """Every client of a pool holds its region file writable (the descriptor the
    daemon passes; group members may also open it), so it can ``ftruncate`` it. The
    warm-restart journal hashed completed rows through the daemon's mapping: a row
    past the new end raised SIGBUS and killed the daemon -- every pool and session of
    every user -- at the next CompleteStore. The journal now reads rows with
    ``preadv`` (a short read: the row is not vouched for, MISS after a restart)."""
    daemon = start_daemon("--lease", "2s", "--write-quarantine", "1s")
    try:
        client = Client(daemon.address)
        attacker = client.open_session("cut", block_bytes=WARM_BLOCK, num_blocks=64, layout="l1")
        bystander = client.open_session("other", block_bytes=WARM_BLOCK, num_blocks=64, layout="l1")
        os.truncate(attacker.region.path, 0)
        keys = [b"k%d" % i for i in range(8)]
        grant = attacker.prepare_store(keys)
        assert grant is not None and len(grant.block_ids) == 8
        attacker.complete_store(keys)  # never written: the rows are past the end
        journal = attacker.region.path[: -len(".region")] + ".journal"
        lag = lambda: client.get_stats("cut").pools[0].journal_lag_seconds  # noqa: E731
        eventually(  # the journal has read the rows past the end (its lag back to none)
            lambda: not daemon.alive() or lag() == 0.0, 30,
            lambda: f"the completions journaled; lag {lag()}s",
        )  # fmt: skip
        assert daemon.alive(), f"the daemon died ({daemon.proc.returncode}):\n{daemon.log()}"
        assert bystander.lookup([b"x"]) == [LookupResult.MISS]  # everyone else still served
        assert os.path.exists(journal)
        attacker.close()
        bystander.close()
        client.close()
    finally:
        daemon.stop(signal.SIGKILL)
        daemon.cleanup()


def test_a_truncated_region_cannot_kill_the_daemon_through_the_redis_tier(
    redis_server: RedisServer, key_prefix: str, pool_name
):
    """The redis tier's store hashed the row and handed it to the socket through the
    daemon's mapping on an I/O thread: a region its client truncated killed the
    daemon with SIGBUS at the cascade. Rows are now copied out with a system call
    (``kvtierd.primary.rows``): the store of a row past the cut fails, nothing else.
    (``tests/integration/primary/test_truncated_region.py`` covers every other path.)"""
    daemon = start_daemon(
        "--memory-budget", "64MiB", config=redis_config(redis_server.url, key_prefix)
    )
    try:
        engine = Engine(daemon, pool_name)
        os.truncate(engine.session.region.path, 0)
        keys = block_keys("cut", 4)
        engine.session.prepare_store(keys)
        engine.session.complete_store(keys)  # never written: past the end; cascaded to redis
        eventually(  # the cascade has read the rows past the end: each store failed
            lambda: not daemon.alive() or engine.tier_stats().failures >= len(keys), 30,
            lambda: f"the cascade's stores failed; {engine.tier_stats()}",
        )  # fmt: skip
        assert daemon.alive(), f"the daemon died ({daemon.proc.returncode})"
        engine.close()
    finally:
        daemon.stop(signal.SIGKILL)
        daemon.cleanup()
