"""What NVIDIA Dynamo's KV router sees of a node's pool, read from its real standalone
indexer (ai-dynamo-runtime 1.6.1) listening to the daemon's KV events.

The daemon's endpoint is registered under each engine's instance id at dp_rank 1 (a rank
the engines' own GPU events do not use), so a block in the pool counts for every engine
of the node: ``/query`` answers per instance ``(gpu, cpu, disk)`` matched tokens, which
the indexer counts cumulatively (a CPU block is a disk match too). Blocks are host (cpu)
matches while the key is in the primary tier, disk matches while it is only in the fs
tier, and gone once no tier holds them; FlushPool empties the primary only; a warm
restart clears the router's view (AllBlocksCleared) and re-announces what it adopted
when the pool opens again. Every wait is on ``/query``'s answer.
"""

from __future__ import annotations

import struct
import time

import msgpack
import pytest
import zmq
from daemon_harness import eventually, free_port
from engine_harness import FILE_BYTES, HIT
from indexer_harness import (
    BLOCK_TOKENS,
    POOL,
    PROBE_POOL,
    Prompt,
    store_described,
    wait_listening,
)

from kvtierd_client.client import Client

A, B = "1", "2"  # the engines' instance ids at the indexer


def both(gpu: int, cpu: int, disk: int) -> dict[str, tuple[int, int, int]]:
    return {A: (gpu, cpu, disk), B: (gpu, cpu, disk)}


def test_blocks_one_engine_stores_are_host_matches_for_every_engine_of_the_pool(stack):
    """Registered with --workers as the guide says: A's store is a cpu (and so disk)
    match of the whole prompt for A and for B; a prompt that shares only A's first
    key matches that far; a prompt nobody stored matches nowhere."""
    s = stack(workers="1:1={pub},2:1={pub}")
    a, _b = s.engine(), s.engine()
    wait_listening(s.indexer, s.engine(PROBE_POOL), instances=(A, B))
    prompt = Prompt(keys=3)
    store_described(a, prompt)
    n = prompt.tokens_matched
    s.indexer.wait_tiers(prompt.token_ids, both(0, n, n))

    first_key = prompt.per_key * BLOCK_TOKENS
    diverging = prompt.token_ids[:first_key] + [7] * (n - first_key)
    assert s.indexer.tiers(diverging) == both(0, first_key, first_key)
    assert s.indexer.tiers(Prompt(keys=3).token_ids) == {}


def test_blocks_left_only_in_the_fs_tier_are_disk_matches_until_it_evicts_them(stack):
    """A primary of 4 rows and an fs tier of 1 MiB (15 block files, the probes' too): A
    stores X (4 keys); B's store of Y (4 keys) evicts X from the primary: X is a disk
    match only, for both engines. B's store of Z (4 at a time), 4 files more than the fs
    tier has room for, makes it drop the pool's least recently used files, X's: X is
    gone from the router's view, Y is disk only, and so is Z's prefix (its first keys
    left the primary on the way)."""
    s = stack(fs_capacity="1MiB")
    files = (1 << 20) // FILE_BYTES
    a = s.engine(num_blocks=4)
    b = s.engine(num_blocks=4)
    probe = s.engine(PROBE_POOL)
    wait_listening(s.indexer, probe, instances=(A, B))
    probe.settle_cascades()
    x, y = Prompt(keys=4, per_key=1), Prompt(keys=4, per_key=1)

    store_described(a, x)
    a.settle_cascades()
    s.indexer.wait_tiers(x.token_ids, both(0, x.tokens_matched, x.tokens_matched))

    store_described(b, y)  # the primary's 4 rows: X goes, its files stay
    b.settle_cascades()
    s.indexer.wait_tiers(x.token_ids, both(0, 0, x.tokens_matched))
    s.indexer.wait_tiers(y.token_ids, both(0, y.tokens_matched, y.tokens_matched))

    room = files - b.tier_stats().used_blocks - probe.tier_stats().used_blocks
    assert room >= 1
    z = Prompt(keys=room + 4, per_key=1)
    store_described(b, z, at_a_time=4)  # 4 files too many: the fs tier drops X's
    b.settle_cascades()
    s.indexer.wait_tiers(x.token_ids, {})
    s.indexer.wait_tiers(y.token_ids, both(0, 0, y.tokens_matched))
    s.indexer.wait_tiers(z.token_ids, both(0, 0, z.tokens_matched))
    assert b.tier_stats().evictions == 4


