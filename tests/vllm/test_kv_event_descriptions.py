"""Stores described for KV-event routers (``kvtierd_events = "daemon"``).

vLLM's own ``Scheduler`` (``engine_free.SchedulerLoop``) publishes its GPU blocks with
its own ``ZmqEventPublisher``; the plug-in's manager subscribes, decodes them with
vLLM's event classes and sends each stored key's tokens and 64-bit hashes with its
``complete_store``; the daemon's ``[kv_events]`` publisher announces them (read as a
router reads them, ``kv_events_harness``), and vLLM republishes none of the pool's
events. Runs on every supported release (no model)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonProcess, eventually, start_daemon
from engine_free import TOKENS_PER_BLOCK, SchedulerLoop, base_config, with_connector
from kv_events_harness import EventReader

from benchmarks.vllm_model import random_prompt
from kvtierd_client.client import Session
from kvtierd_client.engine_events import BlockIndex, EngineEventListener, StoredBlocks
from kvtierd_client.types import BlockDescription, hash64

PROMPT_TOKENS = 100  # 6 full blocks of 16 tokens and a tail
FULL_BLOCKS = PROMPT_TOKENS // TOKENS_PER_BLOCK


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Any:
    return base_config(tiny_model)


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/kv-events"


POOL = "llama"


@pytest.fixture
def publishing(tmp_path: Path) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon publishing pool ``llama`` (``[kv_events]``), and its endpoint."""
    endpoint = f"ipc://{tmp_path}/daemon-events"
    config = f'[kv_events]\nendpoint = "{endpoint}"\npools = ["{POOL}"]\nmodel = "m"\n'
    proc = start_daemon("--memory-budget", "512MiB", config=config)
    try:
        yield proc, endpoint
        assert proc.stop() == 0, proc.log()
    finally:
        proc.cleanup()


@pytest.fixture
def make_loop(kvtierd, base, endpoint) -> Iterator[Callable[..., SchedulerLoop]]:
    """``make_loop(publish_at=endpoint, address=kvtierd's, **extra)``: vLLM's
    scheduler with KV events on (published at ``publish_at``) and the plug-in on the
    daemon at ``address``, the manager told where vLLM publishes (unless ``extra``
    says otherwise)."""
    from vllm.config import KVEventsConfig

    loops: list[SchedulerLoop] = []

    def make(
        publish_at: str = endpoint, address: str = kvtierd.address, **extra: Any
    ) -> SchedulerLoop:
        config = with_connector(base, address, **{"kvtierd_engine_events": publish_at, **extra})
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=publish_at)
        loops.append(SchedulerLoop(dataclasses.replace(config, kv_events_config=events)))
        return loops[-1]

    yield make
    for loop in loops:
        loop.shutdown()


@pytest.fixture
def completions(monkeypatch) -> list[tuple[list[bytes], bool, Any]]:
    """Every ``Session.complete_store`` call: (keys, success, descriptions)."""
    calls: list[tuple[list[bytes], bool, Any]] = []
    real = Session.complete_store

    def record(self, keys, success=True, descriptions=None):  # type: ignore[no-untyped-def]
        calls.append((list(keys), success, descriptions))
        return real(self, keys, success, descriptions)

    monkeypatch.setattr(Session, "complete_store", record)
    return calls


class Published:
    """What vLLM publishes at ``endpoint``, read by a subscriber of the test's own
    (the plug-in's listener class, every event kept, decoded with vLLM's classes)."""

    def __init__(self, endpoint: str) -> None:
        self.events: list[Any] = []
        self.listener = EngineEventListener(endpoint, BlockIndex(1 << 20), self._keep, name="test")
        self.listener.start()

    def _keep(self, payload: bytes) -> Iterable[StoredBlocks]:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self.events.extend(msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events)
        return ()

    def mediums(self) -> set[str]:
        return {e.medium for e in self.events if hasattr(e, "medium")}

    def drain(self, loop: SchedulerLoop) -> None:
        """Returns once everything vLLM published so far has arrived (a marker
        published now arrived: one connection keeps the order)."""
        from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

        loop.scheduler.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        eventually(
            lambda: any(isinstance(e, AllBlocksCleared) for e in self.events), 30, "the marker"
        )

    def close(self) -> None:
        self.listener.close()


def _subscribed(loop: Any, *listeners: EngineEventListener) -> None:
    """Publishes empty batches through vLLM's publisher until every listener got one
    (a ZMQ subscriber misses what is published before it is connected)."""
    from vllm.distributed.kv_events import KVEventBatch

    def arrived() -> bool:
        if all(listener.messages for listener in listeners):
            return True
        loop.scheduler.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=[]))
        return False

    eventually(arrived, 30, "vLLM's publisher reached the subscribers")


