"""Counters mean one thing everywhere (issue #16): after a scripted sequence with
promotions from an fs tier and repeated pending lookups, GetStats, the metrics
endpoint and ``kvtierctl stats --json`` tell the same numbers, a primary hit is a
HIT answer, a promoted block is one hit of its tier, and loaded bytes are the
pins released as loads (not the lookup pins released unused)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, free_port, fs_tiers_config, start_daemon, wait_tier_jobs
from prometheus_client.parser import text_string_to_metric_families

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.wire.proto import pb2

KVTIERCTL = str(Path(sys.executable).parent / "kvtierctl")
BLOCK = 8192
FILE_BYTES = BLOCK + 4096  # an fs block file: header page + payload
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING

# GetStats TierStats field -> (metric sample name, extra labels); labels pool and tier
# are added. Every numeric TierStats field is listed for the tiers it applies to.
BOTH = {
    "hits": ("kvtierd_hit_blocks_total", {}),
    "misses": ("kvtierd_miss_blocks_total", {}),
    "retries": ("kvtierd_retry_blocks_total", {}),
    "bytes_in": ("kvtierd_stored_bytes_total", {}),
    "bytes_out": ("kvtierd_loaded_bytes_total", {}),
    "evictions": ("kvtierd_evictions_total", {}),
    "failures": ("kvtierd_failed_blocks_total", {}),
    "used_blocks": ("kvtierd_blocks_used", {}),
    "capacity_blocks": ("kvtierd_blocks_capacity", {}),
    "used_bytes": ("kvtierd_used_bytes", {}),
    "capacity_bytes": ("kvtierd_capacity_bytes", {}),
}
# primary-only fields: labelled by pool only
PRIMARY = {
    "hits_pending": ("kvtierd_lookups_total", {"result": "hit_pending"}),
    "unused_pins": ("kvtierd_unused_pins_total", {}),
    "pinned_blocks": ("kvtierd_pinned_blocks", {}),
    "pending_blocks": ("kvtierd_pending_blocks", {}),
    "quarantined_blocks": ("kvtierd_quarantined_blocks", {}),
}
SECONDARY = {
    "jobs_in_flight": ("kvtierd_tier_jobs_in_flight", {}),
    "cascade_blocks": ("kvtierd_cascade_blocks_total", {}),
    "cascade_failures": ("kvtierd_tier_jobs_failed_total", {"kind": "cascade"}),
    "dropped_blocks": ("kvtierd_dropped_writes_total", {}),
    "promoted_blocks": ("kvtierd_promoted_blocks_total", {"outcome": "loaded"}),
    "promotion_failures": ("kvtierd_promoted_blocks_total", {"outcome": "failed"}),
    "promotion_no_room": ("kvtierd_promotion_no_room_total", {}),
    "checksum_failures": ("kvtierd_checksum_failures_total", {}),
    "integrity_failures": ("kvtierd_integrity_failures_total", {}),
    "queued_bytes": ("kvtierd_queue_bytes", {}),
    "nodes_known": ("kvtierd_remote_nodes", {"state": "known"}),
    "nodes_reachable": ("kvtierd_remote_nodes", {"state": "reachable"}),
    "round_trip_us": ("kvtierd_remote_round_trip_microseconds", {}),
    "server_capacity_bytes": ("kvtierd_remote_server_bytes", {"kind": "capacity"}),
    "server_used_bytes": ("kvtierd_remote_server_bytes", {"kind": "used"}),
    "probe_failures": ("kvtierd_remote_probe_failures_total", {}),
    "foreign_files_found": ("kvtierd_shared_foreign_files_total", {}),
    "shared_rechecks": ("kvtierd_shared_rechecks_total", {}),
    "shared_rescans": ("kvtierd_shared_rescans_total", {}),
    "shared_files_vanished": ("kvtierd_shared_files_vanished_total", {}),
    "probes": ("kvtierd_remote_probes_total", {}),
    "lookup_waits": ("kvtierd_remote_lookup_waits_total", {}),
    "lookup_wait_timeouts": ("kvtierd_remote_lookup_wait_timeouts_total", {}),
    "admitted_blocks": ("kvtierd_tier_admitted_blocks_total", {}),
    "admitted_bytes": ("kvtierd_tier_admitted_bytes_total", {}),
    "rejected_not_reused_blocks": ("kvtierd_tier_rejected_blocks_total", {"reason": "not_reused"}),
    "rejected_infrequent_blocks": ("kvtierd_tier_rejected_blocks_total", {"reason": "infrequent"}),
    "rejected_budget_blocks": ("kvtierd_tier_rejected_blocks_total", {"reason": "budget"}),
    "admission_sketch_bytes": ("kvtierd_tier_admission_sketch_bytes", {}),
}
NUMERIC_FIELDS = [
    f.name
    for f in pb2.TierStats.DESCRIPTOR.fields
    if f.name not in ("tier", "medium", "ready", "admission")  # "admission": a policy's name
]


@pytest.fixture(scope="module")
def metered(tmp_path_factory) -> Iterator[tuple[DaemonProcess, str]]:
    root = tmp_path_factory.mktemp("fs")
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--metrics-address", address, config=fs_tiers_config(root))
    try:
        yield daemon, f"http://{address}/metrics"
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_view(samples, pool: str, tier: str) -> dict[str, int]:
    """The TierStats fields of ``tier`` as the metrics endpoint tells them."""
    table = {**BOTH, **(PRIMARY if tier == "primary" else SECONDARY)}
    view = {}
    for field, (name, extra) in table.items():
        labels = {"pool": pool, **extra}
        if not (tier == "primary" and field in PRIMARY):
            labels["tier"] = tier
        key = (name, tuple(sorted(labels.items())))
        assert key in samples, f"{field}: no sample {key}"
        view[field] = int(samples[key])
    return view


def test_every_tier_stats_field_has_a_metric():
    mapped = {*BOTH, *PRIMARY, *SECONDARY}
    assert sorted(mapped) == sorted(NUMERIC_FIELDS)


def test_getstats_metrics_and_kvtierctl_agree_after_promotions(metered, pool_name):
    """Scenario: four blocks stored, cascaded to fs0 and flushed from the primary;
    one Batch looks them up three times while their promotion is in flight (every
    answer HIT_PENDING); once promoted, a pinning Lookup answers HIT and pins them,
    two pins are released as loads and two unused; a PrepareLoad loads one more. Two
    more fs blocks lie behind a missing key of a prefix Lookup: the tier is not
    asked about them."""
    daemon, url = metered
    stub = daemon.stub()
    promoted = [f"p{i}".encode() for i in range(4)]
    behind = [b"b0", b"b1"]
    answers: Counter[LookupResult] = Counter()
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=8)
        session.prepare_store(promoted + behind)
        session.complete_store(promoted + behind)
        wait_tier_jobs(stub, pool_name)
        assert client.flush_pool(pool_name) == 6

        # one event-loop turn: the promotion cannot finish between the three lookups
        chain = [*promoted, b"absent"]
        polls = session.batch([("lookup", chain, {"prefix": True})] * 3)
        assert polls == [[PENDING] * 4 + [MISS]] * 3
        wait_tier_jobs(stub, pool_name)
        results, rows = session.lookup_and_pin(chain, prefix=True)
        assert results == [HIT] * 4 + [MISS] and min(rows[:4]) >= 0
        session.complete_load(promoted[:2])  # read: loads
        session.complete_load(promoted[2:], unused=True)  # never read
        session.prepare_load(promoted[:1])
        session.complete_load(promoted[:1])
        past_the_end = session.lookup([b"absent", *behind], prefix=True)
        assert past_the_end == [MISS] * 3
        for answer in [*(r for poll in polls for r in poll), *results, *past_the_end]:
            answers[answer] += 1

        stats = client.get_stats(pool_name).pools[0]
        samples = scrape(url)
        ctl = subprocess.run(
            [KVTIERCTL, "--address", daemon.address, "stats", "--pool", pool_name, "--json"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        table = subprocess.run(
            [KVTIERCTL, "--address", daemon.address, "stats", "--pool", pool_name],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert ctl.returncode == 0 and table.returncode == 0, ctl.stderr + table.stderr
    (ctl_pool,) = json.loads(ctl.stdout)["pools"]

    primary, fs = stats.tiers
    assert [primary.tier, fs.tier] == ["primary", "fs0"]
    # a hit is a HIT answer; the other answers are counted as what they are
    assert primary.hits == answers[HIT] == 4
    assert primary.hits_pending == answers[PENDING] == 12
    assert primary.misses == answers[MISS] == 7
    assert primary.retries == 0
    # loaded: two lookup pins released as loads + one PrepareLoad; two released unused
    assert primary.bytes_out == 3 * BLOCK and primary.unused_pins == 2
    # the promoted blocks are one fs0 hit each; fs0 missed "absent" once per Lookup
    # that reached it (b0, b1 lie past the prefix's end: not asked)
    assert (fs.hits, fs.misses, fs.promoted_blocks) == (4, 5, 4)
    assert fs.bytes_out == 4 * FILE_BYTES

    for tier, ctl_tier in zip(stats.tiers, ctl_pool["tiers"], strict=True):
        told = {field: getattr(tier, field) for field in NUMERIC_FIELDS}
        by_ctl = {field: int(ctl_tier.get(field, 0)) for field in NUMERIC_FIELDS}
        assert by_ctl == told, tier.tier
        by_metrics = metric_view(samples, pool_name, tier.tier)
        assert by_metrics == {field: told[field] for field in by_metrics}, tier.tier
        for field in set(NUMERIC_FIELDS) - set(by_metrics):  # another tier kind's field
            assert told[field] == 0, (tier.tier, field)
    for result, field in (("hit", "hits"), ("miss", "misses"), ("retry", "retries")):
        name = ("kvtierd_lookups_total", (("pool", pool_name), ("result", result)))
        assert samples[name] == getattr(primary, field)

    header, *rows = (re.split(r"\s{2,}", line.strip()) for line in table.stdout.splitlines())
    shown = {row[1]: dict(zip(header, row, strict=True)) for row in rows}
    assert shown["primary"]["hits"] == "4" and shown["primary"]["pending"] == "12"
    assert shown["primary"]["misses"] == "7" and shown["primary"]["hit%"] == "36.4"
    assert shown["fs0"]["hits"] == "4" and shown["fs0"]["misses"] == "5"


def test_dashboard_and_alerts_compute_hit_rates_from_hit_and_miss_answers():
    """A HIT_PENDING answer is not a hit (a client polling a promotion would count it
    many times): every hit rate the deploy files compute is HIT / (HIT + MISS)."""
    deploy = Path(__file__).resolve().parents[3] / "deploy"
    dashboard = (deploy / "grafana" / "kvtierd-dashboard.json").read_text()
    alerts = (deploy / "prometheus" / "alerts.yml").read_text()
    queries = [t["expr"] for p in json.loads(dashboard)["panels"] for t in p.get("targets", [])]
    assert [q for q in queries if "hit_pending" in q] == []
    assert sum('result="hit"' in q for q in queries) == 1  # the overall hit rate
    assert "hit_pending" not in alerts  # no query of any alert counts it
    assert alerts.count('kvtierd_lookups_total{result="hit"}') == 2  # today and yesterday
