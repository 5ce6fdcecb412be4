"""One pool snapshot, two outputs: every field of ``Pool.statistics()`` reaches both
GetStats and the metrics endpoint with the same value, or is declared here to
reach only one of them (or neither) and why.

Before the tier numbers were computed in one table the two walked the snapshot
each on their own and had drifted apart: a secondary tier's ``ready`` (kvtierctl
status shows "index rebuilding") had no metric, and ``stores_refused`` (PrepareStore
answered "no room") was counted and told by neither.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.core import Metric

from kvtierd.api.messages import pool_stats_message
from kvtierd.contract import Medium, PoolSpec
from kvtierd.core.statistics import (
    TIER_NUMBERS,
    WIRE_NUMBERS,
    PoolStatistics,
    PrimaryStatistics,
    SecondaryStatistics,
)
from kvtierd.ops.metrics import POOL_FAMILIES, POOL_NUMBERS, collect_pool_families
from kvtierd.tiering.admission import REASONS, AdmissionStats
from kvtierd.tiering.manager import TierCounters
from kvtierd.tiers.base import TierStats
from kvtierd_client.wire.proto import pb2

METRICS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "operations" / "metrics.md"

# Snapshot fields (paths; a secondary tier's without its index) told by one output only.
GETSTATS_ONLY = {
    "spec.block_bytes": "the metrics compute bytes from primary.block_bytes, the same number",
    "spec.num_blocks": "the metrics tell primary.capacity_blocks, the same number",
    "spec.layout": "text, not a number",
    "spec.eviction_policy": "text, not a number",
    "region_path": "text, not a number",
    "last_event_seq": "a resume point for event readers, not an operator's number",
    "tier.medium": "an enum; the tier label names the tier",
    "admission.policy": "text, not a number",
}
METRICS_ONLY = {  # GetStats has no field for them, and the wire contract stays as it is
    "region_bytes": "spec.num_blocks x spec.block_bytes in GetStats",
    "primary.stores_refused": "no TierStats field",
    "counters.cascade_jobs_started": "no TierStats field",
    "counters.cascade_jobs_finished": "no TierStats field",
    "counters.promotion_jobs_started": "no TierStats field",
    "counters.promotion_jobs_finished": "no TierStats field",
    "counters.promotion_jobs_failed": "no TierStats field",
    "tier.queued_jobs": "no TierStats field",
    "warm_restart_off": "no PoolStats field (the ERROR line that turned it on says why)",
    "admission.rejected_bytes": "rejected_<reason>_blocks x spec.block_bytes in GetStats",
}
TOLD_BY_NEITHER = {
    "tier.hits": "the tier's raw index answers: counters.hits is what this pool got",
    "tier.misses": "the tier's raw index answers: counters.misses is what this pool got",
    "tier.dropped_writes": "the tier's own count: counters.cascade_blocks_dropped is this pool's",
    "counters.promotion_blocks": "promoted_blocks + promotion_failures once the jobs reported",
}


def _fill(cls: type, values: Iterator[int], **given: Any) -> Any:
    return cls(**{f.name: given.get(f.name, next(values)) for f in dataclasses.fields(cls)})


def make_snapshot() -> PoolStatistics:
    """A pool with two secondary tiers and a distinct value in every number."""
    values = itertools.count(1001, 37)
    secondaries = tuple(
        SecondaryStatistics(
            tier=_fill(
                TierStats,
                values,
                name=f"fs{i}",
                medium=Medium.STORAGE,
                capacity_bytes=(1 << 30) + i,
                bytes_per_block=12288,
            ),  # fmt: skip
            ready=i == 1,
            counters=_fill(TierCounters, values),
            admission=AdmissionStats(
                policy="tinylfu",
                admitted_blocks=next(values),
                admitted_bytes=next(values),
                rejected_blocks={reason: next(values) for reason in REASONS},
                rejected_bytes={reason: next(values) for reason in REASONS},
                sketch_bytes=next(values),
            ),
        )
        for i in range(2)
    )
    return PoolStatistics(
        spec=PoolSpec("pool-a", 8192, 64, "layout-a", "lru"),
        sessions=next(values),
        region_path="/dev/shm/kvtierd-pool-a",
        region_bytes=64 * 8192,
        last_event_seq=next(values),
        primary=_fill(PrimaryStatistics, values, block_bytes=8192, capacity_blocks=64),
        secondaries=secondaries,
    )


def leaf_paths(obj: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every non-dataclass field (tuples indexed: ``secondaries[1]``)."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        path = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            yield from leaf_paths(value, path + ".")
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                yield from leaf_paths(item, f"{path}[{i}].")
        else:
            yield path


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, Medium):
        return Medium.REMOTE if value is not Medium.REMOTE else Medium.CPU
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, dict):  # counts by reason
        return {key: count * 2 + 1 for key, count in value.items()}
    return value + "-changed"


def with_changed(obj: Any, path: str) -> Any:
    """``obj`` with the field at ``path`` changed (a new frozen snapshot)."""
    head, _, rest = path.partition(".")
    index = re.fullmatch(r"(\w+)\[(\d+)\]", head)
    if index is not None:
        name, i = index.group(1), int(index.group(2))
        items = list(getattr(obj, name))
        items[i] = with_changed(items[i], rest)
        return dataclasses.replace(obj, **{name: tuple(items)})
    if not rest:
        return dataclasses.replace(obj, **{head: _changed(getattr(obj, head))})
    return dataclasses.replace(obj, **{head: with_changed(getattr(obj, head), rest)})


def samples(metrics: list[Metric]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for metric in metrics
        for sample in metric.samples
    }


def told(snapshot: PoolStatistics) -> tuple[pb2.PoolStats, dict[Any, float]]:
    """What GetStats and the metrics endpoint make of one snapshot."""
    return pool_stats_message(snapshot), samples(collect_pool_families([snapshot]))


def declared(path: str) -> str:
    """The path a declaration names: a secondary tier's fields without their index."""
    return re.sub(r"^secondaries\[\d+\]\.", "", path)


