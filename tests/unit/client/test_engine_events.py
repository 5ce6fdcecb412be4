"""The block index a plug-in fills from its engine's KV events
(``kvtierd_client.engine_events.BlockIndex``): chains, bounds, what it refuses."""

from __future__ import annotations

import pytest

from kvtierd_client.engine_events import (
    ENTRY_OVERHEAD_BYTES,
    BlockIndex,
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
