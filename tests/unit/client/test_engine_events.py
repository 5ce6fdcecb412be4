"""The block index a plug-in fills from its engine's KV events
(``kvtierd_client.engine_events.BlockIndex``): chains, bounds, what it refuses; the
loaded keys described late (``LateDescriptions``): once, bounded, never a busy key."""

from __future__ import annotations

import pytest

from kvtierd_client.engine_events import (
    ENTRY_OVERHEAD_BYTES,
    BlockIndex,
    DescribeCounters,
    Describer,
    LateDescriptions,
    StoredBlocks,
    local_endpoint,
)
from kvtierd_client.types import BlockDescription

SIZE = 4


def tokens(first: int, blocks: int = 1) -> list[int]:
    return list(range(first, first + SIZE * blocks))


def test_a_key_of_several_blocks_is_described_by_walking_parents_across_events():
    index = BlockIndex(1 << 20)
    assert index.add(StoredBlocks([11, 12], None, tokens(0, 2), SIZE)) == 2
    assert index.add(StoredBlocks([13], 12, tokens(8), SIZE)) == 1
    assert index.describe(13, 2, SIZE, group_idx=3) == BlockDescription(
        block_hashes=(12, 13),
        parent_block_hash=11,
        token_ids=tuple(tokens(4, 2)),
        block_size=SIZE,
        group_idx=3,
    )
    assert index.describe(11, 1, SIZE).parent_block_hash is None  # a prompt's first
    assert index.describe(13, 4, SIZE) is None  # only three blocks are known
    assert index.describe(13, 1, SIZE * 2) is None  # another block size


def test_signed_hashes_are_taken_modulo_2_64():
    """SGLang publishes signed 64-bit hashes; descriptions carry unsigned ones."""
    index = BlockIndex(1 << 20)
    index.add(StoredBlocks([-2], -1, tokens(0), SIZE))
    described = index.describe((1 << 64) - 2, 1, SIZE)
    assert described is not None
    assert (described.block_hashes, described.parent_block_hash) == (
        ((1 << 64) - 2,),
        (1 << 64) - 1,
    )


def test_the_index_stays_within_its_bytes_and_forgets_the_least_recently_used():
    cost = ENTRY_OVERHEAD_BYTES + 4 * SIZE
    index = BlockIndex(3 * cost)
    for h in (1, 2, 3):
        index.add(StoredBlocks([h], None, tokens(h), SIZE))
    assert index.describe(1, 1, SIZE) is not None  # 1 is now the most recent
    index.add(StoredBlocks([4], None, tokens(4), SIZE))
    stats = index.statistics()
    assert (stats.blocks, stats.bytes, stats.forgotten) == (3, 3 * cost, 1)
    assert index.describe(2, 1, SIZE) is None  # the least recently used went
    assert all(index.describe(h, 1, SIZE) for h in (1, 3, 4))


def test_events_whose_tokens_do_not_fit_are_skipped():
    index = BlockIndex(1 << 20)
    assert index.add(StoredBlocks([1, 2], None, tokens(0), SIZE)) == 0  # one block of tokens
    assert index.add(StoredBlocks([3], None, [1 << 32, 0, 0, 0], SIZE)) == 0  # not 32-bit
    assert index.add(StoredBlocks([4], None, [(1, 2)] * SIZE, SIZE)) == 0  # bigram pages
    assert index.statistics().skipped == 3
    assert index.statistics().blocks == 0


def test_a_keyed_block_and_every_block_after_it_are_never_described():
    """A block whose hash covers more than its tokens (an image, a cache salt): a
    router hashing the tokens of it, or of any block after it, would credit
    another prompt."""
    index = BlockIndex(1 << 20)
    index.add(StoredBlocks([1, 2, 3], None, tokens(0, 3), SIZE, keyed=[False, True, False]))
    index.add(StoredBlocks([4], 3, tokens(12), SIZE))
    assert index.describe(1, 1, SIZE) is not None
    assert [index.describe(h, 1, SIZE) for h in (2, 3, 4)] == [None, None, None]


