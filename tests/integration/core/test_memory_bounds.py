"""The daemon's memory under a churn of new keys stays within what its configuration
bounds (issue #33 item 3; docs/design/memory.md): its resident anonymous memory is
at most its base plus 1.25 times the heap its pools may take by their limits (the
event log's and the removal history's byte limits, the block table full of 256-byte
keys and the journal's rows: ``kvtierd.primary.footprint``) and the keys of one call
in flight. Real daemon, real socket, the default warm-restart journal."""

from __future__ import annotations

import grpc
import pytest
from daemon_harness import eventually
from raw_calls import anon_rss, long_keys, store

from kvtierd.primary.footprint import pool_heap_bytes
from kvtierd.util.heap import allocated_bytes
from kvtierd_client.wire.proto import pb2, pb2_grpc

MIB = 1 << 20
ROWS = 65536
KEY_BYTES = 256
CYCLES = 20
EVENTS_BYTES = 64 * MIB  # limits.events_retained_bytes (its default)
REMOVALS_BYTES = 16 * MIB  # limits.removals_retained_bytes (its default)
SLACK = 1.25


@pytest.mark.parametrize("keys_per_call", [4096, 65536])
def test_rss_under_a_churn_of_new_long_keys_stays_within_the_configured_bounds(
    make_daemon, pool_name, keys_per_call
):
    """Scenario: a 65,536-row pool refilled 20 times with brand-new 256-byte keys
    (PrepareStore + CompleteStore of 4,096, or of 65,536 keys at a time: the
    largest call). The figure after the last cycle, once the heap trimmer has
    looked (it trims once a second), is within base + 1.25 x (64 MiB of events
    + 16 MiB of removals + 65,536 rows x (256 + 240 + 24) + one call's keys).
    Before (docs/benchmarks/history.md): 195 and 310 MiB, base 27 MiB, where
    this bound is 168 and 192 MiB."""
    daemon = make_daemon(
        "--memory-budget", "512MiB", "--events-retained-bytes", f"{EVENTS_BYTES}",
        "--removals-retained-bytes", f"{REMOVALS_BYTES}",
    )  # fmt: skip
    # a grant of 65,536 long keys is 17 MB: over the client's default receive limit
    with grpc.insecure_channel(
        daemon.target, options=[("grpc.max_receive_message_length", -1)]
    ) as channel:
        stub = pb2_grpc.KVTierStub(channel)
        spec = pb2.PoolSpec(name=pool_name, block_bytes=4096, num_blocks=ROWS)
        session = stub.OpenSession(pb2.OpenSessionRequest(pool=spec)).session_id
        base = anon_rss(daemon)
        figures = []
        for cycle in range(CYCLES):
            for start in range(cycle * ROWS, (cycle + 1) * ROWS, keys_per_call):
                store(stub, session, long_keys(start, keys_per_call, KEY_BYTES))
            figures.append(anon_rss(daemon))
    pools = pool_heap_bytes(
        ROWS, "lru", events_bytes=EVENTS_BYTES, removals_bytes=REMOVALS_BYTES, warm_restart=True
    )
    in_flight = keys_per_call * allocated_bytes(33 + KEY_BYTES)  # a call's key objects
    bound = base + SLACK * (pools + in_flight)
    last: list[int] = []

    def within() -> bool:
        last[:] = [anon_rss(daemon)]
        return last[0] <= bound

    eventually(
        within, 30,
        lambda: f"anonymous RSS {last[0] / MIB:.1f} MiB under the bound {bound / MIB:.1f} MiB "
        f"(base {base / MIB:.1f}); after each cycle: {[round(f / MIB, 1) for f in figures]}",
        interval=0.25,
    )  # fmt: skip
