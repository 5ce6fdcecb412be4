"""What a pool costs the daemon's heap beyond its region (docs/design/memory.md).

A pool's heap is bounded by its configuration: its event log by
``limits.events_retained_bytes`` and its removal history by
``limits.removals_retained_bytes`` (both count what they take:
:mod:`kvtierd.records`), and its block table by its rows: each row holds at most
one key of at most 256 bytes, plus the per-row costs below.

Per row, beyond the key's bytes, measured on 64-bit CPython 3.11 with
tracemalloc, the allocator's rounding included (tests/unit/primary/test_footprint.py
holds the figures at the table's worst load, just after its dict grew):

* the table (``PrimaryManager``): the key's bytes object header and rounding,
  its dict entry and slots, its row number, its ref count and the LRU links:
  at most 220 with LRU (at 22,000 rows; 180 at 65,536), counted 240. ARC also
  keeps a ghost of each evicted key (its B1/B2 lists, up to one per row) and
  ordered dicts of both: up to twice the key plus 641 (at 11,500 rows), counted
  twice the key plus 680;
* the warm-restart journal's per-row state (generation, live key slot, live
  checksum, freed flag: 21 bytes), counted 24. Its hash backlog holds a tuple
  and the key of each completion not yet journaled (docs/design/journal.md):
  bounded by the rows, transient, not counted here.

Pure arithmetic; nothing here is measured at run time.
"""

from __future__ import annotations

from kvtierd.contract import ARC, LRU

TABLE_ROW_BYTES = {LRU: 240, ARC: 680}  # beyond the row's key (or keys: ARC)
KEYS_PER_ROW = {LRU: 1, ARC: 2}  # ARC: the resident key and an evicted one's ghost
JOURNAL_ROW_BYTES = 24
MAX_KEY_BYTES = 256  # the protocol's limit (kvtierd.api.validation)


def table_heap_bytes(num_blocks: int, policy: str, key_bytes: int = MAX_KEY_BYTES) -> int:
    """What the block table of ``num_blocks`` rows holding keys of ``key_bytes``
    bytes costs at most; ``policy`` is one of ``EVICTION_POLICIES`` (ValueError otherwise)."""
    if policy not in TABLE_ROW_BYTES:
        raise ValueError(f"unknown eviction policy {policy!r}")
    return num_blocks * (KEYS_PER_ROW[policy] * key_bytes + TABLE_ROW_BYTES[policy])


def pool_heap_bytes(
    num_blocks: int,
    policy: str,
    *,
    events_bytes: int,
    removals_bytes: int,
    warm_restart: bool,
    key_bytes: int = MAX_KEY_BYTES,
) -> int:
    """The heap a pool's keys and records may take: its event log and removal
    history at their byte limits, its table full of ``key_bytes``-byte keys and,
    with ``warm_restart``, its journal's per-row state."""
    journal = num_blocks * JOURNAL_ROW_BYTES if warm_restart else 0
    return events_bytes + removals_bytes + table_heap_bytes(num_blocks, policy, key_bytes) + journal
