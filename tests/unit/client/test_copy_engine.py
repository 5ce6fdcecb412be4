"""CopyEngine: bytes move between KV tensors and the rank's slice of region rows.

Scenario for most tests: a daemon-created region on /dev/shm, a writer worker
that attached it and stores, a reader that attached it separately (another
mapping of the same file) and loads into fresh tensors. Everything is compared
bit-exact, including the bytes that must *not* change.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from fake_clock import FakeClock

from kvtierd.primary.region import Region
from kvtierd_client import copy_engine as copy_engine_mod
from kvtierd_client.copy_engine import CopyEngine, CopyEngineStatistics
from kvtierd_client.region import AttachedRegion

ENGINE_BLOCKS = 24
REGION_BLOCKS = 32
RANKS = 2
PAGE = 16384  # per rank: a 4 KiB float16 tensor + an 8 KiB uint8 tensor + 4 KiB padding
BLOCK = PAGE * RANKS
USED = 4096 + 8192


def kv_tensors(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """A worker's KV cache: two tensors of different dtypes and page sizes."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn((ENGINE_BLOCKS, 2, 1024), generator=generator).to(torch.float16)
    values = torch.randint(0, 256, (ENGINE_BLOCKS, 8192), dtype=torch.uint8, generator=generator)
    return [keys.to(device), values.to(device)]


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """(blocks, page bytes) uint8 copy of a kv tensor, for raw comparisons."""
    return tensor.cpu().contiguous().view(torch.uint8).reshape(tensor.shape[0], -1).numpy()


@pytest.fixture
def region() -> Iterator[Region]:
    parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="kvtierd-unit-", dir=parent)
    created = Region.create(directory, "copy-engine", REGION_BLOCKS, BLOCK)
    try:
        yield created
    finally:
        created.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def writer(region: Region) -> Iterator[AttachedRegion]:
    with AttachedRegion.attach(region.path, REGION_BLOCKS, BLOCK) as attached:
        yield attached


@pytest.fixture
def reader(region: Region) -> Iterator[AttachedRegion]:
    with AttachedRegion.attach(region.path, REGION_BLOCKS, BLOCK) as attached:
        yield attached


