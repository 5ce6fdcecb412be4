"""PoolTable: one pool per name, joiners checked against its spec, the memory budget
and the pool limit counted with the creations in flight, every pool closed at
shutdown (regions created under ``tmp_path``, no daemon)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from kvtierd.config import load_config
from kvtierd.contract import PoolSpec
from kvtierd.core.pool import Pool
from kvtierd.core.pools import PoolTable
from kvtierd.errors import FailedPrecondition, PoolNotFound, ResourceExhausted
from kvtierd.primary.region import region_file_name

BLOCK = 4096
_T = TypeVar("_T")


@pytest.fixture
def make_table(tmp_path) -> Callable[..., PoolTable]:
    defaults = load_config(env={})

    def make(budget: int = 64 * BLOCK, max_pools: int = 8) -> PoolTable:
        memory = dataclasses.replace(
            defaults.memory, shm_dir=str(tmp_path), budget=budget, default_pool_blocks=4,
            prefault=False, warm_restart=False,
        )  # fmt: skip
        limits = dataclasses.replace(defaults.limits, max_pools=max_pools)
        return PoolTable(memory, limits, gid=None)

    return make


def spec(name: str, num_blocks: int = 8, **changes: object) -> PoolSpec:
    return dataclasses.replace(PoolSpec(name, BLOCK, num_blocks, "layout", ""), **changes)


def run(scenario: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    return asyncio.run(scenario())


def test_a_pool_is_created_once_and_joined_after(make_table, tmp_path):
    table = make_table()

    async def create() -> Pool:
        first = await table.open(spec("a"))
        assert first.spec == PoolSpec("a", BLOCK, 8, "layout", "lru")  # policy defaulted
        assert await table.open(spec("a", num_blocks=2)) is first  # the creator sized it
        assert await table.open(spec("a", eviction_policy="lru")) is first
        assert table.get("a") is first and len(table) == 1 and list(table) == [first]
        assert table.used_bytes == 8 * BLOCK
        return first

    first = run(create)
    assert os.listdir(tmp_path) == [os.path.basename(first.region.path)]
    run(lambda: table.close_all(wait_for_creations=1.0))
    assert (len(table), table.used_bytes, os.listdir(tmp_path)) == (0, 0, [])


def test_num_blocks_zero_means_the_default(make_table):
    table = make_table()

    async def scenario() -> None:
        pool = await table.open(spec("d", num_blocks=0))
        assert pool.spec.num_blocks == 4
        await table.close_all(wait_for_creations=1.0)

    run(scenario)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_bytes": 2 * BLOCK}, "exists with block_bytes 4096"),
        ({"layout": "other"}, "exists with layout 'layout'"),
        ({"eviction_policy": "arc"}, "exists with eviction_policy 'lru'"),
    ],
)
def test_a_joiner_must_agree_on_what_the_bytes_mean(make_table, change, message):
    table = make_table()

    async def scenario() -> None:
        await table.open(spec("a"))
        with pytest.raises(FailedPrecondition, match=message):
            await table.open(spec("a", **change))
        assert len(table) == 1
        await table.close_all(wait_for_creations=1.0)

    run(scenario)


def test_the_budget_counts_regions_and_creations_in_flight(make_table):
    table = make_table(budget=12 * BLOCK)

    async def scenario() -> None:
        creating = asyncio.ensure_future(table.open(spec("a", num_blocks=8)))
        await asyncio.sleep(0)  # the creation started: its bytes are charged
        assert table.used_bytes == 8 * BLOCK
        with pytest.raises(ResourceExhausted, match=r"only 16\.0 KiB of the 48\.0 KiB"):
            await table.open(spec("b", num_blocks=8))
        joined = await table.open(spec("a"))  # waits for the same creation
        assert await creating is joined
        assert table.used_bytes == 8 * BLOCK  # counted once, not twice
        await table.open(spec("c", num_blocks=4))
        assert table.used_bytes == 12 * BLOCK
        await table.close_all(wait_for_creations=1.0)

    run(scenario)


def test_the_pool_limit_counts_creations_in_flight(make_table):
    table = make_table(max_pools=1)

    async def scenario() -> None:
        creating = asyncio.ensure_future(table.open(spec("a")))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="1 pools exist, the limit is 1"):
            await table.open(spec("b"))
        await creating
        await table.close_all(wait_for_creations=1.0)

    run(scenario)


def test_a_failed_creation_charges_nothing_and_can_be_retried(make_table, tmp_path):
    table = make_table()
    blocker = tmp_path / region_file_name("a")
    blocker.mkdir()  # a directory at the region's path: the creation fails

    async def scenario() -> None:
        with pytest.raises(FailedPrecondition, match="pool 'a'"):
            await table.open(spec("a"))
        assert (len(table), table.used_bytes) == (0, 0)
        blocker.rmdir()
        await table.open(spec("a"))
        assert table.used_bytes == 8 * BLOCK
        await table.close_all(wait_for_creations=1.0)

    run(scenario)


def test_an_unknown_pool_is_not_found_and_names_the_known_ones(make_table):
    table = make_table()

    async def scenario() -> None:
        with pytest.raises(PoolNotFound, match=r"known pools: \(none\)"):
            table.get("nope")
        await table.open(spec("b"))
        await table.open(spec("a"))
        with pytest.raises(PoolNotFound, match="known pools: a, b"):
            table.get("nope")
        await table.close_all(wait_for_creations=1.0)

    run(scenario)
