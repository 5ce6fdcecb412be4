"""A published pool's block events turned into vLLM's events, on the publisher's
thread: the description table (:mod:`kvtierd.kvevents.descriptions`) is the
thread's own, so the request path only hands items over.

Items (what the loop hands over, in the order things happened):

- ``("describe", pool, keys, descriptions)``: a CompleteStore's descriptions
  (``pb2.BlockDescription``, validated), before its events;
- ``("event", pool, BlockEvent)``: a tier stored or removed keys;
- ``("seed", pool, [(key, raw description, [(tier, medium), ...]), ...])``: what a
  reopened pool's tiers still hold of the descriptions saved at the last stop.

A key stored without a description is remembered (where it is, bounded in
keys) so that a description arriving later, with a ``CompleteStore`` of a key
already ready (an engine describing the blocks it loaded: a block another node
stored in a shared tier and this node promoted), announces it where it is.

Per medium, not per tier: a key is published ``CPU`` while the primary holds it
and ``STORAGE`` while at least one secondary tier does (stored when the first
takes it, removed when the last drops it), so a router never loses a block one
storage tier still holds. A key without a description is published nowhere.

Owned by the publisher's thread (everything but :attr:`undescribed_stores` and
the table's sizes, which the loop only reads).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtierd.contract import BlockEvent, BlockKey, Medium
from kvtierd.kvevents import wireformat
from kvtierd.kvevents.descriptions import Described, DescriptionTable
from kvtierd_client.wire.proto import pb2

Event = dict[str, Any]
UNDESCRIBED_KEY_BYTES = 512  # what remembering where an undescribed key is may cost
Held = Sequence[tuple[str, int]]  # (tier name, Medium) of each tier holding a key


def medium_name(medium: int) -> str:
    return wireformat.MEDIUM_CPU if medium == Medium.CPU else wireformat.MEDIUM_STORAGE


class Translator:
    """Applies items to the description table and says what routers must learn."""

    def __init__(self, limit_bytes: int) -> None:
        self.table = DescriptionTable(limit_bytes)
        self.undescribed_stores = 0  # stored keys without a description
        self.cleared = 0  # times the table was dropped after lost items
        # where undescribed keys are (tier -> medium), least recently stored first, so
        # that a description arriving later (an engine describing what it loaded)
        # announces what already holds the key; at most max_undescribed keys
        self._undescribed: OrderedDict[tuple[str, BlockKey], dict[str, str]] = OrderedDict()
        self.max_undescribed = max(1024, limit_bytes // UNDESCRIBED_KEY_BYTES)

    def apply(self, item: tuple[Any, ...]) -> list[Event]:
        kind = item[0]
        if kind == "event":
            return self.observe(item[1], item[2])
        if kind == "describe":
            return self.describe(item[1], item[2], item[3])
        if kind == "seed":
            return self.seed(item[1], item[2])
        raise ValueError(f"unknown item {kind!r}")

    def describe(
        self, pool: str, keys: Sequence[BlockKey], descriptions: Sequence[Any]
    ) -> list[Event]:
        """Keeps each key's description unless it has one (first writer wins)."""
        events: list[Event] = []
        table = self.table
        for key, wire in zip(keys, descriptions, strict=True):
            if table.get(pool, key) is not None:
                continue
            raw = wire.SerializeToString()
            if not raw:
                continue  # an empty one: the key undescribed
            described = Described(raw)
            for _pool, dropped in table.offer(pool, key, described):
                for medium in sorted(set(dropped.tiers.values())):
                    events += removed_events([dropped.raw], medium)
            held = self._undescribed.pop((pool, key), None)
            if held and table.get(pool, key) is described:  # described late: held already
                for tier, medium in held.items():
                    table.stored(pool, key, tier, medium)
                events += [stored_event(raw, m) for m in sorted(set(held.values()))]
        return events

    def observe(self, pool: str, event: BlockEvent) -> list[Event]:
        """What ``event`` (a pool's stored / removed blocks in one tier) changes for
        routers."""
        medium = medium_name(event.medium)
        table = self.table
        if event.removed:
            gone = []
            for key in event.keys:
                entry = table.removed(pool, key, event.tier)
                if entry is None:
                    self._forget_undescribed(pool, key, event.tier)
                elif not entry.holds(medium):
                    gone.append(entry.raw)
            return removed_events(gone, medium)
        events: list[Event] = []
        for key in event.keys:
            entry = table.get(pool, key)
            if entry is None:
                self.undescribed_stores += 1
                self._remember_undescribed(pool, key, event.tier, medium)
                continue
            fresh = not entry.holds(medium)
            table.stored(pool, key, event.tier, medium)
            if fresh:
                events.append(stored_event(entry.raw, medium))
        return events

    def seed(self, pool: str, kept: Sequence[tuple[BlockKey, bytes, Held]]) -> list[Event]:
        """Re-announces what a reopened pool's tiers still hold, parents before their
        children (llm-d drops a store whose parent it cannot place); keys described
        again since the pool opened keep their new description."""
        events: list[Event] = []
        table = self.table
        for key, raw, holders in parents_first(kept):
            if not holders or table.get(pool, key) is not None:
                continue
            described = Described(raw)
            for _pool, dropped in table.offer(pool, key, described):
                for medium in sorted(set(dropped.tiers.values())):
                    events += removed_events([dropped.raw], medium)
            for tier, tier_medium in holders:
                table.stored(pool, key, tier, medium_name(tier_medium))
            events += [stored_event(raw, m) for m in sorted(set(described.tiers.values()))]
        return events

    def _remember_undescribed(self, pool: str, key: BlockKey, tier: str, medium: str) -> None:
        slot = (pool, key)
        held = self._undescribed.get(slot)
        if held is None:
            held = self._undescribed[slot] = {}
            while len(self._undescribed) > self.max_undescribed:
                self._undescribed.popitem(last=False)
        else:
            self._undescribed.move_to_end(slot)
        held[tier] = medium

    def _forget_undescribed(self, pool: str, key: BlockKey, tier: str) -> None:
        held = self._undescribed.get((pool, key))
        if held is not None:
            held.pop(tier, None)
            if not held:
                del self._undescribed[(pool, key)]

    def clear(self) -> list[Event]:
        """After lost items the table may credit what is gone: forget it all, and so
        must routers (a recall loss until the blocks are stored again, never an
        over-credit)."""
        self.table.forget_all()
        self._undescribed.clear()
        self.cleared += 1
        return [wireformat.ALL_BLOCKS_CLEARED]