def test_blocks_of_two_lora_adapters_make_no_description():
    index = BlockIndex(1 << 20)
    index.add(StoredBlocks([1], None, tokens(0), SIZE, lora_name="a"))
    index.add(StoredBlocks([2], 1, tokens(4), SIZE, lora_name="b"))
    assert index.describe(2, 1, SIZE).lora_name == "b"
    assert index.describe(2, 2, SIZE) is None


@pytest.mark.parametrize(
    ("configured", "offset", "connect"),
    [
        ("tcp://*:5557", 0, "tcp://127.0.0.1:5557"),
        ("tcp://*:5557", 2, "tcp://127.0.0.1:5559"),
        ("tcp://10.0.0.5:6000", 1, "tcp://10.0.0.5:6001"),
        ("tcp://[::]:5557", 0, "tcp://[::1]:5557"),
        ("ipc:///run/vllm/events", 0, "ipc:///run/vllm/events"),
    ],
)
def test_the_endpoint_a_plugin_connects_to(configured, offset, connect):
    assert local_endpoint(configured, offset) == connect


def test_an_endpoint_that_is_not_tcp_or_ipc_is_refused():
    with pytest.raises(ValueError, match="tcp://HOST:PORT or ipc://PATH"):
        local_endpoint("inproc://x")


def late(index: BlockIndex, **bounds: int) -> LateDescriptions:
    """Keys ``b"k<hash>"`` of one block each, described from ``index``."""
    return LateDescriptions(
        lambda key: index.describe(int(key[1:]), 1, SIZE), DescribeCounters(), **bounds
    )


def test_a_loaded_key_is_taken_once_its_blocks_event_arrives_and_never_again():
    index = BlockIndex(1 << 20)
    loads = late(index)
    loads.loaded([b"k11", b"k12"])
    assert loads.take() == ([], [])  # the engine has not published them yet
    index.add(StoredBlocks([11, 12], None, tokens(0, 2), SIZE))
    keys, descriptions = loads.take()
    assert keys == [b"k11", b"k12"]
    assert [d.token_ids for d in descriptions] == [tuple(tokens(0)), tuple(tokens(4))]
    loads.loaded([b"k11", b"k12"])  # loaded again: described already
    assert (loads.waiting, loads.take(), loads.counters.described_late) == (0, ([], []), 2)


def test_keys_the_engine_stored_with_a_description_are_not_described_again_when_loaded():
    index = BlockIndex(1 << 20)
    index.add(StoredBlocks([11], None, tokens(0), SIZE))
    describer = Describer(index, None, lambda key: (int(key[1:]), 0), blocks=1, block_size=SIZE)
    assert describer.describe([b"k11", b"k12"]) is not None  # k12 undescribed
    describer.late.loaded([b"k11", b"k12"])
    assert describer.late.waiting == 1
    index.add(StoredBlocks([12], 11, tokens(4), SIZE))
    assert describer.late.take()[0] == [b"k12"]


def test_a_busy_key_waits_and_keys_undescribed_for_patience_steps_are_given_up():
    index = BlockIndex(1 << 20)
    loads = late(index, patience=2)
    index.add(StoredBlocks([11], None, tokens(0), SIZE))
    loads.loaded([b"k11", b"k99"])
    assert loads.take(busy={b"k11"}) == ([], [])  # reserved by the engine: not completed
    assert loads.take()[0] == [b"k11"]
    assert loads.take() == ([], [])
    assert (loads.waiting, loads.counters.undescribed_loads) == (0, 1)


def test_waiting_and_described_keys_are_bounded():
    index = BlockIndex(1 << 20)
    loads = late(index, max_waiting=2, max_described=2)
    loads.loaded([b"k1", b"k2", b"k3"])
    assert (loads.waiting, loads.counters.undescribed_loads) == (2, 1)  # k1 gave way
    index.add(StoredBlocks([1, 2, 3], None, tokens(0, 3), SIZE))
    assert loads.take()[0] == [b"k2", b"k3"]
    loads.described([b"k4"])  # k2, the first described, is forgotten
    loads.loaded([b"k2", b"k3", b"k4"])
    assert loads.take()[0] == [b"k2"]
