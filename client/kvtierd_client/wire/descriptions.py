"""What a KV-event router needs to credit a stored block: the engine's 64-bit block
hashes, the parent hash, the token ids and the block size (the fields of vLLM's
``BlockStored``). An engine hands one per key to ``Session.complete_store(...,
descriptions=)``; the daemon keeps it while the key is in a tier and publishes it
with the key's stores and removals (docs/design/kv-events.md).

Bounds (checked here, before anything is sent, and again by the daemon):
at most :data:`MAX_BLOCKS_PER_KEY` hashes and :data:`MAX_TOKENS_PER_KEY` tokens a
key, every hash and token id an unsigned 64- / 32-bit integer, and exactly
``block_size x len(block_hashes)`` tokens.

Nothing here does I/O or imports gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_BLOCKS_PER_KEY",
    "MAX_TOKENS_PER_KEY",
    "BlockDescription",
    "description_problem",
    "hash64",
    "range_problem",
    "shape_problem",
]

MAX_BLOCKS_PER_KEY = 64
MAX_TOKENS_PER_KEY = 8192
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


def hash64(block_hash: bytes) -> int:
    """The 64-bit int routers receive for an engine's block hash: its low 64 bits,
    big-endian (vLLM's ``maybe_convert_block_hash``; a short hash is taken whole)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockDescription:
    """One key's blocks as its engine hashes them.

    ``block_hashes``: the engine's 64-bit hashes of the key's blocks, in prefix
    order (a vLLM chunk of several blocks has several); ``parent_block_hash``: the
    hash of the block before the first (None for a prompt's first block);
    ``token_ids``: the blocks' tokens, ``block_size`` each."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str = ""
    group_idx: int = 0


def description_problem(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
) -> str | None:
    """What is wrong with a description (one sentence saying what to fix), or None."""
    return shape_problem(len(block_hashes), len(token_ids), block_size) or range_problem(
        block_hashes, parent_block_hash, token_ids
    )


def shape_problem(hashes: int, tokens: int, block_size: int) -> str | None:
    """The counts' problem, or None: all the daemon checks of a decoded message, whose
    field types already bound every value."""
    if not hashes:
        return "has no block_hashes"
    if hashes > MAX_BLOCKS_PER_KEY:
        return f"has {hashes} block_hashes; at most {MAX_BLOCKS_PER_KEY} a key"
    if not 1 <= block_size <= MAX_TOKENS_PER_KEY:
        return f"has block_size {block_size}; give 1 to {MAX_TOKENS_PER_KEY} tokens"
    if tokens != block_size * hashes:
        return f"has {tokens} token_ids; block_size x block_hashes is {block_size * hashes}"
    if tokens > MAX_TOKENS_PER_KEY:
        return f"has {tokens} token_ids; at most {MAX_TOKENS_PER_KEY} a key"
    return None


def range_problem(
    block_hashes: Sequence[int], parent_block_hash: int | None, token_ids: Sequence[int]
) -> str | None:
    """A value outside its wire type's range, or None."""
    if any(not 0 <= h <= _U64 for h in block_hashes):
        return "has a block hash outside 0 .. 2**64-1"
    if parent_block_hash is not None and not 0 <= parent_block_hash <= _U64:
        return "has a parent_block_hash outside 0 .. 2**64-1"
    if token_ids and not 0 <= min(token_ids) <= max(token_ids) <= _U32:
        return "has a token id outside 0 .. 2**32-1"
    return None
