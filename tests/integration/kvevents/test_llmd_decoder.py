"""What llm-d's precise prefix-cache scorer reads of the daemon's KV events, decoded by
the rules of llm-d's own decoder, from what a real daemon publishes.

llm-d (Go) cannot be built here, so this file carries a small decoder that follows
llm-d-kv-cache's ``pkg/kvevents`` at commit 7be76e119ca50c5700b3bca65a19b6a0218a9b62
(2026-06-12) rule for rule:

- ``zmq_subscriber.go`` (``runSubscriber``): a message is exactly 3 frames, else skipped;
  the sequence is the first 8 bytes of frame 2, big-endian (shorter: skipped); llm-d's
  SUB binds (``connect = true`` on the daemon) and subscribes to the topic prefix ``kv@``.
- ``engineadapter/common.go``: ``parseTopic`` splits the topic on ``@``; exactly 3 parts
  give (pod, model) = (parts[1], parts[2]), anything else (topic, ""). ``getHashAsUint64``
  takes a Go ``uint64`` or ``int64`` (as uint64) or ``[]byte`` (its last 8 bytes
  big-endian; shorter ones left-padded; empty: an error) and nothing else.
- ``engineadapter/vllm_adapter.go``: the payload is the array ``[ts float64, events,
  data_parallel_rank *int]``; an event is positional ``[tag, ...]`` with ``BlockStored``
  fields [1] block_hashes, [2] parent (nil: 0), [3] token_ids (uint32), [4] block_size,
  [5] lora_id, [6] medium (a string), [7] lora_name, [8] extra_keys, [9] group_idx
  (>= 0), [10] kv_cache_spec_kind, [11] kv_cache_spec_sliding_window (positions 0-4
  required, the rest nil when absent), ``BlockRemoved`` [1] block_hashes, [2] medium,
  [3] group_idx, ``AllBlocksCleared``; any other tag is an error. Since
  llm-d/llm-d-kv-cache#661 (merged after that commit, for vLLM #42892) an event may
  also be a map with its tag under ``"type"``: it is normalized to that positional
  layout by field name, an absent field becoming nil.
- ``pool.go`` (``processEventBatch``): the tier is the medium lower-cased (no medium:
  ``gpu``); a non-empty ``lora_name`` replaces the topic's model; a store with tokens is
  re-hashed into llm-d's own keys, one without only adds its tier to keys seen before.

Values are decoded with Go's types as vmihailenco/msgpack v5 (go.mod: v5.4.1) hands them
to ``[]any``: a positive fixint is an ``int8``, a uint8 code a ``uint8`` and so on, so a
hash sent as a small int is refused as llm-d refuses it.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from daemon_harness import eventually, free_port, start_daemon
from engine_harness import Engine
from kv_events_harness import shipped_config

from kvtierd_client.client import Client
from kvtierd_client.types import BlockDescription, hash64

# -- llm-d's decoder ---------------------------------------------------------------------


class Refused(ValueError):
    """llm-d refuses the message or event (its adapter returns an error)."""


@dataclass(frozen=True)
class GoInt:
    """An integer as Go's msgpack decoder types it in an ``any``."""

    kind: str  # int8 .. int64, uint8 .. uint64
    value: int


_FIXED = {
    0xCC: ("uint8", ">B"), 0xCD: ("uint16", ">H"), 0xCE: ("uint32", ">I"),
    0xCF: ("uint64", ">Q"), 0xD0: ("int8", ">b"), 0xD1: ("int16", ">h"),
    0xD2: ("int32", ">i"), 0xD3: ("int64", ">q"),
}  # fmt: skip


