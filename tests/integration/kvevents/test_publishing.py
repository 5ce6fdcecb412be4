"""The daemon's KV-event publisher (``[kv_events]``) as a router sees it: a real
daemon, a real ZeroMQ subscriber (tests/kv_events_harness.py), blocks stored with
their engines' descriptions through the real client library."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import grpc
import pytest
from daemon_harness import (
    DaemonProcess,
    eventually,
    free_port,
    fs_tiers_config,
    scrape,
    start_daemon,
)
from kv_events_harness import EventReader

from kvtierd_client.client import Client
from kvtierd_client.types import BlockDescription
from kvtierd_client.wire.proto import pb2

BLOCK = 4096
POOL = "llama"


def stop(daemon: DaemonProcess) -> None:
    try:
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def describe(n: int, parent: int | None = None, size: int = 4) -> BlockDescription:
    """Block ``n``'s description: hash 1000+n, tokens n*size .. n*size+size-1."""
    return BlockDescription((1000 + n,), parent, tuple(range(n * size, n * size + size)), size)


def key(n: int) -> bytes:
    return f"key-{n}".encode()


@pytest.fixture
def event_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kve-", dir="/tmp")
    yield path
    shutil.rmtree(path)


def events_config(event_dir: str, **extra: str) -> str:
    lines = [
        "[kv_events]",
        f'endpoint = "ipc://{event_dir}/events"',
        f'replay_endpoint = "ipc://{event_dir}/replay"',
        f'pools = ["{POOL}"]',
        'model = "m"',
        'identity = "node-a"',
        *(f"{k} = {v}" for k, v in extra.items()),
    ]
    return "\n".join(lines) + "\n"


def stored(events, medium):  # noqa: ANN001, ANN201
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium]


def removed_hashes(events, medium):  # noqa: ANN001, ANN201
    return [
        h for e in events if e["type"] == "BlockRemoved" and e["medium"] == medium
        for h in e["block_hashes"]
    ]  # fmt: skip


def store(session, numbers, describe_them=True):  # noqa: ANN001, ANN201
    keys = [key(n) for n in numbers]
    grant = session.prepare_store(keys)
    assert grant is not None and grant.keys_to_store == keys
    descriptions = [describe(n, 1000 + n - 1 if n else None) for n in numbers]
    session.complete_store(keys, descriptions=descriptions if describe_them else None)


def test_stores_with_descriptions_are_published_as_vllm_block_stored(event_dir):
    port = free_port()
    before_start_us = time.time_ns() // 1000
    daemon = start_daemon("--metrics-address", f"127.0.0.1:{port}", config=events_config(event_dir))
    try:
        with (
            EventReader(f"ipc://{event_dir}/events", f"ipc://{event_dir}/replay") as reader,
            Client(daemon.address) as client,
        ):
            session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=8)
            store(session, [0, 1])
            store(session, [2], describe_them=False)  # undescribed: published nowhere
            store(session, [3])
            events = reader.until(lambda ev: len(stored(ev, "CPU")) >= 3)
        assert events[0] == {"type": "AllBlocksCleared"}  # the first message, replayed
        cpu = stored(events, "CPU")
        assert [e["block_hashes"] for e in cpu] == [[1000], [1001], [1003]]
        assert cpu[1] | {} == {
            "type": "BlockStored",
            "block_hashes": [1001],
            "parent_block_hash": 1000,
            "token_ids": [4, 5, 6, 7],
            "block_size": 4,
            "lora_id": None,
            "medium": "CPU",
            "lora_name": None,
            "extra_keys": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "locality": "LOCAL",
        }
        assert cpu[0]["parent_block_hash"] is None
        messages = reader.ordered
        first = messages[0].seq  # gap-free from the daemon's start time in microseconds
        assert [m.seq for m in messages] == list(range(first, first + len(messages)))
        assert before_start_us <= first <= time.time_ns() // 1000
        assert {m.topic for m in messages} == {"kv@node-a@m"}
        assert {m.rank for m in messages} == {None}

        # the publisher's process reports its counters every second
        def counted() -> dict | None:
            metrics = scrape(f"http://127.0.0.1:{port}")
            return metrics if metrics.get(("kvtierd_kv_events_described_blocks", ())) == 3 else None

        metrics = eventually(counted, 20, "the publisher's counters")
        assert metrics[("kvtierd_kv_events_undescribed_stores_total", ())] == 1
        assert metrics[("kvtierd_kv_events_events_total", ())] >= 4  # the clear and 3 stores
        assert metrics[("kvtierd_kv_events_dropped_frames_total", ())] == 0
    finally:
        stop(daemon)