def _described(calls: list[tuple[list[bytes], bool, Any]]) -> dict[bytes, BlockDescription | None]:
    out: dict[bytes, BlockDescription | None] = {}
    for keys, success, descriptions in calls:
        if success:
            out.update(zip(keys, descriptions or [None] * len(keys), strict=True))
    return out


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_daemon_announces_each_store_with_the_tokens_and_hashes_vllm_published(
    make_loop, endpoint, publishing, blocks_per_chunk
):
    """Chunks of one and of two GPU blocks: the daemon's ``BlockStored`` (medium
    CPU) of a key carries its blocks' 64-bit hashes (those of vLLM's own GPU
    ``BlockStored`` events), the hash before them, and their tokens."""
    daemon, daemon_events = publishing
    loop = make_loop(
        address=daemon.address, kvtierd_pool=POOL, kvtierd_events="daemon",
        blocks_per_chunk=blocks_per_chunk,
    )  # fmt: skip
    describer = loop.manager.describer
    published = Published(endpoint)
    chunks = FULL_BLOCKS // blocks_per_chunk
    try:
        with EventReader(daemon_events) as router:
            _subscribed(loop, describer.listener, published.listener)
            prompt = random_prompt(PROMPT_TOKENS, seed=21)
            request = loop.add("r", prompt)
            loop.step()  # the prompt's blocks are cached on the GPU and published
            # an engine's step lasts longer than the events take to arrive here: wait so
            eventually(lambda: describer.index.statistics().blocks >= FULL_BLOCKS, 30, "GPU events")
            loop.run()
            announced = router.until(lambda events: len(_cpu_stores(events)) >= chunks)
    finally:
        published.close()

    gpu = [e for e in published.events if e.medium == "GPU" and hasattr(e, "token_ids")]
    gpu_hashes = [h for e in gpu for h in e.block_hashes]
    hashes = [hash64(h) for h in request.block_hashes[:FULL_BLOCKS]]
    assert gpu_hashes == hashes  # vLLM publishes the low 64 bits of its block hashes
    by_last = {e["block_hashes"][-1]: e for e in _cpu_stores(announced)}
    assert len(by_last) == chunks
    for c in range(chunks):
        first, end = c * blocks_per_chunk, (c + 1) * blocks_per_chunk
        event = by_last[hashes[end - 1]]
        assert event["block_hashes"] == hashes[first:end], c
        assert event["parent_block_hash"] == (hashes[first - 1] if first else None), c
        assert event["token_ids"] == prompt[first * TOKENS_PER_BLOCK : end * TOKENS_PER_BLOCK]
        assert event["block_size"] == TOKENS_PER_BLOCK
    assert describer.counters.undescribed == 0


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_blocks_another_engine_stored_undescribed_are_announced_once_loaded(
    make_loop, publishing, tmp_path, blocks_per_chunk
):
    """Engine A stores a prompt's blocks undescribed (its ``kvtierd_events`` is
    "engine": as another node storing in a shared tier); the daemon announces none.
    Engine B (``"daemon"``) loads them: vLLM caches them on B's GPU and publishes
    them with their tokens, and at a later step end B's manager describes them with
    its queued completions: the daemon announces each key (medium CPU) with B's
    tokens and 64-bit hashes, and B describes each key once."""
    daemon, daemon_events = publishing
    extra = {"address": daemon.address, "kvtierd_pool": POOL, "blocks_per_chunk": blocks_per_chunk}
    a = make_loop(publish_at=f"ipc://{tmp_path}/a-events", **extra)
    b = make_loop(kvtierd_events="daemon", **extra)
    describer = b.manager.describer
    chunks = FULL_BLOCKS // blocks_per_chunk
    prompt = random_prompt(PROMPT_TOKENS, seed=25)
    with EventReader(daemon_events) as router:
        a.add("a", prompt)
        a.run()
        for _ in range(3):  # A's last completions reach the daemon
            a.step()
        _subscribed(b, describer.listener)
        request = b.add("b", prompt)
        b.run()
        assert b.manager.counters.ops["CompleteLoad"] > 0  # B loaded A's blocks
        eventually(lambda: describer.index.statistics().blocks >= FULL_BLOCKS, 30, "GPU events")
        for _ in range(2):  # a step end takes the descriptions (its queue is sent at once)
            b.step()
        announced = router.until(lambda events: len(_cpu_stores(events)) >= chunks)
    hashes = [hash64(h) for h in request.block_hashes[:FULL_BLOCKS]]
    chain = _in_prefix_order(_cpu_stores(announced))
    assert [h for e in chain for h in e["block_hashes"]] == hashes
    assert [t for e in chain for t in e["token_ids"]] == prompt[: FULL_BLOCKS * TOKENS_PER_BLOCK]
    assert len(_cpu_stores(announced)) == chunks
    counters = describer.counters
    assert (counters.described, counters.described_late, counters.undescribed_loads) == (
        0, chunks, 0,
    )  # fmt: skip


