"""Bytes copied into region rows by one session's copy engine are read back
bit-exact by another session of the same pool; per-rank slices never overlap."""

from __future__ import annotations

import torch

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.copy_engine import CopyEngine
from kvtierd_client.region import AttachedRegion, attach_announced

PAGE = 8192  # per rank: two KV tensors of 4096 bytes per block
RANKS = 2
BLOCK = PAGE * RANKS
ENGINE_BLOCKS = 16


def kv_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (ENGINE_BLOCKS, 4096), dtype=torch.uint8, generator=generator)
        for _ in range(2)
    ]


def attach(session) -> AttachedRegion:
    # the descriptor the daemon passes; geometry and identity checked
    return attach_announced(session.region, session_id=session.session_id)


def test_two_sessions_share_bytes_per_rank(daemon, pool_name):
    writer_client, reader_client = Client(daemon.address), Client(daemon.address)
    writer = writer_client.open_session(pool_name, block_bytes=BLOCK, num_blocks=8, layout="tp2")
    reader = reader_client.open_session(pool_name, block_bytes=BLOCK, layout="tp2")
    keys = [f"block-{i}".encode() for i in range(5)]
    sources = {rank: kv_tensors(seed=rank) for rank in range(RANKS)}
    engine_blocks = [3, 0, 15, 7, 9]

    with attach(writer) as write_region, attach(reader) as read_region:
        grant = writer.prepare_store(keys)
        assert grant.keys_to_store == keys
        for rank in range(RANKS):  # each worker of the writer engine stores its slice
            engine = CopyEngine(write_region, sources[rank], rank=rank, page_bytes=PAGE)
            engine.wait([engine.submit_store(list(zip(engine_blocks, grant.block_ids,
                                                      strict=True)))])  # fmt: skip
        writer.complete_store(keys)

        assert reader.lookup(keys) == [LookupResult.HIT] * len(keys)
        block_ids = reader.prepare_load(keys)
        assert block_ids == grant.block_ids
        for rank in range(RANKS):
            loaded = [torch.zeros_like(t) for t in sources[rank]]
            engine = CopyEngine(read_region, loaded, rank=rank, page_bytes=PAGE)
            targets = list(range(len(keys)))
            engine.wait([engine.submit_load(list(zip(block_ids, targets, strict=True)))])
            for original, copy in zip(sources[rank], loaded, strict=True):
                assert torch.equal(copy[: len(keys)], original[engine_blocks])
        reader.complete_load(keys)

        # the rows hold rank 0's page then rank 1's page, nothing overlapping
        rows = read_region.tensor[block_ids]
        for rank in range(RANKS):
            expected = torch.cat([t[engine_blocks] for t in sources[rank]], dim=1)
            assert torch.equal(rows[:, rank * PAGE : (rank + 1) * PAGE], expected)
    writer_client.close()
    reader_client.close()