class _GoReader:
    """msgpack into Go's ``any`` values: nil, bool, GoInt, float, str, bytes, list, dict."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise Refused("msgpack: unexpected EOF")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def _len(self, fmt: str) -> int:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def value(self) -> Any:  # noqa: C901 - one branch per msgpack code
        code = self._take(1)[0]
        if code <= 0x7F or code >= 0xE0:  # fixints: Go's int8
            return GoInt("int8", code if code <= 0x7F else code - 0x100)
        if code <= 0x8F:
            return self._map(code & 0x0F)
        if code <= 0x9F:
            return [self.value() for _ in range(code & 0x0F)]
        if code <= 0xBF:
            return self._take(code & 0x1F).decode()
        if code in _FIXED:
            kind, fmt = _FIXED[code]
            return GoInt(kind, struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0])
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if code in simple:
            return simple[code]
        sized = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}
        if code in sized:
            raw = self._take(self._len(sized[code]))
            return raw if code <= 0xC6 else raw.decode()
        if code in (0xCA, 0xCB):
            fmt = ">f" if code == 0xCA else ">d"
            return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]
        if code in (0xDC, 0xDD):
            return [self.value() for _ in range(self._len(">H" if code == 0xDC else ">I"))]
        if code in (0xDE, 0xDF):
            return self._map(self._len(">H" if code == 0xDE else ">I"))
        raise Refused(f"msgpack: code 0x{code:02x} not decoded into any")

    def _map(self, n: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _ in range(n):
            key = self.value()
            if not isinstance(key, str):
                raise Refused(f"msgpack: map key {key!r} is not a string")
            out[key] = self.value()
        return out


def go_decode(data: bytes) -> Any:
    return _GoReader(data).value()


def _to_int(raw: Any, what: str) -> int:  # toInt
    if not isinstance(raw, GoInt):
        raise Refused(f"{what}: unsupported numeric type {type(raw).__name__}")
    return raw.value


def _hash(raw: Any) -> int:  # getHashAsUint64
    if isinstance(raw, GoInt) and raw.kind in ("uint64", "int64"):
        return raw.value & (2**64 - 1)
    if isinstance(raw, bytes):
        if not raw:
            raise Refused("hash byte slice is empty")
        return int.from_bytes(raw[-8:].rjust(8, b"\0"), "big")
    kind = raw.kind if isinstance(raw, GoInt) else type(raw).__name__
    raise Refused(f"unsupported hash type: {kind}")


def _hashes(raw: Any) -> list[int]:
    if not isinstance(raw, list):
        raise Refused(f"block_hashes is not an array: {raw!r}")
    return [_hash(h) for h in raw]


def _string(raw: Any, what: str) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise Refused(f"{what} is not a string: {raw!r}")
    return raw


# llm-d-kv-cache#661: a map event's fields by name, in the positional layout
_MAP_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip


@dataclass(frozen=True)
class LlmdEvent:
    """One event as llm-d's pool applies it to the pod's entries."""

    kind: str  # BlockStored, BlockRemoved, AllBlocksCleared
    tier: str = ""  # medium lower-cased, "gpu" without one
    model: str = ""  # the effective model: lora_name, else the topic's
    engine_keys: tuple[int, ...] = ()
    parent: int = 0
    tokens: tuple[int, ...] = ()
    block_size: int = 0
    group_idx: int | None = None


def _fields(raw: Any) -> list[Any]:  # decodeVLLMEvent (+ #661's map normalization)
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise Refused(f"map event without a string type: {raw!r}")
        if tag not in _MAP_FIELDS:
            raise Refused(f"unknown vLLM event tag: {tag}")
        return [tag, *(raw.get(name) for name in _MAP_FIELDS[tag])]
    if not isinstance(raw, list) or not raw:
        raise Refused("malformed tagged union: no tag")
    if not isinstance(raw[0], str):
        raise Refused(f"event tag is not a string: {raw[0]!r}")
    if raw[0] not in _MAP_FIELDS:
        raise Refused(f"unknown vLLM event tag: {raw[0]}")
    return raw


def _at(fields: list[Any], i: int) -> Any:  # fieldAt
    return fields[i] if i < len(fields) else None


def _group(raw: Any) -> int | None:
    if raw is None:
        return None
    group = _to_int(raw, "group_idx")
    if group < 0:
        raise Refused(f"group_idx: negative value: {group}")
    return group


def _tier(medium: str | None) -> str:
    return medium.lower() if medium else "gpu"


def _event(raw: Any, model: str) -> LlmdEvent:
    fields = _fields(raw)
    tag = fields[0]
    if tag == "AllBlocksCleared":
        return LlmdEvent("AllBlocksCleared")
    if tag == "BlockRemoved":
        if len(fields) < 2:
            raise Refused(f"BlockRemoved: need at least 2 fields, got {len(fields)}")
        medium = _string(_at(fields, 2), "BlockRemoved: medium")
        return LlmdEvent(
            "BlockRemoved", _tier(medium), model, tuple(_hashes(fields[1])),
            group_idx=_group(_at(fields, 3)),
        )  # fmt: skip
    if len(fields) < 5:
        raise Refused(f"BlockStored: need at least 5 fields, got {len(fields)}")
    if not isinstance(fields[3], list):
        raise Refused(f"token_ids is not an array: {fields[3]!r}")
    lora_name = _string(_at(fields, 7), "BlockStored: lora_name")
    if _at(fields, 5) is not None:
        _to_int(fields[5], "BlockStored: lora_id")
    if _at(fields, 8) is not None and not isinstance(fields[8], list):
        raise Refused("BlockStored: extra_keys is not an array")
    _string(_at(fields, 10), "BlockStored: kv_cache_spec_kind")
    return LlmdEvent(
        "BlockStored",
        _tier(_string(_at(fields, 6), "BlockStored: medium")),
        lora_name or model,
        tuple(_hashes(fields[1])),
        _hash(fields[2]) if fields[2] is not None else 0,
        tuple(_to_int(t, "token_ids") & 0xFFFFFFFF for t in fields[3]),
        _to_int(fields[4], "BlockStored: block_size"),
        _group(_at(fields, 9)),
    )


@dataclass(frozen=True)
class LlmdMessage:
    pod: str
    model: str
    seq: int
    events: tuple[LlmdEvent, ...]


def parse_topic(topic: str) -> tuple[str, str]:
    parts = topic.split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (topic, "")


def decode_message(frames: list[bytes]) -> LlmdMessage | None:
    """A received message as llm-d reads it; None where its subscriber skips it."""
    if len(frames) != 3 or len(frames[1]) < 8:
        return None
    pod, model = parse_topic(frames[0].decode())
    seq = int.from_bytes(frames[1][:8], "big")
    batch = go_decode(frames[2])
    if not isinstance(batch, list) or len(batch) < 2:
        raise Refused(f"failed to decode vLLM event batch: {batch!r}")
    ts, events = batch[0], batch[1]
    if not isinstance(ts, float | GoInt):
        raise Refused(f"ts is not a number: {ts!r}")
    if _at(batch, 2) is not None:
        _to_int(batch[2], "data_parallel_rank")
    return LlmdMessage(pod, model, seq, tuple(_event(e, model) for e in events or []))


# -- the decoder against hand-made payloads ---------------------------------------------


def _stored_positional(hashes: list[Any], medium: str) -> list[Any]:
    return ["BlockStored", hashes, None, [1, 2, 3, 4], 4, None, medium]


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (
            _stored_positional([2**63 + 5, 2**40], "CPU"),
            LlmdEvent("BlockStored", "cpu", "m", (2**63 + 5, 2**40), 0, (1, 2, 3, 4), 4),
        ),
        (
            {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": 4, "medium": "STORAGE",
             "lora_name": "sql-lora"},
            LlmdEvent("BlockStored", "storage", "sql-lora", (0x0101010101010101,), 0,
                      (1, 2, 3, 4), 4),
        ),
        (["BlockRemoved", [2**40]], LlmdEvent("BlockRemoved", "gpu", "m", (2**40,))),
        ({"type": "AllBlocksCleared"}, LlmdEvent("AllBlocksCleared")),
    ],
    ids=["positional-int-hashes", "map-bytes-hash-lora", "removed-no-medium", "cleared"],
)  # fmt: skip
def test_the_decoder_reads_both_encodings_by_llmd_rules(event, expected):
    frames = [b"kv@pod-1@m", (7).to_bytes(8, "big"), msgpack.packb([1.5, [event], None])]
    assert decode_message(frames) == LlmdMessage("pod-1", "m", 7, (expected,))


@pytest.mark.parametrize(
    ("frames", "refusal"),
    [
        ([b"kv@p@m", b"\0" * 8, msgpack.packb([1.0, [_stored_positional([5], "CPU")]])],
         "unsupported hash type: int8"),
        ([b"kv@p@m", b"\0" * 8, msgpack.packb([1.0, [["BlockMoved", [2**40]]]])],
         "unknown vLLM event tag"),
        ([b"kv@p@m", b"\0" * 8, msgpack.packb([1.0, [{"block_hashes": []}]])],
         "without a string type"),
    ],
    ids=["small-int-hash", "unknown-tag", "map-without-type"],
)  # fmt: skip
def test_the_decoder_refuses_what_llmd_refuses(frames, refusal):
    with pytest.raises(Refused, match=refusal):
        decode_message(frames)


def test_the_decoder_parses_topics_and_skips_what_llmd_skips():
    assert parse_topic("kv@node-7@org/model-8B") == ("node-7", "org/model-8B")
    assert parse_topic("node-7@llama") == ("node-7@llama", "")
    payload = msgpack.packb([1.0, [], None])
    assert decode_message([b"kv@p@m", b"\0" * 7, payload]) is None
    assert decode_message([b"kv@p@m", payload]) is None


# -- a real daemon's events, as llm-d reads them ------------------------------------------

BLOCK_TOKENS = 16
MODEL = "meta-llama/Llama-3.1-8B"
PODS = ("vllm-a", "vllm-b")
SHIPPED_CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "kv-events" / "kvtierd-llm-d.toml"


def _prompt(keys: int, per_key: int, seed: int) -> tuple[list[bytes], list[BlockDescription]]:
    """Daemon keys and their descriptions: ``keys x per_key`` chained blocks."""
    blocks = keys * per_key
    tokens = [(seed * 7919 + i * 104729) % 150_000 for i in range(blocks * BLOCK_TOKENS)]
    hashes = [hash64(hashlib.sha256(b"%d/%d" % (seed, i)).digest()) for i in range(blocks)]
    descriptions = [
        BlockDescription(
            tuple(hashes[k * per_key : (k + 1) * per_key]),
            hashes[k * per_key - 1] if k else None,
            tuple(tokens[k * per_key * BLOCK_TOKENS : (k + 1) * per_key * BLOCK_TOKENS]),
            BLOCK_TOKENS,
        )
        for k in range(keys)
    ]
    return [f"llmd-{seed}-{k}".encode() for k in range(keys)], descriptions


class Subscriber:
    """llm-d's side: a SUB bound at an endpoint the daemon connects to, topic ``kv@``."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sub.bind(self.endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.messages: list[LlmdMessage] = []
        self.raw: dict[int, list[bytes]] = {}

    def read(self, seconds: float) -> None:
        """Whatever arrives within ``seconds`` (returns at the first message)."""
        if self.sub.poll(int(seconds * 1000)):
            while self.sub.poll(0):
                frames = self.sub.recv_multipart()
                message = decode_message(frames)
                assert message is not None, frames
                self.messages.append(message)
                self.raw[message.seq] = frames

    def events(self, kind: str, tier: str, hashes: set[int]) -> dict[str, set[int]]:
        """Per pod, which of ``hashes`` arrived in ``kind`` events of ``tier``."""
        seen: dict[str, set[int]] = {}
        for message in self.messages:
            for event in message.events:
                if event.kind == kind and event.tier == tier:
                    seen.setdefault(message.pod, set()).update(hashes & set(event.engine_keys))
        return seen

    def close(self) -> None:
        self.sub.close()
        self.context.term()