@pytest.mark.parametrize("fs", [True, False], ids=["fs-tier", "primary-only"])
def test_flush_pool_takes_the_host_matches_and_leaves_the_fs_copies(stack, fs):
    """FlushPool evicts the primary's blocks and keeps the secondary tiers' copies:
    with an fs tier the prompt stays a disk match for both engines; without one the
    router sees nothing of it any more."""
    s = stack(fs=fs)
    a, _b = s.engine(), s.engine()
    wait_listening(s.indexer, s.engine(PROBE_POOL), instances=(A, B))
    prompt = Prompt(keys=4)
    store_described(a, prompt)
    a.settle_cascades()
    n = prompt.tokens_matched
    s.indexer.wait_tiers(prompt.token_ids, both(0, n, n))

    with Client(s.daemon.address) as client:
        assert client.flush_pool(POOL) == prompt.keys
    s.indexer.wait_tiers(prompt.token_ids, both(0, 0, n) if fs else {})


def test_warm_restart_clears_the_view_then_re_announces_the_adopted_blocks(stack):
    """memory.warm_restart: stop and start the daemon. Once the indexer hears the new
    process (a probe in another pool), the prompt is gone from its view: the daemon
    said AllBlocksCleared first. When an engine opens the pool again, the daemon
    adopts the region and re-announces the prompt: cpu matches for both engines."""
    s = stack(warm_restart=True)
    a, _b = s.engine(), s.engine()
    wait_listening(s.indexer, s.engine(PROBE_POOL), instances=(A, B))
    prompt = Prompt(keys=4)
    store_described(a, prompt)
    a.settle_cascades()
    n = prompt.tokens_matched
    s.indexer.wait_tiers(prompt.token_ids, both(0, n, n))

    s.close_engines()
    assert s.daemon.stop() == 0
    s.daemon = s.daemon.restart()
    wait_listening(s.indexer, s.engine(PROBE_POOL), instances=(A, B))
    assert s.indexer.tiers(prompt.token_ids) == {}  # cleared, the pool not yet open

    again = s.engine()
    assert again.session.lookup(prompt.daemon_keys()) == [HIT] * prompt.keys  # adopted
    s.indexer.wait_tiers(prompt.token_ids, both(0, n, n))


def test_the_engines_gpu_events_and_the_pool_add_up_per_instance(stack):
    """The deploy/kv-events files as shipped (the daemon's config, dynamo-indexer.sh):
    engine A publishes its own GPU events at dp_rank 0 (a PUB here, as vLLM would), B
    none, the daemon at dp_rank 1 of both instances: A's GPU prefix is a gpu match for
    A only, the pool's blocks cpu matches for both."""
    engine_a_pub = f"tcp://127.0.0.1:{free_port()}"
    s = stack(shipped_engines=f"1={engine_a_pub} 2")
    a, _b = s.engine(), s.engine()
    wait_listening(s.indexer, s.engine(PROBE_POOL), instances=(A, B))
    prompt = Prompt(keys=4, per_key=1)
    store_described(a, prompt)
    n, gpu = prompt.tokens_matched, 2 * BLOCK_TOKENS

    context = zmq.Context()
    gpu_pub = context.socket(zmq.PUB)
    gpu_pub.setsockopt(zmq.LINGER, 0)
    gpu_pub.bind(engine_a_pub)
    seq = iter(range(1 << 62))
    hashes = prompt.block_hashes

    def publish_gpu_blocks() -> bool:
        event = {
            "type": "BlockStored", "block_hashes": hashes[:2], "parent_block_hash": None,
            "token_ids": prompt.token_ids[:gpu], "block_size": BLOCK_TOKENS, "lora_id": None,
            "medium": "GPU",
        }  # fmt: skip
        payload = msgpack.packb([time.time(), [event], None])
        gpu_pub.send_multipart([b"", struct.pack(">Q", next(seq)), payload])
        return s.indexer.tiers(prompt.token_ids).get(A, (0, 0, 0))[0] == gpu

    try:
        # the subscriber joins a moment after the bind: publish until it has heard
        eventually(publish_gpu_blocks, 30, "engine A's GPU events heard", interval=0.2)
        s.indexer.wait_tiers(prompt.token_ids, {A: (gpu, n, n), B: (0, n, n)})
        assert s.indexer.query(prompt.token_ids)[A]["dp"] == {"0": gpu, "1": 0}
    finally:
        gpu_pub.close()
        context.term()
