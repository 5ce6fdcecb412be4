"""The manager's parts without an engine or a daemon: step cache, holdings, accounting.

Each is pure bookkeeping of the scheduler thread; these tests state what it
promises, with integer keys."""

from __future__ import annotations

from collections import Counter

from vllm.v1.kv_offload.base import LookupResult

from kvtierd_client.vllm.accounting import (
    METRIC_NAMES,
    QUEUE_STEPS,
    CounterReport,
    ManagerCounters,
    StepAccounting,
    StepStats,
)
from kvtierd_client.vllm.holdings import Holdings
from kvtierd_client.vllm.step_cache import LOOKUP_BATCH, StepCache

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def k(i: int) -> bytes:
    """Key ``i`` of KV group 0 (the last four bytes name the group)."""
    return i.to_bytes(8, "big") + bytes(4)


# -- step cache ------------------------------------------------------------------------


def test_only_pinned_hits_are_answered_and_cached():
    """Scenario: a prefix lookup answers HIT, HIT_PENDING, HIT (unpinned), MISS."""
    cache = StepCache()
    keys = [k(1), k(2), k(3), k(4)]
    first = cache.record(keys, [HIT, PENDING, HIT, MISS], [7, -1, -1, -1])
    assert first is HIT
    assert [cache.get(key) for key in keys] == [HIT, PENDING, None, MISS]
    assert cache.unclaimed() == [k(1)]


def test_an_unpinned_first_hit_is_a_miss_and_not_cached():
    cache = StepCache()
    assert cache.record([k(1)], [HIT], [-1]) is MISS
    assert cache.get(k(1)) is None and cache.unclaimed() == []


def test_claim_takes_one_pin_per_key_and_returns_rows_in_order():
    cache = StepCache()
    cache.record([k(1), k(2)], [HIT, HIT], [5, 6])
    cache.record([k(1)], [HIT], [5])  # asked again: a second pin on the same row
    assert cache.claim([k(2), k(1), k(1), k(9)]) == {k(2): 6, k(1): 5}
    assert cache.unclaimed() == [k(1)]  # the second pin of k(1) is left
    cache.clear()
    assert cache.unclaimed() == [] and cache.get(k(1)) is None


def test_following_keys_stop_at_the_first_answered_key_and_the_batch_size():
    cache = StepCache()
    positions = {k(i): i for i in range(10)}
    positions[k(100)[:-4] + b"\x00\x00\x00\x01"] = 5  # another KV group: never chained
    cache.record([k(6)], [MISS], [-1])
    assert cache.following_keys(k(2), positions) == [k(3), k(4), k(5)]
    assert cache.following_keys(k(2), None) == []
    many = {k(i): i for i in range(LOOKUP_BATCH + 10)}
    assert len(StepCache().following_keys(k(0), many)) == LOOKUP_BATCH - 1


# -- holdings --------------------------------------------------------------------------


def test_rows_of_claimed_pins_count_one_pin_per_key():
    """Regression: ``pinned`` gets the claimed ``{key: row}`` mapping; a Counter's
    ``update`` would add the row numbers as pin counts."""
    holdings = Holdings()
    holdings.pinned({k(1): 55, k(2): 0})
    assert holdings.load_pins == Counter({k(1): 1, k(2): 1})


def test_unpin_releases_only_this_generations_pins_once_per_call():
    holdings = Holdings()
    holdings.pinned([k(1), k(1), k(2)])
    assert holdings.unpin([k(1), k(1), k(3)]) == [k(1)]  # unique keys, pinned ones only
    assert holdings.load_pins == Counter({k(1): 1, k(2): 1})
    assert holdings.unpin([k(1), k(2)]) == [k(1), k(2)]
    assert not holdings.load_pins


