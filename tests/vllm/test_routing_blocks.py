"""The routing benchmark's simulated engines hash and publish as vLLM does (`make test-vllm`).

Scenario: `make bench-routing` simulates vLLM engines without a model
(benchmarks/routing_blocks.py, routing_publisher.py). Its figures hold for vLLM only if
the simulation's block hashes are vLLM's own (``hash_block_tokens`` with its ``sha256``,
the int a router reads being ``maybe_convert_block_hash``'s) and its GPU events decode as
vLLM's own ``BlockStored`` / ``BlockRemoved`` encode. Checked against vLLM's functions and
event classes, without an engine.
"""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens

from benchmarks.routing_blocks import NONE_HASH, ChainMaker
from benchmarks.routing_publisher import block_removed, block_stored

BLOCK_SIZE = 16


def test_chain_hashes_are_vllms() -> None:
    chain = ChainMaker(BLOCK_SIZE).chain([3, 1, 4, 1, 5])
    parent = NONE_HASH
    for index, tokens in enumerate(chain.tokens):
        expected = hash_block_tokens(sha256, parent, tokens)
        assert chain.hashes[index] == expected
        assert chain.ints[index] == int.from_bytes(expected, "big") & ((1 << 64) - 1)
        parent = expected


def test_gpu_events_decode_as_vllms_own() -> None:
    chain = ChainMaker(BLOCK_SIZE).chain([7, 8])
    tokens = list(chain.tokens[0] + chain.tokens[1])
    theirs = BlockStored(
        block_hashes=list(chain.ints),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    encoded = msgspec.msgpack.decode(msgspec.msgpack.encode(theirs))
    ours = block_stored(chain.ints, None, tokens, BLOCK_SIZE)
    assert {key: ours[key] for key in encoded} == encoded
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(ours), type=BlockStored)
    assert decoded.block_hashes == list(chain.ints)
    assert decoded.token_ids == tokens
    assert decoded.medium == "GPU"

    gone = msgspec.msgpack.decode(
        msgspec.msgpack.encode(block_removed(chain.ints)), type=BlockRemoved
    )
    assert gone.block_hashes == list(chain.ints)
    assert gone.medium == "GPU"