def test_each_engine_gets_a_message_with_its_own_topic(event_dir):
    daemon = start_daemon(config=events_config(event_dir, engines='["pod-a", "pod-b"]'))
    try:
        with (
            EventReader(f"ipc://{event_dir}/events", f"ipc://{event_dir}/replay") as reader,
            Client(daemon.address) as client,
        ):
            session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=8)
            store(session, [0])
            reader.until(lambda ev: len(stored(ev, "CPU")) >= 2)
        topics = [m.topic for m in reader.ordered
                  if any(e["type"] == "BlockStored" for e in m.events)]  # fmt: skip
        assert topics == ["kv@pod-a@m", "kv@pod-b@m"]
    finally:
        stop(daemon)


def test_evictions_flushes_and_the_storage_tier_are_published_per_medium(event_dir):
    root = os.path.join(event_dir, "fs")
    os.mkdir(root)
    daemon = start_daemon(config=events_config(event_dir) + fs_tiers_config(root))
    try:
        with (
            EventReader(f"ipc://{event_dir}/events", f"ipc://{event_dir}/replay") as reader,
            Client(daemon.address) as client,
        ):
            session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=2)
            store(session, [0, 1])
            reader.until(lambda ev: len(stored(ev, "STORAGE")) >= 2)  # cascaded
            store(session, [2, 3])  # evicts 0 and 1 from the primary
            events = reader.until(lambda ev: len(removed_hashes(ev, "CPU")) >= 2)
            assert sorted(removed_hashes(events, "CPU")) == [1000, 1001]
            assert removed_hashes(events, "STORAGE") == []  # the fs tier still holds them
            reader.until(lambda ev: len(stored(ev, "STORAGE")) >= 4)  # 2 and 3 unpinned
            assert client.flush_pool(POOL) == 2
            events = reader.until(lambda ev: len(removed_hashes(ev, "CPU")) >= 4)
        assert sorted(removed_hashes(events, "CPU")) == [1000, 1001, 1002, 1003]
        storage = [e["block_hashes"][0] for e in stored(events, "STORAGE")]
        assert sorted(storage[:2]) == [1000, 1001]
    finally:
        stop(daemon)


def test_a_bad_description_is_refused_and_changes_nothing(event_dir):
    daemon = start_daemon(config=events_config(event_dir))
    try:
        with Client(daemon.address) as client:
            session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=8)
            grant = session.prepare_store([key(0)])
            assert grant is not None
            bad = BlockDescription((1,), None, (1, 2, 3), 4)  # 3 tokens for a block of 4
            with pytest.raises(ValueError, match=r"descriptions\[0\] has 3 token_ids"):
                session.complete_store([key(0)], descriptions=[bad])
            # the same through the wire, past the client's check
            stub_request = pb2.CompleteStoreRequest(
                session_id=session.session_id,
                keys=[key(0)],
                success=True,
                descriptions=[pb2.BlockDescription(block_hashes=[1], token_ids=[1], block_size=4)],
            )
            with pytest.raises(grpc.RpcError) as refused:
                client._stub.CompleteStore(stub_request)  # noqa: SLF001
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "descriptions[0] has 1 token_ids" in refused.value.details()
            assert session.lookup([key(0)])[0].name == "HIT_PENDING"  # still reserved
            session.complete_store([key(0)], descriptions=[describe(0)])
            assert session.lookup([key(0)])[0].name == "HIT"
    finally:
        stop(daemon)


def test_a_warm_restart_clears_then_re_announces_what_survived(event_dir):
    config = events_config(event_dir) + "[memory]\nwarm_restart = true\n"
    daemon = start_daemon(config=config)
    try:
        with Client(daemon.address) as client:
            session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=8)
            store(session, [0, 1, 2])
            session.close()
        assert daemon.stop() == 0, daemon.log()
        daemon = daemon.restart()
        with (
            EventReader(f"ipc://{event_dir}/events", f"ipc://{event_dir}/replay") as reader,
            Client(daemon.address) as client,
        ):
            client.open_session(POOL, block_bytes=BLOCK, num_blocks=8)
            events = reader.until(lambda ev: len(stored(ev, "CPU")) >= 3)
        assert events[0] == {"type": "AllBlocksCleared"}
        assert sorted(e["block_hashes"][0] for e in stored(events, "CPU")) == [1000, 1001, 1002]
        assert stored(events, "CPU")[1]["token_ids"] in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])
    finally:
        stop(daemon)


def test_an_ipc_endpoint_in_a_directory_others_may_write_stops_the_start(event_dir):
    os.chmod(event_dir, 0o777)  # another user could swap the socket routers connect to
    daemon = start_daemon(config=events_config(event_dir), wait=False)
    try:
        assert daemon.proc.wait(30) == 2
        log = daemon.log()
        assert "kv_events.endpoint" in log and "writable by other users" in log, log
    finally:
        daemon.cleanup()
