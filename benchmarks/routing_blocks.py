"""The routing benchmark's blocks as a vLLM engine would see them (pure, no I/O).

A Mooncake trace names a request's blocks by hash ids, one id per block, each id
standing for its whole prefix. The simulated engines need what vLLM has instead:

* token ids: :func:`block_tokens` makes ``block_size`` of them from a hash id,
  deterministically (a SHA-256 stream; two ids share no block of tokens but by a
  2**-256 accident), so the indexer, which hashes tokens itself, sees distinct blocks;
* block hashes: vLLM's chained hash, SHA-256 of the pickled ``(parent hash, token
  tuple, extra keys)``, the first block's parent a fixed seed (vLLM's ``NONE_HASH``);
  the int routers read is the low 64 bits (:func:`kvtierd_client.types.hash64`);
* kvtierd keys: the hash bytes and the KV-cache group index as 4 bytes big-endian
  (the vLLM plug-in's key shape); one block a key;
* a block's bytes: :func:`payload`, a pattern of its key, so a load that returns
  another key's row is caught.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

from kvtierd_client.types import BlockDescription, hash64

NONE_HASH = hashlib.sha256(b"kvtierd routing benchmark").digest()
"""The first block's parent hash (vLLM seeds it from PYTHONHASHSEED or at random)."""
VOCAB = 1 << 16  # token ids are 16-bit: any real tokenizer's range
GROUP_IDX = 0


def block_tokens(hash_id: int, block_size: int) -> tuple[int, ...]:
    """``block_size`` token ids in ``[0, VOCAB)`` made from ``hash_id`` alone."""
    out: list[int] = []
    counter = 0
    while len(out) < block_size:
        digest = hashlib.sha256(f"{hash_id}/{counter}".encode()).digest()
        out.extend(int.from_bytes(digest[i : i + 2], "big") for i in range(0, 32, 2))
        counter += 1
    return tuple(out[:block_size])


def chain_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """vLLM's ``hash_block_tokens`` with its ``sha256`` hash function: SHA-256 of the
    pickled ``(parent, tokens, extra_keys)`` (no LoRA, no multimodal: None)."""
    return hashlib.sha256(pickle.dumps((parent, tokens, None), protocol=5)).digest()


def block_key(block_hash: bytes, group_idx: int = GROUP_IDX) -> bytes:
    """The kvtierd key of one block: its hash bytes, then the group index (4 bytes)."""
    return block_hash + group_idx.to_bytes(4, "big")


def payload(key: bytes, block_bytes: int) -> bytes:
    """The bytes stored under ``key``: its SHA-256 repeated, cut to ``block_bytes``."""
    digest = hashlib.sha256(key).digest()
    return (digest * (block_bytes // len(digest) + 1))[:block_bytes]


@dataclass(frozen=True)
class Chain:
    """A request's blocks in prefix order: tokens, vLLM hashes, routers' ints, keys.

    Invariant: all five sequences have one entry a block, and ``hashes[i]`` is the
    chained hash of ``hashes[i - 1]`` (``NONE_HASH`` for the first) and ``tokens[i]``.
    """

    hash_ids: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    hashes: tuple[bytes, ...]
    ints: tuple[int, ...]
    keys: tuple[bytes, ...]

    def __len__(self) -> int:
        return len(self.hashes)

    def flat_tokens(self) -> list[int]:
        """The prompt's token ids (every block's, in order): what a router queries."""
        return [token for block in self.tokens for token in block]

    def description(self, index: int) -> BlockDescription:
        """Block ``index`` as vLLM's ``BlockStored`` describes it, for the daemon."""
        return BlockDescription(
            block_hashes=(self.ints[index],),
            parent_block_hash=self.ints[index - 1] if index else None,
            token_ids=self.tokens[index],
            block_size=len(self.tokens[index]),
            group_idx=GROUP_IDX,
        )


class ChainMaker:
    """Builds :class:`Chain` objects, caching each hash id's tokens and each prefix's
    hash (a trace's requests share long prefixes)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._hashes: dict[tuple[bytes, int], bytes] = {}

    def tokens(self, hash_id: int) -> tuple[int, ...]:
        found = self._tokens.get(hash_id)
        if found is None:
            found = self._tokens[hash_id] = block_tokens(hash_id, self.block_size)
        return found

    def chain(self, hash_ids: Sequence[int]) -> Chain:
        tokens = tuple(self.tokens(h) for h in hash_ids)
        hashes: list[bytes] = []
        parent = NONE_HASH
        for hash_id, block in zip(hash_ids, tokens, strict=True):
            cached = self._hashes.get((parent, hash_id))
            if cached is None:
                cached = self._hashes[(parent, hash_id)] = chain_hash(parent, block)
            hashes.append(cached)
            parent = cached
        return Chain(
            hash_ids=tuple(hash_ids),
            tokens=tokens,
            hashes=tuple(hashes),
            ints=tuple(hash64(h) for h in hashes),
            keys=tuple(block_key(h) for h in hashes),
        )
