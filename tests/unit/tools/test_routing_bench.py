"""The routing benchmark's parts (`make bench-routing`, benchmarks/routing*.py).

Scenario: the benchmark's figures mean what docs/benchmarks/routing.md says only if its
engines hash and evict as vLLM does, its routers choose as described, and its view
counts precision and recall right. Each part is checked here without daemons; the whole
run (real daemons, Redis Cluster and Dynamo indexer) is tests/dynamo/test_routing_bench.py.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from pathlib import Path

import msgpack
import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.routing import check  # noqa: E402
from benchmarks.routing_blocks import NONE_HASH, ChainMaker, block_tokens, payload  # noqa: E402
from benchmarks.routing_engine import GpuPrefixCache  # noqa: E402
from benchmarks.routing_indexer import Holding  # noqa: E402
from benchmarks.routing_policies import Conversation, KvAware, KvWeights, RoundRobin  # noqa: E402
from benchmarks.routing_publisher import block_removed, block_stored  # noqa: E402
from benchmarks.routing_relay import storage_only  # noqa: E402
from benchmarks.routing_view import Placement, Truth, View, loadable  # noqa: E402
from kvtierd.kvevents import wireformat  # noqa: E402

BS = 4


# -- blocks as vLLM makes them -------------------------------------------------------------


def test_chain_hashes_are_vllms_chained_sha256_and_keys_carry_the_group() -> None:
    chain = ChainMaker(BS).chain([7, 8, 9])
    parent = NONE_HASH
    for index, hash_id in enumerate((7, 8, 9)):
        tokens = block_tokens(hash_id, BS)
        expected = hashlib.sha256(pickle.dumps((parent, tokens, None), protocol=5)).digest()
        assert chain.hashes[index] == expected
        assert chain.ints[index] == int.from_bytes(expected[-8:], "big")
        assert chain.keys[index] == expected + b"\x00\x00\x00\x00"
        parent = expected
    # the same block after another parent is another block
    assert ChainMaker(BS).chain([5, 8]).hashes[1] != chain.hashes[1]


def test_tokens_are_deterministic_distinct_and_in_range() -> None:
    assert block_tokens(42, 16) == block_tokens(42, 16)
    assert block_tokens(42, 16) != block_tokens(43, 16)
    assert len(block_tokens(1, 40)) == 40
    assert all(0 <= t < 1 << 16 for t in block_tokens(1, 40))


def test_description_is_the_block_as_vllm_publishes_it() -> None:
    chain = ChainMaker(BS).chain([1, 2])
    first, second = chain.description(0), chain.description(1)
    assert first.parent_block_hash is None
    assert second.parent_block_hash == chain.ints[0]
    assert second.block_hashes == (chain.ints[1],)
    assert second.token_ids == chain.tokens[1]
    assert second.block_size == BS
    assert chain.flat_tokens() == list(chain.tokens[0] + chain.tokens[1])


def test_payload_differs_per_key() -> None:
    chain = ChainMaker(BS).chain([1, 2])
    assert payload(chain.keys[0], 100) != payload(chain.keys[1], 100)
    assert len(payload(chain.keys[0], 4096)) == 4096


# -- the GPU prefix cache ------------------------------------------------------------------


def test_gpu_cache_evicts_least_recently_freed_tail_first() -> None:
    maker = ChainMaker(BS)
    cache = GpuPrefixCache(4)
    a = maker.chain([1, 2, 3])
    assert cache.admit(a, 0) == []
    assert cache.prefix(a) == 3
    b = maker.chain([10, 11])
    evicted = cache.admit(b, 0)
    assert evicted == [a.ints[2]]  # the tail of the older request goes first
    assert cache.prefix(a) == 2
    assert cache.prefix(b) == 2


def test_gpu_cache_keeps_the_blocks_a_request_hits() -> None:
    maker = ChainMaker(BS)
    cache = GpuPrefixCache(4)
    a = maker.chain([1, 2])
    cache.admit(a, 0)
    cache.admit(maker.chain([5, 6]), 0)  # now 5 and 6 are more recent than a
    longer = maker.chain([1, 2, 3, 4])
    evicted = cache.admit(longer, cache.prefix(longer))  # needs 2 new: 5 and 6 go
    assert sorted(evicted) == sorted(maker.chain([5, 6]).ints)
    assert cache.prefix(longer) == 4


def test_gpu_cache_refuses_a_request_longer_than_itself() -> None:
    with pytest.raises(ValueError, match="--gpu-blocks"):
        GpuPrefixCache(2).admit(ChainMaker(BS).chain([1, 2, 3]), 0)


def test_gpu_events_have_the_fields_of_the_daemons_events() -> None:
    """The engines' GPU events and the daemon's CPU/STORAGE events reach one indexer:
    the same map fields, so a router decodes both alike."""
    daemon_stored = wireformat.block_stored([1], None, [0] * BS, BS, "CPU", "", 0)
    assert block_stored([1], None, [0] * BS, BS).keys() == daemon_stored.keys()
    assert block_removed([1]).keys() == wireformat.block_removed([1], "CPU", 0).keys()
    assert block_stored([1], None, [0] * BS, BS)["medium"] == "GPU"
    msgpack.packb(block_stored([1 << 63], None, [0] * BS, BS))  # ints, not bytes


# -- routers --------------------------------------------------------------------------------


def test_round_robin_and_conversation() -> None:
    maker = ChainMaker(BS)
    rr = RoundRobin(3)
    assert [rr.route(maker.chain([i])) for i in range(4)] == [0, 1, 2, 0]
    conv = Conversation(6)
    assert conv.route(maker.chain([1, 2])) == conv.route(maker.chain([1, 3, 4]))


def test_kv_aware_prefers_the_gpu_holder_then_the_host_holder() -> None:
    maker = ChainMaker(BS)
    chain = maker.chain(list(range(10)))
    answer = {2: Holding(gpu=10, cpu=10, disk=10), 1: Holding(gpu=0, cpu=10, disk=10)}
    assert KvAware(6, lambda _tokens: answer).route(chain) == 1  # instance 2 = engine 1
    answer = {1: Holding(gpu=0, cpu=10, disk=10), 5: Holding(gpu=0, cpu=0, disk=10)}
    assert KvAware(6, lambda _tokens: answer).route(chain) == 0


def test_kv_aware_load_term_spreads_requests_nobody_holds() -> None:
    maker = ChainMaker(BS)
    router = KvAware(3, lambda _tokens: {}, KvWeights(window=6))
    assert [router.route(maker.chain([i])) for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_kv_aware_load_term_overrides_a_small_hit() -> None:
    maker = ChainMaker(BS)
    held = {1: Holding(gpu=1, cpu=1, disk=1)}
    router = KvAware(2, lambda _tokens: held, KvWeights(load_weight=1.0, window=4))
    engines = [router.route(maker.chain(list(range(10)))) for _ in range(3)]
    assert engines[0] == 0 and 1 in engines  # engine 0 holds one block, but is busy


# -- the view ------------------------------------------------------------------------------


def test_loadable_counts_gpu_then_pool_prefixes() -> None:
    chain = ChainMaker(BS).chain([1, 2, 3, 4])
    gpu = {chain.hashes[0]}
    pool = [Placement(False, False), Placement(True, True), Placement(False, True)]
    assert loadable(chain, gpu, pool) == Truth(gpu=1, local=2, all=3)
    assert loadable(chain, set(), pool) == Truth(gpu=0, local=0, all=0)


def test_view_precision_and_recall() -> None:
    view = View()
    # engine 0: claimed 4, loadable 2 (over-credited); engine 1: claimed 1, loadable 3
    view.add({1: Holding(4, 4, 4), 2: Holding(1, 1, 1)}, [Truth(2, 2, 2), Truth(3, 3, 3)])
    assert view.precision == pytest.approx(3 / 5)
    assert view.recall == pytest.approx(3 / 5)
    view.add({}, [Truth(0, 0, 0), Truth(0, 0, 5)])  # nothing claimed, 5 missed
    assert view.recall == pytest.approx(3 / 10)
    assert view.depths["gpu"].recall == pytest.approx(3 / 5)


def test_acceptance_check_names_what_is_missed() -> None:
    def policy(rate: float, gpu: float, cpu: float, load: float) -> dict[str, object]:
        tiers = {"gpu": gpu, "cpu": cpu, "storage": rate - gpu - cpu}
        return {"hit_rate": rate, "hit_rate_by_tier": tiers, "load_max_over_mean": load}

    data = {
        "policies": {
            "round_robin": policy(0.3, 0.01, 0.06, 1.0),
            "conversation": policy(0.33, 0.11, 0.09, 1.07),
            "kv_aware": policy(0.33, 0.10, 0.11, 1.0),
        },
        "view": {"precision": 1.0, "recall": 0.99},
        "wrong_bytes": 0,
    }
    assert check(data) == []
    data["policies"]["kv_aware"] = policy(0.33, 0.05, 0.03, 1.3)  # type: ignore[index]
    data["wrong_bytes"] = 1
    missed = check(data)
    assert "kv_aware's GPU + CPU hit rate is below 1.2x round_robin's" in missed
    assert "kv_aware's load_max_over_mean is above 1.2" in missed
    assert "some loaded blocks had wrong bytes" in missed


# -- the shared tier's relay ---------------------------------------------------------------


def test_relay_keeps_storage_events_and_clears_only() -> None:
    events = [
        wireformat.block_stored([1], None, [0] * BS, BS, "CPU", "", 0),
        wireformat.block_stored([1], None, [0] * BS, BS, "STORAGE", "", 0),
        wireformat.block_removed([1], "CPU", 0),
        wireformat.block_removed([1], "STORAGE", 0),
        {"type": "AllBlocksCleared"},
    ]
    kept = storage_only(events)
    assert [e["type"] for e in kept] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert all(e.get("medium", "STORAGE") == "STORAGE" for e in kept)
