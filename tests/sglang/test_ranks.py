"""Tensor-parallel ranks: MHA ranks keep their own pools (rank 1 never loads rank 0's
heads); MLA ranks share one pool, only SGLang's storage writer stores, every rank
(of any TP width) loads.
"""

from __future__ import annotations

from benchmarks import sglang_env as env
from kvtierd_client.client import Client


def _rank(address: str, kind: str, rank: int, size: int, layout: str = "page_first"):
    pool = env.mha_host_pool(layout) if kind == "mha" else env.mla_host_pool(layout)
    cfg = env.storage_config(address, tp_rank=rank, tp_size=size, mla=kind == "mla", layout=layout)
    return pool, env.create_backend(cfg, pool)


def test_mha_ranks_have_their_own_pools(daemon):
    (pool0, r0), (pool1, r1) = (_rank(daemon.address, "mha", r, 2) for r in (0, 1))
    name0, name1 = (env.unwrap(b).statistics().pool for b in (r0, r1))
    assert name0.split("/")[-2:-1] == ["tp0of2"] and name1.split("/")[-2:-1] == ["tp1of2"]
    keys = env.page_keys("tp-mha", 4)
    env.fill_pages(pool0, [1, 2, 3, 4], seed=100)  # rank 0's heads
    env.fill_pages(pool1, [1, 2, 3, 4], seed=101)  # rank 1's heads: other bytes
    assert r0.batch_set_v1(keys[:3], env.token_slots(pool0, [1, 2, 3])) == [True] * 3
    # rank 1 never sees rank 0's pages, though the keys (the prefix hashes) are the same
    assert r1.batch_exists(keys) == 0
    assert r1.batch_get_v1(keys, env.token_slots(pool1, [5, 6, 7, 8])) == [False] * 4
    assert r1.batch_set_v1(keys, env.token_slots(pool1, [1, 2, 3, 4])) == [True] * 4
    expected = [env.page_bytes(pool0, p) for p in (1, 2, 3)]
    assert r0.batch_get_v1(keys, env.token_slots(pool0, [9, 10, 11, 12])) == [True] * 3 + [False]
    assert [env.page_bytes(pool0, p) for p in (9, 10, 11)] == expected
    assert r1.batch_get_v1(keys, env.token_slots(pool1, [9, 10, 11, 12])) == [True] * 4
    assert [env.page_bytes(pool1, p) for p in (9, 10, 11, 12)] == [
        env.page_bytes(pool1, p) for p in (1, 2, 3, 4)
    ]
    for b in (r0, r1):
        b.close()


def test_mla_ranks_share_one_pool_and_one_writer(daemon):
    (pool0, r0), (pool1, r1) = (_rank(daemon.address, "mla", r, 2) for r in (0, 1))
    name = env.unwrap(r0).statistics().pool
    assert env.unwrap(r1).statistics().pool == name and name.split("/")[-2] == "mla"
    client = Client(daemon.address)

    def used() -> int:
        return client.get_stats(name).pools[0].tiers[0].used_blocks

    keys = env.page_keys("tp-mla", 3)
    env.fill_pages(pool1, [1, 2, 3], seed=5)
    # rank 1 is not the storage writer: it answers True (the writer stores) and stores nothing
    assert r1.batch_set_v1(keys, env.token_slots(pool1, [1, 2, 3])) == [True] * 3
    assert used() == 0 and r1.batch_exists(keys) == 0
    env.fill_pages(pool0, [1, 2, 3], seed=6)
    assert r0.batch_set_v1(keys, env.token_slots(pool0, [1, 2, 3])) == [True] * 3
    assert used() == 3
    assert r1.batch_get_v1(keys, env.token_slots(pool1, [7, 8, 9])) == [True] * 3
    assert [env.page_bytes(pool1, p) for p in (7, 8, 9)] == [
        env.page_bytes(pool0, p) for p in (1, 2, 3)
    ]
    # an engine of another TP width loads the same (replicated) pages
    pool_tp1, tp1 = _rank(daemon.address, "mla", 0, 1)
    assert env.unwrap(tp1).statistics().pool == name
    assert tp1.batch_get_v1(keys, env.token_slots(pool_tp1, [4, 5, 6])) == [True] * 3
    assert env.page_bytes(pool_tp1, 6) == env.page_bytes(pool0, 3)
    for b in (r0, r1, tp1):
        b.close()
    client.close()


def test_clear_flushes_the_ranks_pool_and_get_stats_reports_batches(daemon):
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer, PoolTransferResult

    pool = env.mha_host_pool("page_first")
    config = env.storage_config(daemon.address, model="test-org/clear", metrics=True)
    backend = env.create_backend(config, pool)
    keys = env.page_keys("clear", 3)
    env.fill_pages(pool, [1, 2, 3], seed=8)
    assert backend.batch_set_v1(keys, env.token_slots(pool, [1, 2, 3])) == [True] * 3
    assert backend.batch_get_v1(keys, env.token_slots(pool, [4, 5, 6])) == [True] * 3
    metrics = backend.get_stats()
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [3]
    assert len(metrics.prefetch_bandwidth) == 1 and metrics.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # drained
    backend.clear()  # FlushPool of this rank's pool: its ready pages leave the daemon
    assert backend.batch_exists(keys) == 0
    # SGLang's v2 (hybrid) calls are answered as misses, never raised
    assert backend.batch_exists_v2(keys) == PoolTransferResult.empty()
    transfer = PoolTransfer(name="kv", keys=keys)
    assert backend.batch_get_v2([transfer]) == {"kv": [False] * 3}
    backend.close()
