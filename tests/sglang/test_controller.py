"""SGLang's real ``HiCacheController`` on the CPU, with kvtierd as its storage backend.

How far it goes: the controller is built as SGLang's scheduler builds it (its
``attach_storage_backend`` creates the backend through ``StorageBackendFactory``,
registers the host pool and picks the zero-copy functions for ``interface_v1``), and
its own storage threads run: the backup thread stores with ``batch_set_v1``, the
prefetch thread hashes the tokens and asks ``batch_exists`` (then MIN-reduces over
its gloo groups), the prefetch-I/O thread loads with ``batch_get_v1`` and the sync
thread acknowledges. The test plays the scheduler between them (it allocates the
host pages of a hit, as the radix cache does); the GPU side (the device KV pool and
the GPU<->host copies) is not exercised: a stand-in device pool carries the two
attributes the controller reads from it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from daemon_harness import DaemonProcess, eventually, free_port, start_daemon

from benchmarks import sglang_env as env


class _DevicePool:
    """The two things the controller reads from the (GPU) device pool at start."""

    device = torch.device("cpu")
    layer_num = 2

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class _Allocator:
    def __init__(self) -> None:
        self.pool = _DevicePool()

    def get_kvcache(self) -> _DevicePool:
        return self.pool


@pytest.fixture(scope="module")
def parallel() -> Iterator[None]:
    """One rank (a gloo group of one), as SGLang's scheduler publishes it."""
    from sglang.srt.runtime_context import get_parallel

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_tp_size=1,
        attn_dp_rank=0, attn_dp_size=1, attn_cp_rank=0, attn_cp_size=1, attn_dcp_rank=0,
        attn_dcp_size=1, enable_dp_attention=False,
    )  # fmt: skip
    yield
    get_parallel().clear_stamp()
    dist.destroy_process_group()


@dataclass(frozen=True)
class _Events:
    daemon: DaemonProcess  # publishes pool llama/tp0of1's KV events at ``router_endpoint``
    router_endpoint: str
    engine_endpoint: str  # where SGLang's own ``publisher`` binds
    publisher: Any


@pytest.fixture
def events(tmp_path) -> Iterator[_Events]:
    """A daemon with ``[kv_events]`` on, and SGLang's own ``ZmqEventPublisher`` (what a
    backend's ``kvtierd_engine_events`` listens to)."""
    from sglang.srt.disaggregation.kv_events import ZmqEventPublisher

    router_endpoint = f"ipc://{tmp_path}/daemon-events"
    daemon = start_daemon(
        "--memory-budget", "256MiB",
        config=f'[kv_events]\nendpoint = "{router_endpoint}"\npools = ["llama/tp0of1"]\n'
        'model = "m"\n',
    )  # fmt: skip
    try:
        engine_endpoint = f"ipc://{tmp_path}/kv-events"
        publisher = ZmqEventPublisher(attn_dp_rank=0, endpoint=engine_endpoint)
        try:
            yield _Events(daemon, router_endpoint, engine_endpoint, publisher)
        finally:
            publisher.shutdown()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def _wait_subscribed(events: _Events, describer: Any) -> None:
    """Publishes empty batches until the backend's listener has one: a subscriber
    misses what is published before it joins."""
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    def subscribed() -> bool:
        events.publisher.publish(KVEventBatch(ts=0.0, events=[]))
        return describer.listener.messages > 0

    eventually(subscribed, 30, "SGLang's publisher reached the backend")


def _controller(address: str, **extra: Any) -> tuple[Any, Any]:
    from sglang.srt.managers.cache_controller import HiCacheController

    host = env.mha_host_pool("page_first", device_tokens=256)
    config = {**env.EXTRA_CONFIG, "kvtierd_address": address, **extra}
    ctrl = HiCacheController(
        _Allocator(), host, host.page_size, dist.group.WORLD, threading.Event(),
        io_backend="direct", storage_backend="dynamic", model_name="test-org/tiny",
        storage_backend_extra_config=config,
    )  # fmt: skip
    return ctrl, host