def random_pairs(seed: int, count: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    engine = rng.choice(ENGINE_BLOCKS, count, replace=False).tolist()
    region = rng.choice(REGION_BLOCKS, count, replace=False).tolist()
    return list(zip(engine, region, strict=True))


# -- round trips ---------------------------------------------------------------------


def test_two_ranks_round_trip_bit_exact_through_another_mapping(region, writer, reader):
    pairs = random_pairs(seed=1, count=10)
    sources = {rank: kv_tensors(seed=rank) for rank in range(RANKS)}
    for rank in range(RANKS):
        with CopyEngine(writer, sources[rank], rank=rank, page_bytes=PAGE) as engine:
            engine.wait([engine.submit_store(pairs)])

    for rank in range(RANKS):
        loaded = [torch.zeros_like(t) for t in sources[rank]]
        targets = list(range(len(pairs)))
        with CopyEngine(reader, loaded, rank=rank, page_bytes=PAGE) as engine:
            loads = [(r, t) for (_, r), t in zip(pairs, targets, strict=True)]
            engine.wait([engine.submit_load(loads)])
        engine_ids = [e for e, _ in pairs]
        for original, copy in zip(sources[rank], loaded, strict=True):
            assert np.array_equal(as_bytes(copy[targets]), as_bytes(original[engine_ids]))
            assert not as_bytes(copy[len(pairs) :]).any()  # other blocks untouched

    # raw layout: [rank 0: t0 | t1 | pad][rank 1: t0 | t1 | pad]; other rows zero
    raw = reader.numpy()
    for engine_id, region_id in pairs:
        for rank in range(RANKS):
            expected = np.concatenate([as_bytes(t)[engine_id] for t in sources[rank]])
            start = rank * PAGE
            assert np.array_equal(raw[region_id, start : start + USED], expected)
            assert not raw[region_id, start + USED : start + PAGE].any()
    untouched = sorted(set(range(REGION_BLOCKS)) - {r for _, r in pairs})
    assert not raw[untouched].any()


def test_rank_slices_do_not_overlap(writer):
    writer.numpy()[:] = 0x5A
    before = writer.numpy().copy()
    with CopyEngine(writer, kv_tensors(seed=3), rank=1, page_bytes=PAGE) as engine:
        engine.submit_store([(0, 0), (5, 7)])
    after = writer.numpy()
    assert np.array_equal(after[:, :PAGE], before[:, :PAGE])  # rank 0's bytes
    assert np.array_equal(after[:, PAGE + USED :], before[:, PAGE + USED :])  # rank 1's padding
    assert np.array_equal(after[[1, 2, 3]], before[[1, 2, 3]])  # other rows
    assert not np.array_equal(after[7, PAGE : PAGE + USED], before[7, PAGE : PAGE + USED])


@pytest.mark.parametrize(
    ("page_bytes", "pairs"),
    [
        pytest.param(4096, [(i, (7 * i) % 40) for i in range(40)], id="small-scattered"),
        pytest.param(4096, [(i, i + 3) for i in range(40)], id="small-one-run"),
        pytest.param(
            4096,
            [(i, i) for i in range(5)] + [(i, i + 10) for i in range(20, 40)] + [(7, 50)],
            id="mixed-runs",
        ),
        pytest.param(128 * 1024, [(i, (5 * i) % 8) for i in range(8)], id="large-rows"),
        pytest.param(128 * 1024, [(i, i + 1) for i in range(6)], id="large-one-run"),
    ],
)
def test_copy_paths_are_exact(tmp_path, monkeypatch, page_bytes, pairs):
    """Small rows go through gather/scatter (chunked: a tiny staging buffer here),
    large runs through slice copies; both must land the same bytes."""
    monkeypatch.setattr(copy_engine_mod, "STAGING_BYTES", 3 * page_bytes)
    engine_blocks = 1 + max(e for e, _ in pairs)
    region_blocks = 1 + max(r for _, r in pairs)
    generator = torch.Generator().manual_seed(page_bytes)
    source = torch.randint(
        0, 256, (engine_blocks, page_bytes), dtype=torch.uint8, generator=generator
    )
    with (
        Region.create(tmp_path, "paths", region_blocks, page_bytes) as created,
        AttachedRegion.attach(created.path, region_blocks, page_bytes) as attached,
    ):
        with CopyEngine(attached, [source]) as engine:
            engine.submit_store(pairs)
        raw = attached.numpy()
        for engine_id, region_id in pairs:
            assert np.array_equal(raw[region_id], source[engine_id].numpy())
        loaded = torch.zeros_like(source)
        with CopyEngine(attached, [loaded]) as engine:
            engine.submit_load([(r, e) for e, r in pairs])
        engine_ids = sorted({e for e, _ in pairs})
        assert torch.equal(loaded[engine_ids], source[engine_ids])


def test_odd_tensor_layouts(writer):
    """Blocks with padding between them, odd page sizes and non-byte dtypes."""
    backing = torch.arange(ENGINE_BLOCKS * 40, dtype=torch.int32).view(ENGINE_BLOCKS, 40)
    padded = backing[:, :30]  # 120 bytes per block, 160 between blocks
    odd = torch.arange(ENGINE_BLOCKS * 7, dtype=torch.uint8).view(ENGINE_BLOCKS, 7)
    halves = torch.randn(ENGINE_BLOCKS, 3, 5).to(torch.bfloat16)  # 30 bytes per block
    with CopyEngine(writer, [padded, odd, halves], rank=1, page_bytes=PAGE) as engine:
        engine.submit_store([(i, i) for i in range(0, ENGINE_BLOCKS, 2)])
    targets = [torch.zeros_like(backing), torch.zeros_like(odd), torch.zeros_like(halves)]
    with CopyEngine(writer, [targets[0][:, :30], *targets[1:]], rank=1, page_bytes=PAGE) as e:
        e.submit_load([(i, i) for i in range(0, ENGINE_BLOCKS, 2)])
    even = list(range(0, ENGINE_BLOCKS, 2))
    assert torch.equal(targets[0][even, :30], backing[even, :30])
    assert not targets[0][:, 30:].any()  # the padding between blocks is never written
    assert torch.equal(targets[1][even], odd[even])
    assert torch.equal(targets[2][even].view(torch.int16), halves[even].view(torch.int16))
    raw = writer.numpy()
    assert np.array_equal(raw[2, PAGE : PAGE + 120], padded[2].numpy().view(np.uint8))
    assert np.array_equal(raw[2, PAGE + 120 : PAGE + 127], odd[2].numpy())


def test_inference_tensors_can_be_stored_and_loaded(writer):
    with torch.inference_mode():
        cache = [torch.full((ENGINE_BLOCKS, 4096), 3, dtype=torch.uint8)]
        fresh = [torch.zeros(ENGINE_BLOCKS, 4096, dtype=torch.uint8)]
    with CopyEngine(writer, cache) as engine:
        engine.submit_store([(1, 2)])
    with CopyEngine(writer, fresh) as engine:
        engine.submit_load([(2, 5)])
    assert (fresh[0][5] == 3).all() and not fresh[0][4].any()


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("direction", "pairs", "message"),
    [
        (
            "store",
            [(0, 0), (ENGINE_BLOCKS, 1)],
            rf"engine block id {ENGINE_BLOCKS} is out of range",
        ),
        (
            "store",
            [(0, 0), (1, REGION_BLOCKS)],
            rf"region block id {REGION_BLOCKS} is out of range",
        ),
        ("store", [(0, 0), (-1, 1)], r"engine block id -1 is out of range"),
        ("load", [(0, 0), (REGION_BLOCKS + 5, 1)], rf"region block id {REGION_BLOCKS + 5} "),
        ("load", [(0, 0), (1, -2)], r"engine block id -2 is out of range"),
        ("store", [(0, 3), (1, 3)], r"region block id 3 is a destination twice"),
        ("load", [(0, 3), (1, 3)], r"engine block id 3 is a destination twice"),
        ("store", [(0, 0), (1.5, 1)], r"block id 1.5 is not an integer"),
        ("store", [(0, 0), (1, 2, 3)], r"expected \(source, destination\) pairs"),
        ("store", [(0, 0), ("1", 2)], r"block id '1' is not an integer"),
    ],
)
def test_bad_ids_raise_and_copy_nothing(writer, direction, pairs, message):
    writer.numpy()[:] = 0x11
    tensors = kv_tensors(seed=4)
    before_engine = [t.clone() for t in tensors]
    engine = CopyEngine(writer, tensors, rank=0, page_bytes=PAGE)
    first = engine.submit_store([(0, 0)])
    stats = engine.statistics()
    before_region = writer.numpy().copy()
    submit = engine.submit_store if direction == "store" else engine.submit_load
    with pytest.raises(ValueError, match=message):
        submit(pairs)
    assert np.array_equal(writer.numpy(), before_region)
    for now, then in zip(tensors, before_engine, strict=True):
        assert torch.equal(now, then)
    assert engine.statistics() == stats  # a refused job changes nothing
    assert engine.submit_store([]) == first + 1  # and consumes no job id
    engine.close()