def parents_first(
    kept: Sequence[tuple[BlockKey, bytes, Held]],
) -> list[tuple[BlockKey, bytes, Held]]:
    """``kept`` ordered so that a description whose parent hash is another's last
    block comes after that one (by depth in the chains ``kept`` forms; stable)."""
    parents: list[int | None] = []
    owner: dict[int, int] = {}  # a description's last block hash -> its index
    for index, (_key, raw, _holders) in enumerate(kept):
        wire = pb2.BlockDescription.FromString(raw)
        parents.append(wire.parent_block_hash if wire.HasField("parent_block_hash") else None)
        if wire.block_hashes:
            owner[wire.block_hashes[-1]] = index
    depth: dict[int, int] = {}

    def depth_of(index: int) -> int:
        path, node = [], index
        while node not in depth:
            path.append(node)
            parent = parents[node]
            above = owner.get(parent) if parent is not None else None
            if above is None or above in path:  # a chain's root (a cycle is cut)
                depth[node] = 0
                path.pop()
                break
            node = above
        for below in reversed(path):  # from the top down
            depth[below] = depth[node] + 1
            node = below
        return depth[index]

    order = sorted(range(len(kept)), key=depth_of)
    return [kept[index] for index in order]


def stored_event(raw: bytes, medium: str) -> Event:
    wire = pb2.BlockDescription.FromString(raw)
    parent = wire.parent_block_hash if wire.HasField("parent_block_hash") else None
    return wireformat.block_stored(
        list(wire.block_hashes), parent, list(wire.token_ids), wire.block_size, medium,
        wire.lora_name, wire.group_idx,
    )  # fmt: skip


def removed_events(raws: Sequence[bytes], medium: str) -> list[Event]:
    """One ``BlockRemoved`` per KV cache group of the described blocks ``raws``."""
    by_group: dict[int, list[int]] = {}
    for raw in raws:
        wire = pb2.BlockDescription.FromString(raw)
        by_group.setdefault(wire.group_idx, []).extend(wire.block_hashes)
    return [wireformat.block_removed(hashes, medium, group) for group, hashes in by_group.items()]