def _cpu_stores(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]


@pytest.mark.parametrize(("mode", "mediums"), [("engine", {"GPU", "CPU"}), ("daemon", {"GPU"})])
def test_with_the_daemon_publishing_vllm_republishes_none_of_the_pools_events(
    make_loop, endpoint, mode, mediums
):
    """``kvtierd_events = "daemon"``: vLLM publishes its GPU blocks only; with the
    default (``"engine"``) it also publishes the pool's stores (medium CPU)."""
    loop = make_loop(kvtierd_events=mode)
    published = Published(endpoint)
    try:
        _subscribed(loop, published.listener)
        loop.add("r", random_prompt(PROMPT_TOKENS, seed=22))
        loop.run()
        for _ in range(3):  # the last completions reach the daemon, vLLM takes the events
            loop.step()
        published.drain(loop)
    finally:
        published.close()
    assert published.mediums() == mediums


def test_a_key_whose_blocks_vllm_never_published_is_sent_undescribed(make_loop, completions):
    """The describer listens at an endpoint where nothing publishes: the stores go
    through, without descriptions."""
    loop = make_loop(kvtierd_events="daemon", kvtierd_engine_events="ipc:///nonexistent/x")
    loop.add("r", random_prompt(PROMPT_TOKENS, seed=23))
    loop.run()
    described = _described(completions)
    assert len(described) == FULL_BLOCKS
    assert set(described.values()) == {None}
    assert loop.manager.describer.counters.undescribed == FULL_BLOCKS


@pytest.mark.engine  # a real vLLM engine: vLLM's CPU build (make test-vllm)
def test_a_real_engine_s_stores_are_announced_with_their_prompt_tokens(
    tiny_model, publishing, tmp_path
):
    """vLLM's CPU engine (in-process) with its KV events on and the plug-in on a
    publishing daemon: every full block of the prompt is announced by the daemon
    (medium CPU) with the prompt's tokens, and vLLM itself publishes only GPU blocks."""
    from vllm import LLM
    from vllm.config import KVEventsConfig
    from vllm_e2e import TOKENS_PER_BLOCK as BLOCK
    from vllm_e2e import generate, kv_transfer_config, manager_of, shutdown_llm

    from benchmarks.vllm_model import llm_kwargs

    daemon, daemon_events = publishing
    engine_events = f"ipc://{tmp_path}/engine-events"
    transfer = kv_transfer_config(
        daemon.address, kvtierd_pool=POOL, kvtierd_events="daemon",
        kvtierd_engine_events=engine_events,
    )  # fmt: skip
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=engine_events)
    prompt = random_prompt(5 * BLOCK + 20, seed=24)  # 5 full blocks and a tail
    llm = LLM(**llm_kwargs(tiny_model, transfer), kv_events_config=events)
    engine = Published(engine_events)
    try:
        with EventReader(daemon_events) as router:
            describer = manager_of(llm).describer
            _subscribed(_EngineLoop(llm), describer.listener, engine.listener)
            generate(llm, prompt, max_tokens=4)
            announced = router.until(lambda events: len(_cpu_stores(events)) >= 5)
            counters = describer.counters
    finally:
        engine.close()
        shutdown_llm(llm)
    tokens = [t for e in _in_prefix_order(_cpu_stores(announced)) for t in e["token_ids"]]
    assert tokens == prompt[: 5 * BLOCK]
    assert (counters.described, counters.undescribed) == (5, 0)
    assert engine.mediums() == {"GPU"}


def _in_prefix_order(stores: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stores chained by their parent hashes, from the prompt's first block (one
    ``CompleteStore`` announces its keys in no particular order)."""
    after = {e["parent_block_hash"]: e for e in stores}
    chain, parent = [], None
    while parent in after:
        chain.append(after[parent])
        parent = chain[-1]["block_hashes"][-1]
    return chain


class _EngineLoop:
    """What :func:`_subscribed` needs of an in-process engine: its scheduler."""

    def __init__(self, llm: Any) -> None:
        self.scheduler = llm.llm_engine.engine_core.engine_core.scheduler
