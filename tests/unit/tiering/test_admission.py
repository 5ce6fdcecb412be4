"""Admission policies (``always``, ``reused``, ``tinylfu``): their decisions on known
sequences, with the sketch on a fake clock, the counters per reason, and a flood of
one-shot keys that must not push a reused working set out of the tier.

The tier here is an LRU of fixed capacity standing in for a tier's
:meth:`~kvtierd.tiers.base.SecondaryTier.victim`; the real tiers' victims are checked
by the tier contract suite (tests/tiers, ``victim_is_what_one_more_block_would_displace``)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from fake_clock import FakeClock

from kvtierd.tiering.admission import (
    BUDGET,
    NOT_ON_READ,
    NOT_REUSED,
    REASONS,
    AlwaysAdmit,
    Occasion,
    ReusedAdmit,
    TierAdmission,
    TinyLfuAdmit,
    make_policy,
)
from kvtierd.tiering.sketch import AGE_SECONDS, sketch_for, width_for
from kvtierd.tiers.base import UNKNOWN_VICTIM

STORED, READ, PROMOTED = Occasion.STORED, Occasion.READ, Occasion.PROMOTED
BLOCK = 4096


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


class LruTier:
    """What a tier tells admission: the key one more block would displace."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[bytes, None] = OrderedDict()
        self.unknown = False  # a fleet: the victim is in the server

    def victim(self) -> bytes | None:
        if self.unknown:
            return UNKNOWN_VICTIM
        return None if len(self.held) < self.capacity else next(iter(self.held))

    def write(self, keys: list[bytes]) -> None:
        for k in keys:
            self.held[k] = None
            self.held.move_to_end(k)
            while len(self.held) > self.capacity:
                self.held.popitem(last=False)

    def read(self, k: bytes) -> None:
        self.held.move_to_end(k)


def tinylfu(tier: LruTier, clock: FakeClock | None = None) -> TierAdmission:
    sketch = sketch_for(tier.capacity, clock or FakeClock())
    return TierAdmission(TinyLfuAdmit(sketch, tier.victim), BLOCK)


def store(admission: TierAdmission, tier: LruTier, keys: list[bytes]) -> list[bytes]:
    """A completed store: counted, offered, what is admitted written. Returns it."""
    admission.seen(keys)
    admitted, _ = admission.offer(keys, STORED)
    tier.write(admitted)
    return admitted


def load(admission: TierAdmission, tier: LruTier, keys: list[bytes]) -> list[bytes]:
    """A load from the primary: counted; those the tier lacks offered at READ."""
    admission.seen(keys)
    for k in keys:
        if k in tier.held:
            tier.read(k)
    admitted, _ = admission.offer([k for k in keys if k not in tier.held], READ)
    tier.write(admitted)
    return admitted


# -- always, reused --------------------------------------------------------------------


def test_always_writes_every_stored_and_promoted_block_and_nothing_at_a_read():
    policy = AlwaysAdmit()
    assert policy.admit(key(1), STORED) is None
    assert policy.admit(key(1), PROMOTED) is None
    assert policy.admit(key(1), READ) is NOT_ON_READ
    assert not TierAdmission(policy, BLOCK).writes_on_read


def test_reused_writes_a_block_at_its_first_load_never_at_its_store():
    tier = LruTier(10)
    admission = TierAdmission(ReusedAdmit(), BLOCK)
    assert store(admission, tier, [key(1), key(2)]) == []
    assert load(admission, tier, [key(1)]) == [key(1)]  # read again: written now
    assert load(admission, tier, [key(1)]) == []  # held: nothing to write
    assert admission.policy.admit(key(3), PROMOTED) is None  # promoted: reused
    stats = admission.statistics()
    assert stats.policy == "reused" and stats.admitted_blocks == 1
    assert stats.rejected_blocks == {"not_reused": 2, "infrequent": 0, "budget": 0}
    assert stats.rejected_bytes["not_reused"] == 2 * BLOCK and stats.sketch_bytes == 0


def test_offer_groups_the_rejected_keys_by_reason_for_the_history():
    admission = TierAdmission(ReusedAdmit(), BLOCK)
    admitted, rejected = admission.offer([key(1), key(2)], STORED)
    assert admitted == [] and rejected == {NOT_REUSED: [key(1), key(2)]}
    assert NOT_REUSED.record.startswith("not admitted: not read again")


# -- tinylfu ---------------------------------------------------------------------------


def test_tinylfu_admits_everything_while_the_tier_has_room():
    tier = LruTier(3)
    admission = tinylfu(tier)
    assert store(admission, tier, [key(1), key(2), key(3)]) == [key(1), key(2), key(3)]
    assert admission.statistics().admitted_blocks == 3


