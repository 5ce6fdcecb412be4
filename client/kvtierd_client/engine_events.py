"""The engine's own KV events, read back: which tokens each block hash stands for.

A daemon publishing KV events for routers (``[kv_events]``) needs each stored key's
blocks as the engine hashes them: 64-bit hashes, parent, token ids, block size
(:class:`~kvtierd_client.wire.descriptions.BlockDescription`). Neither engine hands
its storage plug-in the tokens (vLLM's ``OffloadingManager`` gets keys only, SGLang's
``batch_set_v1`` page hashes only), but both engines publish every block they cache
on the GPU as a ``BlockStored`` event with its tokens, hash and parent hash, on the
ZMQ endpoint of their KV-event config, before the block can reach the plug-in's
store (it is stored from the GPU). So a plug-in subscribes there:

* :class:`BlockIndex` maps each block hash (64 bits, as the engine publishes it) to
  its parent hash and tokens. A hash stands for its tokens and the whole prefix
  before them (both engines chain their hashes), so an entry never goes stale; the
  index is bounded in bytes and forgets the least recently used entries first.
  Thread-safe (one short lock per call).
* :class:`Describer` turns a plug-in's keys into descriptions from the index (the
  plug-in says which block hash and group a key ends with).
* :class:`LateDescriptions` (a describer's ``late``): keys the engine *loaded* that
  it never described (a block another node stored in a shared tier, promoted here).
  A loaded block re-enters the engine's GPU cache, so the engine publishes it with
  its tokens a step or so after the load; the plug-in notes the loaded keys and, once
  a step, takes those now described, to send with its queued completions
  (``complete_store`` of ready keys changes nothing but the descriptions).
* :class:`EngineEventListener` is a daemon thread with a ZMQ SUB socket connected to
  the engine's endpoint that decodes each message with the engine's own event
  classes (the ``decode`` the plug-in passes) and feeds the index. Nothing here
  runs in the engine's scheduler; a slow or absent publisher costs it nothing, a
  message that cannot be decoded is skipped (logged once).

Bounds: the index holds at most ``max_bytes`` (token ids at 4 bytes plus
:data:`ENTRY_OVERHEAD_BYTES` an entry); the socket queues at most
:data:`RECEIVE_HWM` messages of at most :data:`MAX_MESSAGE_BYTES` each (a larger one
is dropped by ZMQ); at most :data:`MAX_WAITING_KEYS` loaded keys wait for their
description (each for :data:`LATE_PATIENCE_STEPS` steps) and
:data:`MAX_DESCRIBED_KEYS` keys are remembered as described (about 200 bytes each).

May import the client's ``types`` and ``wire`` and ``zmq`` (imported when a listener
starts): never vLLM or SGLang, whose decoders come in as functions.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd_client.types import BlockDescription
from kvtierd_client.wire.descriptions import description_problem

__all__ = [
    "ENTRY_OVERHEAD_BYTES",
    "MAX_MESSAGE_BYTES",
    "RECEIVE_HWM",
    "BlockIndex",
    "DescribeCounters",
    "Describer",
    "EngineEventListener",
    "IndexStatistics",
    "LATE_PATIENCE_STEPS",
    "LateDescriptions",
    "MAX_DESCRIBED_KEYS",
    "MAX_WAITING_KEYS",
    "StoredBlocks",
    "listen",
    "local_endpoint",
]

log = logging.getLogger(__name__)

ENTRY_OVERHEAD_BYTES = 160
"""What one index entry costs besides its token ids (dict slot, key, record)."""
RECEIVE_HWM = 64
"""Messages the SUB socket queues before ZMQ drops new ones (one per engine step)."""
MAX_MESSAGE_BYTES = 16 << 20
"""A larger event message is refused by ZMQ (vLLM's are a step's blocks: far less)."""
POLL_MS = 100
"""How often the listener thread looks at its stop flag while the engine is quiet."""
LATE_PATIENCE_STEPS = 16
"""Steps a loaded key waits for its blocks' event before it is left undescribed (the
engine publishes a loaded block a step after the load: the rest is the listener's lag)."""
MAX_WAITING_KEYS = 4096
"""Loaded keys waiting for their description at most (the oldest give way)."""
MAX_DESCRIBED_KEYS = 16384
"""Keys remembered as described by this engine, stored or loaded (the first described
are forgotten first, so a key is described again at most once per this many others)."""
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """One ``BlockStored`` event as a plug-in's decoder hands it over: consecutive
    blocks of ``block_size`` tokens each, hashes as 64-bit ints (a signed one is
    taken modulo 2**64), ``parent`` the hash before the first (None: none)."""

    block_hashes: Sequence[int]
    parent: int | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str = ""
    keyed: Sequence[bool] = ()
    """Per block (empty: none): its hash covers more than its tokens and LoRA
    adapter (images, a cache salt, prompt embeddings). Such a block and every
    block after it in its prefix are never described: a router hashing their
    tokens would credit another prompt."""


