"""Two SGLang engines, two processes, one daemon: pages stored by one load bit-exact
in the other, in every host layout; only leading hits count; a page whose cascaded
file was corrupted is never reported loaded.

Engine A runs in the test process, engine B in ``engine_proc.py`` (its own host pool
and backend, built by SGLang's factory). Page bytes are a function of a seed and
the page, so B's pages are checked against A's by digest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, fs_tiers_config, start_daemon, wait_tier_jobs
from engine_proc import EngineProcess, digest

from benchmarks import sglang_env as env
from kvtierd.tiers import blockformat
from kvtierd.tiers.fs import fsformat
from kvtierd_client.client import Client

LAYOUTS = [("mha", layout) for layout in env.MHA_LAYOUTS] + [
    ("mla", layout) for layout in env.MLA_LAYOUTS
]


@pytest.fixture(scope="module")
def engine_b() -> Iterator[EngineProcess]:
    proc = EngineProcess()
    try:
        yield proc
    finally:
        proc.close()


def _engine_a(kind: str, layout: str, address: str, **config: object) -> tuple[object, object]:
    pool = env.mha_host_pool(layout) if kind == "mha" else env.mla_host_pool(layout)
    cfg = env.storage_config(address, mla=kind == "mla", layout=layout, **config)
    return pool, env.create_backend(cfg, pool)


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS, ids=[f"{k}-{x}" for k, x in LAYOUTS])
def test_engine_b_loads_engine_a_pages_bit_exact(daemon, engine_b, kind, layout):
    pool_a, a = _engine_a(kind, layout, daemon.address)
    keys = env.page_keys(f"share-{kind}-{layout}", 6)
    pages_a = [3, 1, 4, 15, 9, 2]
    env.fill_pages(pool_a, pages_a, seed=7)
    assert a.batch_set_v1(keys, env.token_slots(pool_a, pages_a)) == [True] * 6

    name = engine_b.call("attach", kind=kind, layout=layout, address=daemon.address)
    assert name == env.unwrap(a).statistics().pool  # same model and geometry: one pool
    assert engine_b.call("exists", keys=keys) == 6
    pages_b = [20, 21, 5, 6, 30, 11]
    got = engine_b.call("load", keys=keys, pages=pages_b)
    assert got["ok"] == [True] * 6
    assert got["digests"] == [digest(env.page_bytes(pool_a, p)) for p in pages_a]
    a.close()


def test_batch_exists_counts_leading_hits_only(daemon, engine_b):
    pool_a, a = _engine_a("mha", "page_first", daemon.address)
    keys = env.page_keys("leading", 6)
    stored = [0, 1, 3, 4]  # key 2 is missing: keys 3 and 4 are held but not leading
    env.fill_pages(pool_a, [1, 2, 3, 4, 5, 6], seed=3)
    slots = env.token_slots(pool_a, [1, 2, 4, 5])
    assert a.batch_set_v1([keys[i] for i in stored], slots) == [True] * 4
    engine_b.call("attach", kind="mha", layout="page_first", address=daemon.address)
    assert engine_b.call("exists", keys=keys) == 2
    assert engine_b.call("exists", keys=keys[3:5]) == 2
    got = engine_b.call("load", keys=keys, pages=[10, 11, 12, 13, 14, 15])
    assert got["ok"] == [True, True, False, False, False, False]
    assert got["digests"][:2] == [digest(env.page_bytes(pool_a, p)) for p in (1, 2)]
    a.close()


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Path]]:
    root = tmp_path / "fs"
    daemon = start_daemon(
        "--memory-budget", "256MiB", config=fs_tiers_config(root, create_root=True)
    )
    try:
        yield daemon, root
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_flipped_byte_in_a_cascaded_block_is_never_reported_loaded(tiered, engine_b):
    daemon, root = tiered
    pool_a, a = _engine_a("mha", "page_first", daemon.address)
    keys = env.page_keys("flip", 4)
    env.fill_pages(pool_a, [1, 2, 3, 4], seed=11)
    assert a.batch_set_v1(keys, env.token_slots(pool_a, [1, 2, 3, 4])) == [True] * 4
    pool_name = env.unwrap(a).statistics().pool
    client = Client(daemon.address)
    # A's next call carries its queued CompleteStore: the pages are ready, cascades start
    assert a.batch_exists(keys) == 4
    wait_tier_jobs(daemon.stub(), pool_name)  # every page reached the fs tier
    assert client.flush_pool(pool_name) == 4  # now only the fs tier holds them
    (victim,) = root.rglob(Path(fsformat.block_rel_path(keys[1].encode())).name)
    with open(victim, "r+b") as f:
        f.seek(blockformat.HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(blockformat.HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0x01]))

    engine_b.call("attach", kind="mha", layout="page_first", address=daemon.address)
    for _ in range(3):  # promoted, refused, gone: never loaded
        got = engine_b.call("load", keys=keys, pages=[10, 11, 12, 13])
        assert got["ok"][1:] == [False, False, False]
    assert got["ok"][0] is True
    assert got["digests"][0] == digest(env.page_bytes(pool_a, 1))
    assert engine_b.call("exists", keys=keys) == 1
    stats = client.get_stats(pool_name)
    (tier,) = [t for p in stats.pools for t in p.tiers if t.tier == "fs0"]
    assert tier.checksum_failures == 1
    client.close()
    a.close()
