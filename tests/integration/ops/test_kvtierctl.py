"""kvtierctl against a live daemon (output and exit codes) and against a dead socket."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator

import pytest
from daemon_harness import (
    KVTIERCTL,
    DaemonProcess,
    ctl,
    fs_tiers_config,
    start_daemon,
    wait_tier_jobs,
)

from kvtierd_client.client import Client

BLOCK = 4096


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("fs")
    daemon = start_daemon(config=fs_tiers_config(root))
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


@pytest.fixture
def stored(tiered, pool_name) -> Iterator[tuple[Client, str]]:
    client = Client(tiered.address)
    session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=2, layout="ctl")
    session.prepare_store([b"alpha", b"beta"])
    session.complete_store([b"alpha", b"beta"])
    wait_tier_jobs(tiered.stub(), pool_name)
    session.prepare_store([b"gamma"])  # evicts alpha (least recently used)
    session.complete_store([b"gamma"])
    wait_tier_jobs(tiered.stub(), pool_name)
    yield client, pool_name
    client.close()


def test_status_lists_pools_and_tiers(tiered, stored):
    _, pool = stored
    result = ctl(tiered.address, "status")
    assert result.returncode == 0, result.stderr
    assert "kvtierd " in result.stdout and "sessions" in result.stdout
    assert f"pool {pool}: 2 blocks x 4.0 KiB, lru" in result.stdout
    assert "  primary    2/2 blocks" in result.stdout
    assert "  fs0        3/" in result.stdout


def test_stats_table_and_json(tiered, stored):
    _, pool = stored
    table = ctl(tiered.address, "stats", "--pool", pool)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["pool", "tier", "used", "capacity"]
    assert [row.split()[1] for row in rows] == ["primary", "fs0"]
    as_json = ctl(tiered.address, "stats", "--pool", pool, "--json")
    data = json.loads(as_json.stdout)
    (pool_stats,) = data["pools"]
    assert pool_stats["name"] == pool
    assert pool_stats["tiers"][1]["cascade_blocks"] == "3"  # uint64 as a JSON string


def test_explain_flush_and_watch(tiered, stored):
    client, pool = stored
    evicted = ctl(tiered.address, "explain", pool, "alpha")
    assert evicted.returncode == 0, evicted.stderr
    assert "held by tier fs0: the next Lookup promotes it" in evicted.stdout
    assert "primary: evicted: least recently used, to make room" in evicted.stdout
    never = ctl(tiered.address, "explain", pool, "6e6f7065", "--hex")  # b"nope"
    assert "MISS: never stored" in never.stdout

    watcher = subprocess.Popen(
        [KVTIERCTL, "--address", tiered.address, "watch", pool, "--count", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = threading.Event()
    threading.Timer(1.0, started.set).start()
    started.wait()  # the stream is open before the flush
    flushed = ctl(tiered.address, "flush", pool)
    assert flushed.returncode == 0, flushed.stderr
    assert f"pool {pool}: 2 blocks evicted" in flushed.stdout
    out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err
    assert " removed cpu/primary 2 keys: " in out
    assert "flushed (FlushPool)" in ctl(tiered.address, "explain", pool, "beta").stdout


def test_daemon_errors_are_one_readable_line(tiered):
    result = ctl(tiered.address, "flush", "no-such-pool")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "kvtierctl flush: NOT_FOUND: pool 'no-such-pool' does not exist" in result.stderr


@pytest.mark.parametrize("command", [["status"], ["stats"], ["flush", "p"], ["explain", "p", "k"]])
def test_dead_socket_is_a_clear_error(tmp_path, command):
    result = ctl(f"unix://{tmp_path}/gone.sock", *command)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr and "Traceback" not in result.stderr