@dataclass(frozen=True, slots=True)
class IndexStatistics:
    """A snapshot of a :class:`BlockIndex`."""

    blocks: int
    bytes: int
    max_bytes: int
    indexed: int  # blocks added since start
    forgotten: int  # entries dropped for room
    skipped: int  # events whose tokens did not fit their hashes and block size


@dataclass(frozen=True, slots=True)
class _Entry:
    parent: int | None
    tokens: array[int]  # array("I"): block_size token ids
    lora_name: str
    opaque: bool  # this block or one before it is keyed (StoredBlocks.keyed)

    @property
    def cost(self) -> int:
        return ENTRY_OVERHEAD_BYTES + 4 * len(self.tokens)


class BlockIndex:
    """Block hash (64 bits) -> parent hash and tokens, at most ``max_bytes`` (LRU).

    Invariant: ``self._bytes`` is the sum of the entries' costs and <= ``max_bytes``
    after every call; every entry's tokens are exactly one block.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < ENTRY_OVERHEAD_BYTES:
            raise ValueError(f"max_bytes {max_bytes} holds no block")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # guarded by _lock
        self._bytes = 0  # guarded by _lock
        self._indexed = 0
        self._forgotten = 0
        self._skipped = 0

    def add(self, stored: StoredBlocks) -> int:
        """Indexes the blocks of one event; how many (0 when its tokens do not
        make ``block_size`` a block for each hash, or a token id is not 32-bit)."""
        size = stored.block_size
        hashes = [h & _U64 for h in stored.block_hashes]
        tokens = stored.token_ids
        if not hashes or size <= 0 or len(tokens) != size * len(hashes):
            self._skipped += 1
            return 0
        try:
            packed = array("I", tokens)
        except (OverflowError, TypeError):  # negative, over 32 bits, not ints
            self._skipped += 1
            return 0
        keyed = list(stored.keyed) or [False] * len(hashes)
        parent = None if stored.parent is None else stored.parent & _U64
        with self._lock:
            above = None if parent is None else self._entries.get(parent)
            opaque = above is not None and above.opaque
            for i, block_hash in enumerate(hashes):
                opaque = opaque or bool(keyed[i : i + 1] and keyed[i])
                block = packed[i * size : (i + 1) * size]
                self._put(block_hash, _Entry(parent, block, stored.lora_name, opaque))
                parent = block_hash
        return len(hashes)

    def describe(
        self, last_hash: int, blocks: int, block_size: int, group_idx: int = 0
    ) -> BlockDescription | None:
        """The description of the ``blocks`` blocks ending with ``last_hash`` (its
        parents walked back), each of ``block_size`` tokens; None when one is not
        indexed, of another size or opaque, or they span LoRA adapters."""
        chain: list[tuple[int, _Entry]] = []
        with self._lock:
            block_hash: int | None = last_hash & _U64
            for _ in range(blocks):
                entry = None if block_hash is None else self._entries.get(block_hash)
                if entry is None or entry.opaque or len(entry.tokens) != block_size:
                    return None
                assert block_hash is not None
                self._entries.move_to_end(block_hash)
                chain.append((block_hash, entry))
                block_hash = entry.parent
        chain.reverse()
        lora = chain[0][1].lora_name
        if any(entry.lora_name != lora for _, entry in chain):
            return None
        tokens: list[int] = []
        for _, entry in chain:
            tokens.extend(entry.tokens)
        return BlockDescription(
            block_hashes=tuple(h for h, _ in chain),
            parent_block_hash=chain[0][1].parent,
            token_ids=tuple(tokens),
            block_size=block_size,
            lora_name=lora,
            group_idx=group_idx,
        )

    def statistics(self) -> IndexStatistics:
        with self._lock:
            return IndexStatistics(
                blocks=len(self._entries),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                indexed=self._indexed,
                forgotten=self._forgotten,
                skipped=self._skipped,
            )

    def _put(self, block_hash: int, entry: _Entry) -> None:
        old = self._entries.pop(block_hash, None)
        if old is not None:
            self._bytes -= old.cost
        else:
            self._indexed += 1
        while self._entries and self._bytes + entry.cost > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.cost
            self._forgotten += 1
        if self._bytes + entry.cost <= self.max_bytes:
            self._entries[block_hash] = entry
            self._bytes += entry.cost


Decoder = Callable[[bytes], Iterable[StoredBlocks]]
"""A plug-in's decoder: one event message's payload -> its ``BlockStored`` events
(the engine's own event classes do the decoding; other events are left out)."""


class EngineEventListener:
    """A daemon thread subscribed to an engine's KV-event endpoint (module doc).

    ``endpoint``: where the engine's publisher binds (``tcp://HOST:PORT`` or
    ``ipc://PATH``; the socket connects, and keeps reconnecting, so the engine may
    start publishing later). :meth:`close` stops the thread (within
    :data:`POLL_MS`) and closes its socket.
    """

    def __init__(self, endpoint: str, index: BlockIndex, decode: Decoder, *, name: str) -> None:
        self.endpoint = endpoint
        self.index = index
        self._decode = decode
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.messages = 0  # received (written by the thread only)
        self.undecodable = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Starts the thread; returns once its socket is connecting."""
        self._thread.start()
        self._ready.wait(timeout=5.0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        import zmq

        context = zmq.Context()
        socket = context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(self.endpoint)
        except zmq.ZMQError as err:
            log.error("kvtierd: cannot subscribe to the engine's KV events at %s: %s; "
                      "stores are sent undescribed", self.endpoint, err)  # fmt: skip
            socket.close()
            context.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if socket.poll(POLL_MS):
                    self._take(socket.recv_multipart(copy=True))
        finally:
            socket.close()
            context.term()

    def _take(self, frames: list[Any]) -> None:
        self.messages += 1
        if len(frames) != 3:  # [topic, seq, payload]
            self._undecodable(f"{len(frames)} frames")
            return
        try:
            for stored in self._decode(frames[2]):
                self.index.add(stored)
        except Exception as err:  # noqa: BLE001 - an engine's message never stops the thread
            self._undecodable(str(err))

    def _undecodable(self, why: str) -> None:
        self.undecodable += 1
        if self.undecodable == 1:
            log.warning("kvtierd: a KV event message from %s could not be read (%s); "
                        "its blocks stay undescribed", self.endpoint, why)  # fmt: skip


def local_endpoint(endpoint: str, offset: int = 0) -> str:
    """Where to connect to reach a publisher configured with ``endpoint``: a wildcard
    host (``*``, ``0.0.0.0``, ``[::]``) is this host's loopback, and a TCP port moves
    up by ``offset`` (the data-parallel rank: both engines offset each rank's
    publisher so; an ``ipc://`` path is taken as it is). ValueError for an endpoint
    that is not ``tcp://`` or ``ipc://``."""
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(f"expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    host, _, port = endpoint[6:].rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}") from None
    if host in ("*", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("[::]", "::", "[*]"):
        host = "[::1]"
    return f"tcp://{host}:{number + offset if number else number}"


KeyHash = Callable[[bytes], "tuple[int, int] | None"]
"""A plug-in's key -> (the hash of the key's last block as the engine publishes it,
the KV cache group), or None for a key that names no engine block."""


@dataclass
class DescribeCounters:
    """Keys completed with and without a description, and loaded keys described
    late or given up on (since start)."""

    described: int = 0
    undescribed: int = 0
    described_late: int = 0
    undescribed_loads: int = 0  # loaded keys whose description did not come in time


class LateDescriptions:
    """Loaded keys this engine has not described, described once its events show
    their blocks (module doc). Thread-safe (one short lock per call; ``describe`` is
    called under it).

    ``describe``: one key's description now, or None. Invariants: a key is in at
    most one of ``_waiting`` (key -> the take it was loaded at, in load order) and
    ``_described``; ``len(_waiting) <= max_waiting`` and ``len(_described) <=
    max_described`` after every call; :meth:`take` describes at most ``max_waiting``
    keys (index look-ups only: no I/O).
    """

    def __init__(
        self,
        describe: Callable[[bytes], BlockDescription | None],
        counters: DescribeCounters,
        *,
        patience: int = LATE_PATIENCE_STEPS,
        max_waiting: int = MAX_WAITING_KEYS,
        max_described: int = MAX_DESCRIBED_KEYS,
    ) -> None:
        self._describe = describe
        self.counters = counters
        self.patience = patience
        self.max_waiting = max_waiting
        self.max_described = max_described
        self._lock = threading.Lock()
        self._waiting: OrderedDict[bytes, int] = OrderedDict()  # guarded by _lock
        self._described: OrderedDict[bytes, None] = OrderedDict()  # guarded by _lock
        self._takes = 0  # guarded by _lock

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def described(self, keys: Iterable[bytes]) -> None:
        """``keys`` went to the daemon with their descriptions."""
        with self._lock:
            self._remember(keys)

    def loaded(self, keys: Iterable[bytes]) -> None:
        """``keys`` were loaded: each one not described by this engine waits for its
        description (the oldest waiting give way beyond ``max_waiting``)."""
        with self._lock:
            for key in keys:
                if key in self._described or key in self._waiting:
                    continue
                self._waiting[key] = self._takes
                if len(self._waiting) > self.max_waiting:
                    self._waiting.popitem(last=False)
                    self.counters.undescribed_loads += 1

    def take(self, busy: Collection[bytes] = ()) -> tuple[list[bytes], list[BlockDescription]]:
        """Once a step: the waiting keys described now (remembered as described),
        with their descriptions; keys that waited ``patience`` takes are given up.
        ``busy``: keys to leave waiting (the plug-in's own reservations: completing
        one would make its rows readable before they are written)."""
        keys: list[bytes] = []
        descriptions: list[BlockDescription] = []
        with self._lock:
            self._takes += 1
            waiting = self._waiting
            while waiting:
                key, since = next(iter(waiting.items()))
                if self._takes - since <= self.patience:
                    break
                del waiting[key]
                self.counters.undescribed_loads += 1
            for key in [k for k in waiting if k not in busy]:
                described = self._describe(key)
                if described is not None:
                    keys.append(key)
                    descriptions.append(described)
            self._remember(keys)
            self.counters.described_late += len(keys)
        return keys, descriptions

    def _remember(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._waiting.pop(key, None)
            self._described[key] = None
            if len(self._described) > self.max_described:
                self._described.popitem(last=False)


class Describer:
    """A plug-in's stored keys described from its engine's events (module doc).

    ``blocks`` engine blocks of ``block_size`` tokens make one key; ``key_hash``
    finds a key's last block. Owns ``listener`` (closed by :meth:`close`).
    """

    def __init__(
        self,
        index: BlockIndex,
        listener: EngineEventListener | None,
        key_hash: KeyHash,
        *,
        blocks: int,
        block_size: int,
    ) -> None:
        self.index = index
        self.listener = listener
        self._key_hash = key_hash
        self.blocks = blocks
        self.block_size = block_size
        self.counters = DescribeCounters()
        self.late = LateDescriptions(self._describe, self.counters)

    def describe(self, keys: Sequence[bytes]) -> list[BlockDescription | None] | None:
        """One description (or None) per key; None when no key could be described.
        The keys described are remembered (:attr:`late` describes none of them again)."""
        out = [self._describe(key) for key in keys]
        self.late.described(key for key, d in zip(keys, out, strict=True) if d is not None)
        described = sum(d is not None for d in out)
        self.counters.described += described
        self.counters.undescribed += len(out) - described
        return out if described else None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()

    def _describe(self, key: bytes) -> BlockDescription | None:
        found = self._key_hash(key)
        if found is None:
            return None
        last, group = found
        described = self.index.describe(last, self.blocks, self.block_size, group_idx=group)
        if described is None or description_problem(
            described.block_hashes, described.parent_block_hash, described.token_ids,
            described.block_size,
        ) is not None:  # fmt: skip
            return None  # over the wire's bounds (64 blocks, 8192 tokens a key)
        return described


def listen(
    endpoint: str,
    max_bytes: int,
    decode: Decoder,
    key_hash: KeyHash,
    *,
    blocks: int,
    block_size: int,
) -> Describer:
    """A :class:`Describer` over a new index fed by a listener at ``endpoint``
    (started)."""
    index = BlockIndex(max_bytes)
    listener = EngineEventListener(endpoint, index, decode, name="kvtierd-kv-events")
    listener.start()
    return Describer(index, listener, key_hash, blocks=blocks, block_size=block_size)