@pytest.fixture
def llmd(tmp_path: Path) -> Iterator[tuple[Subscriber, Any, str]]:
    """llm-d's subscriber, and a daemon with deploy/kv-events/kvtierd-llm-d.toml as
    shipped (connecting to it, publishing pool ``llama`` once per engine pod, an fs
    tier), on this machine's addresses, plus a replay endpoint."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber()
    (tmp_path / "fs").mkdir()
    config = shipped_config(
        SHIPPED_CONFIG, endpoint=subscriber.endpoint, root=tmp_path / "fs", pools=["llama"],
        model=MODEL, engines=list(PODS),
    ) + f'replay_endpoint = "{replay}"\n'  # fmt: skip
    try:
        daemon = start_daemon("--memory-budget", "256MiB", config=config)
        try:
            yield subscriber, daemon, replay
            assert daemon.stop() == 0, daemon.log()
        finally:
            daemon.cleanup()
    finally:
        subscriber.close()


def _store(engine: Engine, keys: list[bytes], descriptions: list[BlockDescription]) -> None:
    grant = eventually(lambda: engine.session.prepare_store(keys), 30, "room", interval=0.01)
    by_key = dict(zip(keys, descriptions, strict=True))
    engine.session.complete_store(
        grant.keys_to_store, descriptions=[by_key[k] for k in grant.keys_to_store]
    )


def test_llmd_reads_each_engine_pod_and_tier_of_the_daemons_stores_and_removals(llmd):
    """The daemon connects to llm-d's bound SUB. Every batch comes once per engine pod
    (topic ``kv@<pod>@<model>``): a store of a described prompt is a ``cpu`` entry of
    each pod with the engine's hashes, parent chain, tokens and block size, then a
    ``storage`` entry once the fs tier has it; FlushPool removes the ``cpu`` entries.
    Sequence numbers go up by one a message, each batch once per pod in turn, and the
    replay endpoint serves the same bytes from the daemon's first message on, which is
    AllBlocksCleared for each pod."""
    subscriber, daemon, replay = llmd
    engine = Engine(daemon, "llama", num_blocks=16)
    try:
        seeds = iter(range(1000, 2000))

        def heard() -> bool:  # the subscriber misses what precedes its connection
            keys, descriptions = _prompt(1, 1, next(seeds))
            _store(engine, keys, descriptions)
            subscriber.read(0.2)
            return bool(subscriber.messages)

        eventually(heard, 30, "llm-d's subscriber hears the daemon", interval=0.0)

        keys, descriptions = _prompt(3, 2, seed=7)
        hashes = {h for d in descriptions for h in d.block_hashes}
        _store(engine, keys, descriptions)

        def arrived(kind: str, tier: str) -> bool:
            subscriber.read(0.2)
            return subscriber.events(kind, tier, hashes) == {pod: hashes for pod in PODS}

        eventually(lambda: arrived("BlockStored", "cpu"), 30, "cpu stores", interval=0)
        eventually(lambda: arrived("BlockStored", "storage"), 30, "storage stores", interval=0)
        stored = [
            (m.pod, e) for m in subscriber.messages for e in m.events
            if e.kind == "BlockStored" and e.tier == "cpu" and set(e.engine_keys) <= hashes
        ]  # fmt: skip
        for pod in PODS:
            mine = [e for p, e in stored if p == pod]
            assert [(e.engine_keys, e.parent or None, e.tokens, e.block_size) for e in mine] == [
                (d.block_hashes, d.parent_block_hash, d.token_ids, d.block_size)
                for d in descriptions
            ]
            assert {e.model for e in mine} == {MODEL} and {e.group_idx for e in mine} == {0}

        with Client(daemon.address) as client:
            client.flush_pool("llama")
        eventually(lambda: arrived("BlockRemoved", "cpu"), 30, "cpu removals", interval=0)
        assert subscriber.events("BlockRemoved", "storage", hashes) == {}

        replayed = _replay(replay, 0)  # from the start: the daemon's first message on
        first = int.from_bytes(replayed[0][1], "big")
        starts = [decode_message(frames) for frames in replayed[: len(PODS)]]
        assert [(m.pod, m.model, m.seq, m.events[0]) for m in starts if m] == [
            (pod, MODEL, first + n, LlmdEvent("AllBlocksCleared")) for n, pod in enumerate(PODS)
        ]  # (the first stores may share the message)
        for frames in replayed:
            seq = int.from_bytes(frames[1], "big")
            if seq in subscriber.raw:
                assert frames == subscriber.raw[seq]
        seqs = [m.seq for m in subscriber.messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert all(m.pod == PODS[(m.seq - first) % len(PODS)] for m in subscriber.messages)
    finally:
        engine.close()


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    """vLLM's replay protocol as a DEALER: ``["", start_seq]``; answers ``["", topic,
    seq, payload]`` up to ``["", "", -1, ""]``."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        answers: list[list[bytes]] = []
        deadline = time.monotonic() + 30
        while dealer.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            if frames[3] == b"":
                assert frames[2] == (-1).to_bytes(8, "big", signed=True)
                return answers
            answers.append(frames[1:])
        raise AssertionError(f"no end of replay within 30 s; got {len(answers)} batches")
    finally:
        dealer.close()
        context.term()
