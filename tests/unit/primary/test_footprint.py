"""What the block table counts per row (kvtierd.primary.footprint) covers the heap
it takes, measured with tracemalloc at table sizes just past a dict growth."""

from __future__ import annotations

import pytest
from heap_harness import retained_heap

from kvtierd.primary.footprint import pool_heap_bytes, table_heap_bytes
from kvtierd.primary.manager import PrimaryManager


def churned_table(rows: int, policy: str, key_bytes: int) -> PrimaryManager:
    """A table of ``rows`` rows through which three times as many new keys went, 64
    a call (ARC's ghost lists fill), some touched."""
    manager = PrimaryManager(rows, policy)
    for start in range(0, 3 * rows, 64):
        keys = [i.to_bytes(8, "big") * (key_bytes // 8) for i in range(start, start + 64)]
        manager.prepare_store(keys)
        manager.complete_store(keys, True)
        if start % (rows // 2) < 64:
            manager.touch(keys)
    return manager


@pytest.mark.parametrize("key_bytes", [8, 256])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("rows", [5500, 11500])
def test_a_full_table_takes_at_most_what_its_rows_count(rows, policy, key_bytes):
    manager, heap = retained_heap(lambda: churned_table(rows, policy, key_bytes))
    assert len(manager) == rows
    counted = table_heap_bytes(rows, policy, key_bytes)
    assert heap <= counted, f"{heap / rows:.0f} heap bytes a row, {counted / rows:.0f} counted"


def test_a_pools_heap_is_its_records_limits_its_table_and_its_journal_rows():
    table = table_heap_bytes(1000, "lru", 256)
    assert table == 1000 * (256 + 240)
    records = {"events_bytes": 64 << 20, "removals_bytes": 16 << 20}
    cold = pool_heap_bytes(1000, "lru", warm_restart=False, **records)
    assert cold == (80 << 20) + table
    assert pool_heap_bytes(1000, "lru", warm_restart=True, **records) == cold + 1000 * 24
    with pytest.raises(ValueError, match="policy"):
        table_heap_bytes(1, "fifo")
