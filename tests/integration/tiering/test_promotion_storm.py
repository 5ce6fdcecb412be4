"""A promotion storm against the real daemon (issue #15, item 5).

Scenario: a primary tier far smaller than what the waiting requests look up
(32 rows; 20 shared documents of 11 blocks each, all stored, cascaded to the fs
tier and flushed from the primary), and 12 engine sessions, each serving
requests for random documents the way vLLM's scheduler does: a prefix Lookup
every step while anything is HIT_PENDING, then a load of the leading HIT run
(the rest is recomputed). Before promotion holds, every promotion evicted the
blocks other waiting requests had just had promoted and not yet pinned, which
were then promoted again: the storm did not end, and the disk was read many
times per block served.

Two flows, as clients use the daemon: ``load`` (Lookup, then PrepareLoad +
CompleteLoad of the leading HITs) and ``pin`` (the vLLM plug-in: a pinning
Lookup each step; the pins of a request still waiting are released at the end
of the step, those of a request that can run are its load).
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from daemon_harness import (
    DaemonProcess,
    daemon_command,
    eventually,
    fs_tiers_config,
    start_daemon,
    wait_tier_jobs,
)

from kvtierd_client.client import Client, LookupResult, Session
from kvtierd_client.errors import FailedPrecondition

BLOCK = 4096
ROWS = 32
DOCS = 20
DOC_BLOCKS = 11
ENGINES = 12
REQUESTS = 8  # per engine
STEP = 0.002  # seconds between two lookups of a waiting request (a scheduler step)
STORM_BOUND = 60.0  # seconds the whole storm may take (it takes 1-3 s when it works)

HIT, PENDING, RETRY = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY


def document(index: int) -> list[bytes]:
    """The keys of a document: a prefix chain of DOC_BLOCKS keys."""
    return [f"doc{index:02d}-{i:02d}".encode() for i in range(DOC_BLOCKS)]


@dataclass
class EngineTally:
    loaded: int = 0  # blocks loaded (pinned by a request that then ran)
    lookups: int = 0
    requests: int = 0
    lost_races: int = 0  # PrepareLoad refused: a HIT evicted before the load
    errors: list[BaseException] = field(default_factory=list)


def tiered_daemon(root: Path, hold: str) -> DaemonProcess:
    root.mkdir()
    config = fs_tiers_config(root) + f'[limits]\npromotion_hold = "{hold}"\n'
    return start_daemon("--memory-budget", "64MiB", config=config)


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the module (tests use their own pools). Holds last 10 s: a
    test that checks a block is held is not at the mercy of a stalled machine."""
    daemon = tiered_daemon(tmp_path_factory.mktemp("storm") / "fs", "10s")
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def store_documents(daemon: DaemonProcess, session: Session, pool: str) -> None:
    """Stores every document (its cascade reaches the fs tier before the next one
    needs the rows), then flushes the primary: every block lives in the fs tier only."""
    stub = daemon.stub()
    for index in range(DOCS):
        keys = document(index)
        assert session.prepare_store(keys) is not None
        session.complete_store(keys)
        wait_tier_jobs(stub, pool)
    session.client.flush_pool(pool)
    primary, fs = session.client.get_stats(pool).pools[0].tiers
    assert primary.used_blocks == 0 and fs.used_blocks == DOCS * DOC_BLOCKS


def serve_request(session: Session, keys: list[bytes], flow: str, tally: EngineTally) -> None:
    """One request: waits while anything of its prefix is HIT_PENDING (RETRY too),
    then loads the leading HIT run; what follows it is recomputed."""
    while True:
        tally.lookups += 1
        if flow == "pin":
            results, rows = session.lookup_and_pin(keys, prefix=True)
            pinned = [key for key, row in zip(keys, rows, strict=True) if row >= 0]
        else:
            results = session.lookup(keys, prefix=True)
            pinned = []
        waiting = any(result in (PENDING, RETRY) for result in results)
        if flow == "pin":
            if pinned:
                session.complete_load(pinned)  # waiting: released; running: loaded
            if not waiting:
                tally.loaded += len(pinned)
                return
        elif not waiting:
            run = next((i for i, r in enumerate(results) if r is not HIT), len(keys))
            if run == 0:
                return
            try:
                session.prepare_load(keys[:run])
            except FailedPrecondition:
                tally.lost_races += 1  # evicted between the lookup and the load: again
                continue
            session.complete_load(keys[:run])
            tally.loaded += run
            return
        time.sleep(STEP)  # on purpose: the engine's next scheduler step