@pytest.mark.parametrize("path", list(leaf_paths(make_snapshot())))
def test_every_snapshot_field_reaches_getstats_and_metrics(path):
    """Changing one field of the snapshot changes both outputs, unless it is declared
    to reach only one (or neither), in which case exactly that happens."""
    base = make_snapshot()
    message, metrics = told(base)
    changed_message, changed_metrics = told(with_changed(base, path))
    name = declared(path)
    in_getstats = changed_message != message
    in_metrics = changed_metrics != metrics
    expected = (
        name not in METRICS_ONLY and name not in TOLD_BY_NEITHER,
        name not in GETSTATS_ONLY and name not in TOLD_BY_NEITHER,
    )
    assert (in_getstats, in_metrics) == expected, (
        f"{path}: told by GetStats {in_getstats}, by the metrics {in_metrics}"
    )


def test_the_declarations_name_real_fields():
    paths = {declared(path) for path in leaf_paths(make_snapshot())}
    for table in (GETSTATS_ONLY, METRICS_ONLY, TOLD_BY_NEITHER):
        assert set(table) <= paths, set(table) - paths


def metric_sources() -> dict[str, list[tuple[str, dict[str, str]]]]:
    """tier number -> [(sample name, fixed labels)] of the families that tell it."""
    sources: dict[str, list[tuple[str, dict[str, str]]]] = {}
    for family in POOL_FAMILIES:
        name = family.name + ("_total" if family.type == "counter" else "")
        source = family.source
        pairs = source.items() if not isinstance(source, str) else [(None, source)]
        for label, number in pairs:
            fixed = {family.by: label} if family.by and label else {}
            sources.setdefault(number, []).append((name, fixed | {"@scope": family.scope}))
    return sources


def test_every_getstats_number_has_a_metric_of_the_same_value():
    snapshot = make_snapshot()
    message, metrics = told(snapshot)
    sources = metric_sources()
    checked = 0
    for tier in message.tiers:
        for field, value in tier.ListFields():
            if field.name in ("tier", "medium", "admission"):  # text: labels, not numbers
                continue
            assert field.name in sources, f"GetStats {field.name} has no metric"
            for sample_name, fixed in sources[field.name]:
                labels = {"pool": message.name, **fixed}
                scope = labels.pop("@scope")
                if scope == "primary" and tier.tier != "primary":
                    continue  # a primary-only family that shares the number's name
                if scope == "tier":
                    labels["tier"] = tier.tier
                key = (sample_name, tuple(sorted(labels.items())))
                assert metrics[key] == value, (tier.tier, field.name, sample_name)
                checked += 1
    assert checked > 50


def test_every_wire_number_is_a_tier_stats_field_and_the_rest_are_not():
    fields = {f.name for f in pb2.TierStats.DESCRIPTOR.fields} - {"tier", "medium", "admission"}
    assert fields == WIRE_NUMBERS
    assert {n.name for n in TIER_NUMBERS if not n.on_wire}.isdisjoint(fields)


def test_every_number_feeds_a_family():
    """A number computed for no family would be a metric forgotten."""
    fed = set(metric_sources()) | set(POOL_NUMBERS)
    numbers = {n.name for n in TIER_NUMBERS}
    assert numbers - fed == set(), "tier numbers no metric family tells"
    assert fed - numbers - set(POOL_NUMBERS) == set(), "families of numbers nobody computes"


def documented_metrics() -> set[str]:
    """The metric names of the docs' metrics table. A row may name several:
    `kvtierd_tier_jobs_started_total`, `..._finished_total` (the first name's stem)."""
    names: set[str] = set()
    for row in METRICS_PAGE.read_text().splitlines():
        if not row.startswith("| `kvtierd_"):
            continue
        first = ""
        for token in re.findall(r"`((?:kvtierd|\.\.\.)_\w+)`", row):
            if token.startswith("..."):
                suffix = token[3:]
                names.add(first.rsplit("_", suffix.count("_"))[0] + suffix)
            else:
                first = token
                names.add(token)
    return names


def test_the_docs_metrics_table_lists_every_family():
    documented = documented_metrics()
    assert "kvtierd_tier_jobs_failed_total" in documented  # the abbreviation is read
    for family in POOL_FAMILIES:
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert shown in documented, f"{shown} is not in the metrics table of {METRICS_PAGE}"
