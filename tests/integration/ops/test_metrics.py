"""The Prometheus endpoint of a real daemon, parsed with prometheus_client's own
text parser: values move as operations are performed."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import (
    DaemonProcess,
    free_port,
    fs_tiers_config,
    scrape,
    start_daemon,
    value,
    wait_tier_jobs,
)

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import InvalidArgument

BLOCK = 8192


@pytest.fixture(scope="module")
def metered(tmp_path_factory) -> Iterator[tuple[DaemonProcess, str]]:
    root = tmp_path_factory.mktemp("fs")
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--metrics-address", address, config=fs_tiers_config(root))
    try:
        yield daemon, f"http://{address}"
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_counters_follow_operations(metered, pool_name):
    daemon, url = metered
    pool = pool_name
    keys = [f"k{i}".encode() for i in range(5)]
    with Client(daemon.address) as client:
        session = client.open_session(pool, block_bytes=BLOCK, num_blocks=8)
        before = scrape(url)
        session.prepare_store(keys)
        session.complete_store(keys)
        wait_tier_jobs(daemon.stub(), pool)
        assert session.lookup([*keys[:2], b"absent"]) == [LookupResult.HIT] * 2 + [
            LookupResult.MISS
        ]
        with pytest.raises(InvalidArgument):
            session.lookup([b""])
        after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    primary = {"pool": pool, "tier": "primary"}
    fs = {"pool": pool, "tier": "fs0"}
    assert delta("kvtierd_stored_bytes_total", **primary) == 5 * BLOCK
    assert delta("kvtierd_stored_bytes_total", **fs) == 5 * (BLOCK + 4096)
    assert delta("kvtierd_cascade_blocks_total", **fs) == 5
    assert delta("kvtierd_tier_jobs_finished_total", **fs, kind="cascade") == 1
    assert value(after, "kvtierd_tier_job_duration_seconds_count", **fs, kind="store") == 1
    assert value(after, "kvtierd_blocks_used", **primary) == 5
    assert value(after, "kvtierd_blocks_used", **fs) == 5
    assert value(after, "kvtierd_blocks_capacity", **primary) == 8
    assert delta("kvtierd_lookups_total", pool=pool, result="hit") == 2
    assert delta("kvtierd_lookups_total", pool=pool, result="miss") == 1
    assert delta("kvtierd_miss_blocks_total", **fs) == 1  # the tier was asked for the miss
    assert delta("kvtierd_rpc_requests_total", method="Lookup", code="OK") == 1
    assert delta("kvtierd_rpc_requests_total", method="Lookup", code="INVALID_ARGUMENT") == 1
    assert delta("kvtierd_rpc_duration_seconds_count", method="CompleteStore") == 1
    assert value(after, "kvtierd_region_bytes", pool=pool) == 8 * BLOCK
    assert value(after, "kvtierd_sessions_open") >= 1
    assert value(after, "kvtierd_build_info", version=_version()) == 1


def test_promotions_and_flush_show_up(metered, pool_name):
    daemon, url = metered
    keys = [f"p{i}".encode() for i in range(3)]
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=4)
        session.prepare_store(keys)
        session.complete_store(keys)
        wait_tier_jobs(daemon.stub(), pool_name)
        assert client.flush_pool(pool_name) == 3
        assert session.lookup(keys) == [LookupResult.HIT_PENDING] * 3
        wait_tier_jobs(daemon.stub(), pool_name)
        samples = scrape(url)
    fs = {"pool": pool_name, "tier": "fs0"}
    assert value(samples, "kvtierd_promoted_blocks_total", **fs, outcome="loaded") == 3
    assert value(samples, "kvtierd_tier_jobs_started_total", **fs, kind="promotion") == 1
    assert value(samples, "kvtierd_evictions_total", pool=pool_name, tier="primary") == 3
    assert value(samples, "kvtierd_loaded_bytes_total", **fs) == 3 * (BLOCK + 4096)


def test_unknown_path_is_404(metered):
    _, url = metered
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url + "/nope", timeout=10)
    assert info.value.code == 404


def test_busy_metrics_port_refuses_to_start(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            AssertionError, match=r"(?s)exited with 2.*metrics_address: cannot listen"
        ):
            start_daemon("--metrics-address", f"127.0.0.1:{port}")


def _version() -> str:
    from kvtierd import __version__

    return __version__