def test_constructor_validates_tensors_and_geometry(writer):
    good = torch.zeros(ENGINE_BLOCKS, 4096, dtype=torch.uint8)
    cases = [
        ([], "empty"),
        ([good.t()], "each block must be contiguous"),
        ([torch.zeros(1, 4096, dtype=torch.uint8).expand(ENGINE_BLOCKS, 4096)], "overlap"),
        ([good, torch.zeros(ENGINE_BLOCKS + 1, 16, dtype=torch.uint8)], "disagree"),
        ([torch.zeros(ENGINE_BLOCKS, 0)], "empty blocks"),
        ([torch.zeros(ENGINE_BLOCKS, 16, device="meta")], "CPU or CUDA"),
    ]
    for tensors, message in cases:
        with pytest.raises(ValueError, match=message):
            CopyEngine(writer, tensors)
    with pytest.raises(ValueError, match="page_bytes 4000 is smaller than the 4096 bytes"):
        CopyEngine(writer, [good], page_bytes=4000)
    with pytest.raises(ValueError, match="rank 2 with pages of 16384 bytes"):
        CopyEngine(writer, [good], rank=2, page_bytes=PAGE)
    with pytest.raises(ValueError, match="rank 0 with pages of"):
        CopyEngine(writer, [torch.zeros(ENGINE_BLOCKS, BLOCK + 1, dtype=torch.uint8)])