def _backup(ctrl: Any, host: Any, tokens: list[int]) -> int:
    """Stores the host pages holding ``tokens`` through the controller's backup thread;
    returns the tokens it reports stored."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    slots = host.alloc(len(tokens))
    pages = (slots[:: host.page_size] // host.page_size).tolist()
    env.fill_pages(host, pages, seed=len(tokens))
    keys = get_storage_hash_str(tokens, None, page_size=host.page_size)
    ctrl.write_storage(slots, tokens, hash_value=keys)
    op = ctrl.ack_backup_queue.get(timeout=60)
    ctrl.host_pages = pages  # for the test's comparison
    return int(op.completed_tokens)


def _prefetch(ctrl: Any, host: Any, tokens: list[int]) -> tuple[int, int, list[int]]:
    """A prefetch of ``tokens``: the controller's prefetch thread finds the hit, the
    test allocates host pages for it (the scheduler's part), the I/O and sync threads
    load and acknowledge. Returns (tokens found, tokens loaded, host pages)."""
    op = ctrl.prefetch("req-1", tokens)
    found = ctrl.prefetch_hit_queue.get(timeout=60)
    assert found is op
    if op.storage_hit_count == 0:
        return 0, 0, []
    op.host_indices = host.alloc(op.storage_hit_count)
    ctrl.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = ctrl.ack_prefetch_queue.get(timeout=60)
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        if ack.completed_req:
            break
    pages = (op.host_indices[:: host.page_size] // host.page_size).tolist()
    return op.storage_hit_count, loaded, pages


def test_hicache_controller_threads_share_pages_through_kvtierd(daemon, parallel):
    a, host_a = _controller(daemon.address)
    b, host_b = _controller(daemon.address)
    assert type(a.storage_backend).__name__ == "KvtierdStorage"
    assert a.page_get_func.__name__ == "_page_get_zero_copy"  # interface_v1
    tokens = list(range(40))  # 10 pages of 4 tokens
    assert _backup(a, host_a, tokens) == 40
    found, loaded, pages = _prefetch(b, host_b, tokens + [999, 998])  # one partial page more
    assert (found, loaded) == (40, 40)
    assert [env.page_bytes(host_b, p) for p in pages] == [
        env.page_bytes(host_a, p) for p in a.host_pages
    ]
    for ctrl in (a, b):
        ctrl.detach_storage_backend()


def test_hicache_controller_runs_on_without_a_daemon(parallel, tmp_path, caplog):
    """A wrong address: one ERROR line at attach; the controller's threads keep running,
    every backup stores nothing and every prefetch finds nothing."""
    address = f"unix://{tmp_path}/nobody.sock"
    ctrl, host = _controller(address)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(address in m and "kvtierd_address" in m for m in errors), errors
    assert _backup(ctrl, host, list(range(16))) == 0
    assert _prefetch(ctrl, host, list(range(16))) == (0, 0, [])
    assert all(t.is_alive() for t in (ctrl.prefetch_thread, ctrl.backup_thread))
    ctrl.detach_storage_backend()


def test_the_daemon_announces_backed_up_pages_with_the_tokens_sglang_published(parallel, events):
    """``kvtierd_events = "daemon"``: SGLang's radix cache caches a prompt and
    publishes it (its own ``KVCacheEventRecorder`` and ``ZmqEventPublisher``); the
    controller's backup thread stores its pages, and the daemon's ``[kv_events]``
    publisher announces each (medium CPU) with its tokens and the 64-bit hash SGLang's
    events gave it (modulo 2**64), read as a router reads them."""
    from kv_events_harness import EventReader
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ctrl, host = _controller(
        events.daemon.address, kvtierd_pool="llama", kvtierd_events="daemon",
        kvtierd_engine_events=events.engine_endpoint,
    )  # fmt: skip
    page = host.page_size
    tokens = list(range(500, 500 + 10 * page))
    try:
        backend = ctrl.storage_backend
        assert backend.statistics().pool == "llama/tp0of1"
        describer = backend.describer
        _wait_subscribed(events, describer)
        cache = RadixCache.create_simulated(page_size=page, enable_kv_cache_events=True)
        cache.insert(InsertParams(key=RadixKey(tokens), value=torch.arange(len(tokens))))
        published_events = cache.take_events()
        events.publisher.publish(KVEventBatch(ts=0.0, events=published_events))
        eventually(lambda: describer.index.statistics().blocks == 10, 30, "SGLang's events")
        with EventReader(events.router_endpoint) as router:
            assert _backup(ctrl, host, tokens) == len(tokens)
            announced = router.until(lambda ev: len(_cpu_stores(ev)) >= 10)
    finally:
        ctrl.detach_storage_backend()

    stored = [e for e in published_events if isinstance(e, BlockStored)]
    published = [h & ((1 << 64) - 1) for e in stored for h in e.block_hashes]
    keys = get_storage_hash_str(tokens, None, page_size=page)
    hashes = [int(key[:16], 16) for key in keys]
    assert hashes == published  # a page key names the hash SGLang publishes for it
    assert [
        (e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"])
        for e in _cpu_stores(announced)
    ] == [
        ([hashes[i]], hashes[i - 1] if i else None, tokens[i * page : (i + 1) * page], page)
        for i in range(10)
    ]
    assert describer.counters.undescribed == 0


def test_pages_another_node_stored_undescribed_are_announced_once_loaded(parallel, events):
    """Controller A stores a prompt's pages undescribed (its ``kvtierd_events`` is
    "engine": as another node storing in a shared tier); the daemon announces none.
    Controller B (``"daemon"``) prefetches them, SGLang's radix cache caches them and
    publishes them with their tokens, and B's next backup describes them with its
    queued completions: the daemon announces each page (medium CPU) with its tokens."""
    from kv_events_harness import EventReader
    from sglang.srt.disaggregation.kv_events import KVEventBatch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    a, host_a = _controller(events.daemon.address, kvtierd_pool="llama")
    b, host_b = _controller(
        events.daemon.address, kvtierd_pool="llama", kvtierd_events="daemon",
        kvtierd_engine_events=events.engine_endpoint,
    )  # fmt: skip
    page = host_b.page_size
    tokens = list(range(700, 700 + 10 * page))
    try:
        describer = b.storage_backend.describer
        _wait_subscribed(events, describer)
        with EventReader(events.router_endpoint) as router:
            assert _backup(a, host_a, tokens) == len(tokens)
            assert _prefetch(b, host_b, tokens)[1] == len(tokens)
            cache = RadixCache.create_simulated(page_size=page, enable_kv_cache_events=True)
            cache.insert(InsertParams(key=RadixKey(tokens), value=torch.arange(len(tokens))))
            events.publisher.publish(KVEventBatch(ts=0.0, events=cache.take_events()))
            eventually(lambda: describer.index.statistics().blocks == 10, 30, "SGLang's events")
            _backup(b, host_b, list(range(900, 900 + page)))  # B's next store
            announced = router.until(lambda ev: len(_cpu_stores(ev)) >= 10)
    finally:
        for ctrl in (a, b):
            ctrl.detach_storage_backend()

    keys = get_storage_hash_str(tokens, None, page_size=page)
    hashes = [int(key[:16], 16) for key in keys]
    assert sorted(
        (e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in _cpu_stores(announced)
    ) == sorted(
        ([hashes[i]], hashes[i - 1] if i else None, tokens[i * page : (i + 1) * page])
        for i in range(10)
    )
    assert (describer.counters.described_late, describer.counters.undescribed_loads) == (10, 0)


def _cpu_stores(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