def test_reset_buries_what_is_held_until_its_step():
    holdings = Holdings()
    holdings.pinned([k(1), k(1)])
    holdings.reserve([k(3), k(2)])
    holdings.bury(release_step=5, generation=1)
    assert not holdings.load_pins and not holdings.reserved
    assert holdings.has_graves
    assert holdings.due(4) == []
    [grave] = holdings.due(5)
    assert (grave.generation, grave.reserved, grave.pins()) == (1, [k(2), k(3)], [k(1), k(1)])
    assert not holdings.has_graves
    holdings.bury(release_step=9, generation=1)  # nothing held: no grave
    assert not holdings.has_graves


def test_graves_without_a_release_step_wait_for_the_flush_report():
    """vLLM 0.33 says when the workers flushed (``on_reset_flushed``): no step count."""
    holdings = Holdings()
    holdings.pinned([k(1)])
    holdings.bury(release_step=None, generation=2)
    holdings.reserve([k(2)])
    holdings.bury(release_step=None, generation=2)  # a second reset before the report
    assert holdings.due(10**9) == [] and holdings.has_graves
    graves = holdings.flushed()
    assert [(g.pins(), g.reserved) for g in graves] == [([k(1)], []), ([], [k(2)])]
    assert not holdings.has_graves and holdings.flushed() == []


def test_complete_ends_only_this_generations_reservations():
    holdings = Holdings()
    holdings.reserve([k(1), k(2)])
    assert holdings.complete([k(2), k(2), k(3)]) == [k(2)]
    assert holdings.reserved == {k(1)}


# -- accounting ------------------------------------------------------------------------


def test_round_trips_of_a_step_count_own_calls_and_the_sessions():
    acct = StepAccounting()
    acct.on_call("Lookup", queues_completions=True)  # counted by the session
    acct.on_call("FlushPool", queues_completions=True)  # counted here
    acct.step += 1
    acct.end_step(live_session_rpcs=1)
    assert list(acct.step_round_trips) == [2]
    assert acct.stats(1) == StepStats(steps=1, busy_steps=1, round_trips=2)
    acct.step += 1
    acct.end_step(live_session_rpcs=1)  # an idle step
    assert acct.stats(1) - StepStats(1, 1, 2) == StepStats(1, 0, 0)


def test_a_queued_completion_is_overdue_after_a_whole_step_unless_carried():
    acct = StepAccounting()
    acct.on_call("CompleteStore", queues_completions=True)
    assert acct.queued_at == 0
    acct.step = QUEUE_STEPS - 1
    assert not acct.queue_overdue()
    acct.step = QUEUE_STEPS
    assert acct.queue_overdue()
    acct.on_call("Lookup", queues_completions=True)  # carries the queue
    assert acct.queued_at is None and not acct.queue_overdue()
    acct.on_call("GetStats", queues_completions=True)  # not work: the step stays idle
    acct.end_step(0)
    assert acct.stats(0).busy_steps == 1  # from the CompleteStore and the Lookup


def test_a_lost_session_keeps_its_round_trips_and_drops_its_queue():
    acct = StepAccounting()
    acct.on_call("Touch", queues_completions=True)
    acct.on_session_lost(session_rpcs=7)
    assert acct.queued_at is None
    acct.on_open_session()
    assert acct.round_trips(live_session_rpcs=2) == 7 + 1 + 2


def test_counter_report_yields_each_increase_once():
    counters = ManagerCounters()
    report = CounterReport(counters)
    counters.lookups["hit"] += 3
    counters.rpc_failures += 1
    first = list(report.deltas(StepStats(steps=2, busy_steps=1, round_trips=5)))
    assert first == [
        (METRIC_NAMES["lookups"], 3, ("hit",)),
        (METRIC_NAMES["rpc_failures"], 1, ()),
        (METRIC_NAMES["round_trips"], 5, ()),
        (METRIC_NAMES["steps"], 2, ()),
    ]
    assert list(report.deltas(StepStats(2, 1, 5))) == []
    counters.lookups["hit"] += 1
    assert list(report.deltas(StepStats(3, 1, 5))) == [
        (METRIC_NAMES["lookups"], 1, ("hit",)),
        (METRIC_NAMES["steps"], 1, ()),
    ]
