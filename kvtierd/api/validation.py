"""Field checks shared by every RPC. Each raises InvalidArgument with a message
that names the field and what is allowed; none of them changes any state."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvtierd.config import MAX_BLOCK_BYTES
from kvtierd.contract import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES, key_repr
from kvtierd.errors import InvalidArgument
from kvtierd_client.wire.descriptions import shape_problem

MAX_KEY_BYTES = 256
BLOCK_ALIGNMENT = 4096
MAX_NAME_BYTES = 256
_POOL_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


def check_keys(keys: Sequence[bytes], max_keys: int, field: str = "keys") -> None:
    """1..256 bytes each, at most ``max_keys``, no key twice."""
    count = len(keys)
    if count == 0:
        return
    if count > max_keys:
        raise InvalidArgument(
            f"{field}: {count} keys in one call; at most {max_keys} are allowed "
            "(limits.max_keys_per_call); split the call"
        )
    lengths = list(map(len, keys))
    if min(lengths) == 0:
        raise InvalidArgument(f"{field}[{lengths.index(0)}]: empty key; keys are 1..256 bytes")
    if max(lengths) > MAX_KEY_BYTES:
        index = next(i for i, n in enumerate(lengths) if n > MAX_KEY_BYTES)
        raise InvalidArgument(
            f"{field}[{index}]: key of {lengths[index]} bytes; keys are 1..256 bytes"
        )
    if len(set(keys)) != count:
        seen: set[bytes] = set()
        for index, key in enumerate(keys):
            if key in seen:
                raise InvalidArgument(
                    f"{field}[{index}]: duplicate key {key_repr(key)}; "
                    "each key at most once per call"
                )
            seen.add(key)


def check_pool_name(name: str, field: str = "pool.name") -> None:
    if not _POOL_NAME.fullmatch(name):
        raise InvalidArgument(
            f"{field}: {name!r} is not a valid pool name; use 1..128 of [A-Za-z0-9._:/-]"
        )


def check_block_bytes(block_bytes: int) -> None:
    if block_bytes <= 0 or block_bytes % BLOCK_ALIGNMENT or block_bytes > MAX_BLOCK_BYTES:
        raise InvalidArgument(
            f"pool.block_bytes: {block_bytes} is not allowed; use a positive multiple of "
            f"{BLOCK_ALIGNMENT} up to {MAX_BLOCK_BYTES} (1 GiB); pad rows to 4096 bytes"
        )


def check_eviction_policy(policy: str) -> None:
    if policy and policy not in EVICTION_POLICIES:
        raise InvalidArgument(
            f"pool.eviction_policy: {policy!r} is not supported; use one of "
            f"{', '.join(EVICTION_POLICIES)} (or empty for {DEFAULT_EVICTION_POLICY})"
        )


def check_text(value: str, field: str, max_bytes: int = MAX_NAME_BYTES) -> None:
    if len(value.encode()) > max_bytes:
        raise InvalidArgument(f"{field}: at most {max_bytes} bytes, got {len(value.encode())}")


def check_descriptions(keys: Sequence[bytes], descriptions: Sequence[object]) -> None:
    """``CompleteStoreRequest.descriptions``: none, or one per key, each empty (the
    key undescribed) or within the bounds of
    :mod:`kvtierd_client.wire.descriptions` (its counts: the message's field types
    already bound every value)."""
    if not descriptions:
        return
    if len(descriptions) != len(keys):
        raise InvalidArgument(
            f"descriptions: {len(descriptions)} for {len(keys)} keys; give none or one a key "
            "(an empty one leaves its key undescribed)"
        )
    for index, wire in enumerate(descriptions):
        hashes = len(wire.block_hashes)  # type: ignore[attr-defined]
        if not hashes:
            continue
        tokens, size = len(wire.token_ids), wire.block_size  # type: ignore[attr-defined]
        problem = shape_problem(hashes, tokens, size)
        if problem is not None:
            raise InvalidArgument(f"descriptions[{index}] {problem}")