def engine(session: Session, seed: int, flow: str, deadline: float, tally: EngineTally) -> None:
    """Serves REQUESTS requests for random documents (gives up at ``deadline``)."""
    rng = random.Random(seed)
    try:
        for _ in range(REQUESTS):
            if time.monotonic() > deadline:
                return
            serve_request(session, document(rng.randrange(DOCS)), flow, tally)
            tally.requests += 1
    except BaseException as exc:  # reported by the test
        tally.errors.append(exc)


def run_storm(daemon: DaemonProcess, pool: str, flow: str) -> tuple[float, list[EngineTally]]:
    """Runs ENGINES engines (one session each, opened first) of REQUESTS requests
    each; returns the seconds the storm took and each engine's tally. Engines still
    serving at STORM_BOUND give up."""
    tallies = [EngineTally() for _ in range(ENGINES)]
    clients = [Client(daemon.address) for _ in range(ENGINES)]
    try:
        sessions = [
            client.open_session(pool, block_bytes=BLOCK, num_blocks=ROWS, layout="L")
            for client in clients
        ]
        deadline = time.monotonic() + STORM_BOUND
        threads = [
            threading.Thread(target=engine, args=(session, seed, flow, deadline, tally))
            for seed, (session, tally) in enumerate(zip(sessions, tallies, strict=True))
        ]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STORM_BOUND + 30)
        return time.monotonic() - start, tallies
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("flow", ["load", "pin"])
def test_promotion_storm_ends_and_reads_each_served_block_at_most_twice(tiered, pool_name, flow):
    with Client(tiered.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=ROWS, layout="L")
        store_documents(tiered, session, pool_name)
        seconds, tallies = run_storm(tiered, pool_name, flow)
        wait_tier_jobs(tiered.stub(), pool_name)
        primary, fs = client.get_stats(pool_name).pools[0].tiers
    errors = [exc for tally in tallies for exc in tally.errors]
    assert not errors, errors
    served = sum(tally.requests for tally in tallies)
    loaded = sum(tally.loaded for tally in tallies)
    lookups = sum(tally.lookups for tally in tallies)
    races = sum(tally.lost_races for tally in tallies)
    print(
        f"\n{flow}: {served}/{ENGINES * REQUESTS} requests in {seconds:.2f}s, {lookups} lookups, "
        f"{loaded} blocks loaded, {fs.promoted_blocks} promoted, {fs.promotion_no_room} "
        f"no room, {primary.evictions} primary evictions, {races} lost load races"
    )
    assert served == ENGINES * REQUESTS, f"storm still running after {STORM_BOUND}s (livelock)"
    assert fs.promoted_blocks <= 2 * loaded, (fs.promoted_blocks, loaded)
    assert loaded >= served * DOC_BLOCKS // 8, "the fs tier served too little: holds too strict"


# ----------------------------------------------------------------- holds, one by one


def in_fs_only(daemon: DaemonProcess, session: Session, pool: str, keys: list[bytes]) -> None:
    """Stores ``keys``, waits for their cascade, flushes them from the primary."""
    assert session.prepare_store(keys) is not None
    session.complete_store(keys)
    wait_tier_jobs(daemon.stub(), pool)
    session.client.flush_pool(pool)


def promoted(session: Session, keys: list[bytes], timeout: float = 20.0) -> None:
    """Looks ``keys`` up (plain Lookup: pins nothing) until all are HIT. Polls: a
    Lookup is how a client asks for a promotion (again, after a RETRY)."""
    results: list[LookupResult] = []

    def all_hit() -> bool:
        results[:] = session.lookup(keys)
        return results == [HIT] * len(keys)

    eventually(all_hit, timeout, lambda: f"all promoted; still {results}", interval=0.005)