def test_tinylfu_rejects_a_one_shot_block_once_full_and_admits_one_seen_again():
    """Scenario: a full tier of blocks seen once each. A new block seen once does not
    beat them (a held block counts as seen at least once); the same block stored
    again (evicted from the primary, computed again) has been seen twice, and
    displaces the least recently used."""
    tier = LruTier(3)
    admission = tinylfu(tier)
    store(admission, tier, [key(1), key(2), key(3)])
    assert store(admission, tier, [key(4)]) == []
    assert admission.statistics().rejected_blocks["infrequent"] == 1
    assert store(admission, tier, [key(4)]) == [key(4)]  # seen twice now: beats key 1
    assert list(tier.held) == [key(2), key(3), key(4)]


def test_tinylfu_keeps_a_frequent_victim_against_a_block_seen_as_often_or_less():
    tier = LruTier(2)
    admission = tinylfu(tier)
    store(admission, tier, [key(1), key(2)])
    for _ in range(3):
        load(admission, tier, [key(1), key(2)])  # each seen 4 times
    for _ in range(3):
        assert store(admission, tier, [key(9)]) == []  # 1, 2, 3 times: no more than 4
    assert store(admission, tier, [key(9)]) == []  # 4 times: not more than key 1's 4
    assert store(admission, tier, [key(9)]) == [key(9)]  # 5 times: beats it
    assert list(tier.held) == [key(2), key(9)]


def test_tinylfu_writes_at_a_load_a_block_that_became_frequent():
    """A block rejected at its store is written at a later load once it beats the victim."""
    tier = LruTier(1)
    admission = tinylfu(tier)
    store(admission, tier, [key(1)])
    assert store(admission, tier, [key(2)]) == []
    assert load(admission, tier, [key(2)]) == [key(2)]  # seen twice: beats key 1 (once)
    assert list(tier.held) == [key(2)]


def test_tinylfu_without_a_known_victim_admits_what_was_seen_twice():
    """A fleet's LRU is in the server: the bar is a block held once (seen twice)."""
    tier = LruTier(1)
    tier.unknown = True
    admission = tinylfu(tier)
    assert store(admission, tier, [key(1)]) == []
    assert store(admission, tier, [key(1)]) == [key(1)]


def test_tinylfu_forgets_on_the_clock():
    """A block seen often long ago: once the sketch has aged twice (AGE_SECONDS on
    the fake clock each) a block seen twice since beats it; without the aging the
    same two stores would not (2 against 6)."""
    clock = FakeClock()
    tier = LruTier(1)
    admission = tinylfu(tier, clock)
    store(admission, tier, [key(1)])
    for _ in range(5):
        load(admission, tier, [key(1)])  # key 1: seen 6 times
    for _ in range(2):
        clock.advance(AGE_SECONDS)
        admission.seen([])  # a batch: the sketch reads its clock once per batch
    assert admission.policy.sketch.agings == 2
    assert store(admission, tier, [key(2)]) == []  # 1 against key 1's 6 // 4 = 1
    assert store(admission, tier, [key(2)]) == [key(2)]  # 2 against 1


def test_a_budget_drop_moves_admitted_blocks_to_its_reason():
    tier = LruTier(4)
    admission = tinylfu(tier)
    admitted = store(admission, tier, [key(1), key(2)])
    admission.reject(admitted[1:], BUDGET)
    stats = admission.statistics()
    assert stats.admitted_blocks == 1 and stats.rejected_blocks["budget"] == 1
    assert stats.rejected_bytes["budget"] == BLOCK and set(stats.rejected_blocks) == set(REASONS)


def test_make_policy_names_the_choices():
    assert make_policy("always", lambda: None, 0).name == "always"
    policy = make_policy("tinylfu", lambda: None, 5000)
    assert policy.sketch_bytes == 6 * width_for(5000) == 6 * 32768
    with pytest.raises(ValueError, match="expected one of always, reused, tinylfu"):
        make_policy("lru", lambda: None, 0)


def test_a_million_one_shot_keys_keep_the_sketch_in_its_bytes_and_the_working_set_in():
    """Scenario: a tier of 1,000 blocks holds a working set of 500 blocks, each read
    again every ~2,000 stores; 1M distinct one-shot blocks are stored meanwhile (in
    batches of 32, as cascades come). The sketch stays at its bytes, the working set
    stays in the tier, and almost none of the one-shot blocks are written."""
    tier = LruTier(1000)
    admission = tinylfu(tier)
    sketch_bytes = admission.statistics().sketch_bytes
    working = [key(i) for i in range(500)]
    store(admission, tier, working)
    one_shots_written = 0
    next_key = 10_000
    for batch in range(1_000_000 // 32):
        keys = [key(next_key + i) for i in range(32)]
        next_key += 32
        one_shots_written += len(store(admission, tier, keys))
        for k in working[batch * 8 % 500 : batch * 8 % 500 + 8]:  # 8 reuses per batch
            load(admission, tier, [k]) if k in tier.held else store(admission, tier, [k])
    assert admission.statistics().sketch_bytes == sketch_bytes == 6 * 4096
    assert all(k in tier.held for k in working)
    assert one_shots_written < 1000 + 10_000  # the first fill, then < 1 % of the flood