# -- jobs ------------------------------------------------------------------------------


def test_job_ids_poll_and_wait(writer):
    engine = CopyEngine(writer, kv_tensors(seed=5), rank=0, page_bytes=PAGE)
    assert engine.poll() == []
    ids = [engine.submit_store([(0, 0)]), engine.submit_load([(0, 1)]), engine.submit_store([])]
    assert ids == [1, 2, 3]
    engine.wait([2])  # finished already (CPU): returns at once
    assert engine.poll() == [1, 2, 3]  # still reported once, in submission order
    assert engine.poll() == []
    engine.wait([1, 3])  # reported jobs may be waited on again
    assert engine.submit_load([(0, 2)]) == 4
    engine.wait([4])
    assert engine.poll() == [4]
    for bad in (0, 5, -1):
        with pytest.raises(ValueError, match=f"job id {bad} was never submitted"):
            engine.wait([bad])
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_store([(0, 0)])


def test_statistics(writer):
    engine = CopyEngine(writer, kv_tensors(seed=6), rank=1, page_bytes=PAGE)
    engine.submit_store([(0, 0), (1, 1), (2, 5)])
    engine.submit_load([(5, 3)])
    assert engine.statistics() == CopyEngineStatistics(
        jobs_submitted=2,
        jobs_finished=2,
        blocks_stored=3,
        blocks_loaded=1,
        bytes_stored=3 * USED,
        bytes_loaded=USED,
    )
    assert engine.statistics().bytes_copied == 4 * USED
    assert engine.statistics().jobs_pending == 0


def test_closing_the_engine_lets_the_region_unmap_cleanly(region, caplog):
    attached = AttachedRegion.attach(region.path, REGION_BLOCKS, BLOCK)
    engine = CopyEngine(attached, kv_tensors(seed=7), rank=0, page_bytes=PAGE)
    engine.submit_store(np.array([[0, 1], [2, 3]]))  # any (n, 2) integer array works
    engine.close()
    with caplog.at_level(logging.WARNING):
        attached.close()
    assert "garbage collector" not in caplog.text  # no view of the region survived
    assert os.path.exists(region.path)


# -- another process ----------------------------------------------------------------------


def _store_in_child(path: str, rank: int, pairs: list[tuple[int, int]]) -> None:
    """Runs in a spawned process: attach, store this rank's blocks, exit."""
    tensors = kv_tensors(seed=100 + rank)
    with (
        AttachedRegion.attach(path, REGION_BLOCKS, BLOCK) as attached,
        CopyEngine(attached, tensors, rank=rank, page_bytes=PAGE) as engine,
    ):
        engine.wait([engine.submit_store(pairs)])


def test_a_child_process_stores_and_the_parent_loads(region, reader):
    pairs = random_pairs(seed=9, count=12)
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_store_in_child, args=(region.path, 1, pairs))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    loaded = [torch.zeros_like(t) for t in kv_tensors(seed=0)]
    with CopyEngine(reader, loaded, rank=1, page_bytes=PAGE) as engine:
        engine.wait([engine.submit_load([(r, e) for e, r in pairs])])
    engine_ids = [e for e, _ in pairs]
    for original, copy in zip(kv_tensors(seed=101), loaded, strict=True):
        assert np.array_equal(as_bytes(copy[engine_ids]), as_bytes(original[engine_ids]))
    assert not reader.numpy()[:, :PAGE].any()  # rank 0's slice untouched


