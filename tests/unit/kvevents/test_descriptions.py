"""The description table: first writer wins, residency per tier, and the byte bound
hands back what it takes out so it can be withdrawn from routers."""

from __future__ import annotations

from kvtierd.kvevents.descriptions import Described, DescriptionTable, entry_cost
from kvtierd_client.wire.proto import pb2


def described(n: int, tokens: int = 4) -> Described:
    wire = pb2.BlockDescription(block_hashes=[n], token_ids=range(tokens), block_size=tokens)
    return Described(wire.SerializeToString())


def hashes(entry: Described) -> list[int]:
    return list(pb2.BlockDescription.FromString(entry.raw).block_hashes)


def test_the_first_description_of_a_key_wins():
    table = DescriptionTable(1 << 20)
    table.offer("p", b"k", described(1))
    table.offer("p", b"k", described(2))
    assert hashes(table.get("p", b"k")) == [1]
    assert table.get("q", b"k") is None  # pools apart


def test_an_entry_lives_while_a_tier_holds_its_key():
    table = DescriptionTable(1 << 20)
    table.offer("p", b"k", described(1))
    assert table.stored("p", b"k", "primary", "CPU") is not None
    assert table.stored("p", b"k", "fs0", "STORAGE").holds("STORAGE")
    assert table.removed("p", b"k", "redis0") is None  # that tier never held it
    entry = table.removed("p", b"k", "primary")
    assert entry is not None and not entry.holds("CPU") and entry.holds("STORAGE")
    assert table.get("p", b"k") is not None
    table.removed("p", b"k", "fs0")
    assert table.get("p", b"k") is None and len(table) == 0 and table.used_bytes == 0


def test_the_byte_bound_takes_the_least_recently_stored_and_returns_the_held_ones():
    one = entry_cost(b"k0", described(0).raw, 0)
    table = DescriptionTable(3 * (one + 100) + 10)  # three entries held by one tier each
    for n in range(3):
        table.offer("p", f"k{n}".encode(), described(n))
    table.stored("p", b"k0", "primary", "CPU")  # k0 is held, and now the most recent
    table.stored("p", b"k1", "primary", "CPU")
    taken = table.offer("p", b"k3", described(3))  # k2 (never held) goes silently
    assert taken == [] and table.get("p", b"k2") is None
    taken = table.offer("p", b"k4", described(4))  # then k0, which routers were told of
    assert [(pool, hashes(entry)) for pool, entry in taken] == [("p", [0])]
    assert table.used_bytes <= table.limit_bytes and table.dropped == 2


def test_used_bytes_is_the_sum_of_the_entries_costs():
    table = DescriptionTable(1 << 30)
    for n in range(100):
        key = f"key-{n}".encode()
        table.offer("p", key, described(n, tokens=16))
        table.stored("p", key, "primary", "CPU")
        if n % 2:
            table.stored("p", key, "fs0", "STORAGE")
    expected = sum(entry_cost(key, e.raw, len(e.tiers)) for key, e in table.entries("p"))
    assert table.used_bytes == expected
    assert expected > 100 * (len(described(0, tokens=16).raw) + 300)
    table.forget_all()
    assert table.used_bytes == 0
