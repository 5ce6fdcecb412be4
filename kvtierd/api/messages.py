"""The daemon's values as ``kvtier.v1`` messages: a pool's spec, an event, a pool's
statistics. Pure functions: no state, no validation (the handlers validate)."""

from __future__ import annotations

from kvtierd.api import wire
from kvtierd.contract import PoolSpec
from kvtierd.core.statistics import PoolStatistics, tier_views
from kvtierd.records.events import LoggedEvent
from kvtierd_client.wire.proto import pb2


def pool_spec_message(spec: PoolSpec) -> pb2.PoolSpec:
    return pb2.PoolSpec(
        name=spec.name,
        block_bytes=spec.block_bytes,
        num_blocks=spec.num_blocks,
        layout=spec.layout,
        eviction_policy=spec.eviction_policy,
    )


def event_message(seq: int, event: LoggedEvent) -> pb2.Event:
    """The logged event as sent: its packed keys are ``Event.keys`` in wire form,
    merged as they are (no Python object per key)."""
    message = pb2.Event(
        seq=seq, medium=wire.medium(event.medium), removed=event.removed, tier=event.tier
    )
    message.MergeFromString(event.packed_keys)
    return message


def pool_stats_message(stats: PoolStatistics) -> pb2.PoolStats:
    """GetStats' view of one pool snapshot: its spec and, per tier, the numbers
    :func:`kvtierd.core.statistics.tier_views` computes (no other source)."""
    spec = stats.spec
    return pb2.PoolStats(
        name=spec.name,
        block_bytes=spec.block_bytes,
        num_blocks=spec.num_blocks,
        layout=spec.layout,
        eviction_policy=spec.eviction_policy,
        sessions=stats.sessions,
        region_path=stats.region_path,
        last_event_seq=stats.last_event_seq,
        warm_adopted_blocks=stats.warm_adopted_blocks,
        warm_dropped_blocks=stats.warm_dropped_blocks,
        journal_bytes=stats.journal_bytes,
        journal_lag_seconds=stats.journal_lag_seconds,
        tiers=[
            pb2.TierStats(
                tier=view.name,
                medium=wire.medium(view.medium),
                admission=view.admission,
                # ints all; the stub types `ready` bool, which protobuf sets from 0 / 1 too
                **view.wire_numbers(),  # type: ignore[arg-type]
            )
            for view in tier_views(stats)
        ],
    )