# -- CUDA ---------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_in_order(writer, reader):
    sources = kv_tensors(seed=11, device="cuda")
    pairs = random_pairs(seed=12, count=16)
    with CopyEngine(writer, sources, rank=0, page_bytes=PAGE) as engine:
        ids = [engine.submit_store(pairs[:8]), engine.submit_store(pairs[8:])]
        engine.wait(ids[-1:])  # the later job implies the earlier one
        assert engine.poll() == ids
        assert engine.statistics().bytes_stored == 16 * USED
    loaded = [torch.zeros_like(t) for t in sources]
    with CopyEngine(reader, loaded, rank=0, page_bytes=PAGE) as engine:
        job = engine.submit_load([(r, e) for e, r in pairs])
        engine.wait([job])
        assert engine.poll() == [job]
    engine_ids = [e for e, _ in pairs]
    for original, copy in zip(sources, loaded, strict=True):
        assert torch.equal(copy[engine_ids], original[engine_ids])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_load_lands_after_queued_compute(writer):
    """Scenario: the model still has work queued that writes a block; a load
    submitted afterwards must overwrite it, not be overwritten by it."""
    writer.numpy()[3, :4096] = 7
    target = torch.zeros(ENGINE_BLOCKS, 4096, dtype=torch.uint8, device="cuda")
    with CopyEngine(writer, [target]) as engine:
        torch.cuda._sleep(50_000_000)  # a long kernel on the compute stream
        target[0].fill_(1)  # queued behind it
        engine.wait([engine.submit_load([(3, 0)])])
    assert (target[0] == 7).all()


# -- the write fence (docs/design/leases.md) ------------------------------------------


def test_a_store_past_its_lease_deadline_is_refused_and_copies_nothing(writer):
    before = writer.numpy().copy()
    with CopyEngine(writer, kv_tensors(7)[1:], page_bytes=PAGE) as engine:
        past = time.monotonic() - 0.001
        with pytest.raises(copy_engine_mod.LeaseLostError, match="lease"):
            engine.submit_store([(0, 0), (1, 1)], lease_deadline=past)
        assert engine.statistics().jobs_submitted == 0
    assert np.array_equal(writer.numpy(), before)


def test_a_store_that_ends_past_its_lease_deadline_is_reported_late(writer):
    """The deadline passed between the check and the copy's end (a stopped process,
    a slow copy): the job is reported late, once, and the caller fails the store."""
    clock = FakeClock(0.0)
    with CopyEngine(writer, kv_tensors(7)[1:], page_bytes=PAGE, clock=clock) as engine:
        on_time = engine.submit_store([(0, 0)], lease_deadline=60.0)
        clock.script(100.0, 200.0)  # the check, then the end of the copy
        late = engine.submit_store([(1, 1)], lease_deadline=150.0)
        assert not clock.scripted  # both read by that store (a CPU copy ends in submit)
        assert engine.poll() == [on_time, late]
        assert engine.late_jobs() == [late]
        assert engine.late_jobs() == []
        unfenced = engine.submit_store([(2, 2)])  # no deadline: never late
        engine.wait([unfenced])
        assert engine.late_jobs() == []


def test_a_load_past_its_lease_deadline_is_refused_and_one_ending_past_it_is_late(writer):
    kv = kv_tensors(7)[1:]
    before = kv[0].clone()
    clock = FakeClock(0.0)
    with CopyEngine(writer, kv, page_bytes=PAGE, clock=clock) as engine:
        with pytest.raises(copy_engine_mod.LeaseLostError, match="load refused"):
            engine.submit_load([(0, 0)], lease_deadline=-0.001)
        assert torch.equal(kv[0], before)  # nothing copied
        clock.script(100.0, 200.0)  # the check, then the end of the copy
        late = engine.submit_load([(1, 1)], lease_deadline=150.0)
        assert not clock.scripted
        assert engine.poll() == [late]
        assert engine.late_jobs() == [late]