def primary_stats(session: Session, pool: str):  # noqa: ANN201 - pb2.TierStats
    return session.client.get_stats(pool).pools[0].tiers[0]


def ref_count(session: Session, pool: str, key: bytes) -> int:
    return session.client.explain(pool, key).ref_count


def test_flush_leaves_a_held_block_until_a_load_claims_it(tiered, pool_name):
    with Client(tiered.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=8, layout="L")
        keys = [b"held-0", b"held-1", b"held-2"]
        in_fs_only(tiered, session, pool_name, keys)
        promoted(session, keys)
        assert primary_stats(session, pool_name).pinned_blocks == 3  # held for the asker
        assert client.flush_pool(pool_name) == 0
        assert session.lookup(keys) == [HIT] * 3
        session.prepare_load(keys)  # the load claims the holds: the session's pins remain
        assert [ref_count(session, pool_name, key) for key in keys] == [1, 1, 1]
        session.complete_load(keys)
        assert primary_stats(session, pool_name).pinned_blocks == 0
        assert client.flush_pool(pool_name) == 3


def test_a_pinning_lookup_that_still_waits_keeps_the_holds(tiered, pool_name):
    """Scenario: the vLLM plug-in pins the leading HITs of every lookup and releases
    them at the end of the step when the request cannot run yet (a later key is
    HIT_PENDING). The ready key in front stays held meanwhile, so the promotion of
    another request cannot evict it before the request runs."""
    with Client(tiered.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=8, layout="L")
        ready, pending = b"front", b"behind"
        in_fs_only(tiered, session, pool_name, [ready, pending])
        promoted(session, [ready])
        session.prepare_load([ready])  # claims the promotion's hold
        session.complete_load([ready])
        assert ref_count(session, pool_name, ready) == 0
        results, rows = session.lookup_and_pin([ready, pending], prefix=True)
        assert results == [HIT, PENDING] and rows[0] >= 0 and rows[1] == -1
        session.complete_load([ready])  # end of the step: the request still waits
        assert ref_count(session, pool_name, ready) == 1  # held while it waits
        results: list[LookupResult] = []

        def runs() -> bool:
            """One scheduler step: the request runs once both are HIT (its pins claim
            both holds); until then the step ends by releasing the front pin."""
            answer, _rows = session.lookup_and_pin([ready, pending], prefix=True)
            results[:] = answer
            if results == [HIT, HIT]:
                return True
            session.complete_load([ready])
            return False

        eventually(runs, 20, lambda: f"the request runs; still {results}", interval=0.005)
        assert [ref_count(session, pool_name, k) for k in (ready, pending)] == [1, 1]
        session.complete_load([ready, pending])
        assert primary_stats(session, pool_name).pinned_blocks == 0


def test_an_unclaimed_hold_ends_at_its_deadline(tmp_path):
    """Nobody comes back for the promoted blocks and nothing else calls into the
    pool: the daemon's timer releases the holds (GetStats and Explain change nothing)."""
    daemon = tiered_daemon(tmp_path / "fs", "300ms")
    try:
        with Client(daemon.address) as client:
            pool = "holds/deadline"
            session = client.open_session(pool, block_bytes=BLOCK, num_blocks=8, layout="L")
            keys = [b"left-0", b"left-1"]
            in_fs_only(daemon, session, pool, keys)
            promoted(session, keys)
            eventually(
                lambda: primary_stats(session, pool).pinned_blocks == 0,
                30, "the holds released by the daemon's timer",
            )  # fmt: skip
            assert [ref_count(session, pool, key) for key in keys] == [0, 0]
            assert session.lookup(keys) == [HIT, HIT]  # released, not evicted
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_a_bad_promotion_hold_stops_the_start_naming_the_key():
    result = subprocess.run(
        daemon_command("--promotion-hold=-1s", "--listen", "unix:///tmp/unused.sock"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "limits.promotion_hold" in result.stderr, result.stderr
