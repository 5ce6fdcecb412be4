"""Daemon memory under an endless churn of new long keys, and under WatchEvents
streams that never read (issue #15: every buffer bounded in bytes).

* churn: a primary-only daemon with the default limits; a 65,536-row pool is
  refilled again and again with brand-new 256-byte keys (PrepareStore +
  CompleteStore of 4,096 keys at a time); RssAnon (private memory: the region is
  shared memory and not counted) after 1, 10 and 50 cycles, and the most it
  reached after any of cycles 11-50. The floor is the value after 10 cycles
  (every bounded structure is full by then): later cycles should add nothing.
* watch: 200 streams that never read on one channel (without bandwidth-delay
  probing, so each client window stays 64 KiB) while a 4,096-row pool is
  refilled 20 times with new 256-byte keys; RssAnon growth over the same
  churn in the same daemon without streams (the floor), with the default
  ``limits.max_watch_streams`` (64 admitted) and with 200 admitted.
"""

from __future__ import annotations

import time

import grpc

from benchmarks.common import BenchDaemon, Row, rss_anon_bytes
from kvtierd_client.client import Client
from kvtierd_client.wire.proto import pb2, pb2_grpc

MIB = 1 << 20
CHURN_ROWS = 65536
CHURN_BATCH = 4096
CHURN_REPORTED = (1, 10, 50)
WATCH_ROWS = 4096
WATCH_BATCH = 1024
WATCH_CYCLES = 20
WATCH_STREAMS = 200


def _new_keys(start: int, count: int) -> list[bytes]:
    """``count`` distinct 256-byte keys numbered from ``start``."""
    return [i.to_bytes(8, "big") * 32 for i in range(start, start + count)]


class _Churn:
    """Refills one pool with brand-new keys, a cycle at a time."""

    def __init__(self, client: Client, pool: str, rows: int, batch: int) -> None:
        self.session = client.open_session(pool, block_bytes=4096, num_blocks=rows)
        self.rows, self.batch, self.next_key = rows, batch, 0

    def cycle(self) -> None:
        for _ in range(self.rows // self.batch):
            grant = self.session.prepare_store(_new_keys(self.next_key, self.batch))
            self.session.complete_store(grant.keys_to_store)
            self.next_key += self.batch


def churn() -> list[Row]:
    with BenchDaemon() as daemon:
        client = Client(daemon.address, timeout=120)
        run = _Churn(client, "bench/churn", CHURN_ROWS, CHURN_BATCH)
        rss: list[float] = [0.0]  # rss[n]: after cycle n
        for _ in range(max(CHURN_REPORTED)):
            run.cycle()
            rss.append(rss_anon_bytes(daemon.proc.pid) / MIB)
        client.close()
    floor = rss[10]
    rows = [
        Row("buffers", f"daemon RssAnon after {n} churn cycle{'s' * (n > 1)} (65,536 rows, "
            "new 256-byte keys)", rss[n], "MiB", floor=f"{floor:.0f} MiB after 10 cycles",
            ratio=rss[n] / floor, target="flat after 10 cycles" if n > 10 else "")
        for n in CHURN_REPORTED
    ]  # fmt: skip
    peak = max(rss[11:])
    rows.append(Row("buffers", f"daemon RssAnon, most after any of cycles 11-{len(rss) - 1}",
                    peak, "MiB", floor=f"{floor:.0f} MiB after 10 cycles", ratio=peak / floor,
                    target="flat after 10 cycles"))  # fmt: skip
    return rows


def _watch_growth(max_streams: int, streams: int) -> tuple[float, float, int]:
    """RssAnon growth (MiB) of a churn without streams, then of the same churn
    with ``streams`` that never read; and how many of them the daemon admitted."""
    with BenchDaemon("--max-watch-streams", str(max_streams)) as daemon:
        client = Client(daemon.address, timeout=120)
        quiet = _Churn(client, "bench/watch-floor", WATCH_ROWS, WATCH_BATCH)
        busy = _Churn(client, "bench/watch", WATCH_ROWS, WATCH_BATCH)
        quiet.cycle(), busy.cycle()  # warm both pools up
        before = rss_anon_bytes(daemon.proc.pid)
        for _ in range(WATCH_CYCLES):
            quiet.cycle()
        floor = (rss_anon_bytes(daemon.proc.pid) - before) / MIB
        options = [("grpc.http2.bdp_probe", 0)]
        with grpc.insecure_channel("unix:" + daemon.socket, options=options) as channel:
            stub = pb2_grpc.KVTierStub(channel)
            request = pb2.WatchEventsRequest(pool="bench/watch", after_seq=-1)
            calls = [stub.WatchEvents(request) for _ in range(streams)]
            time.sleep(1.0)  # let the refused ones finish
            admitted = sum(1 for call in calls if not call.done())
            before = rss_anon_bytes(daemon.proc.pid)
            for _ in range(WATCH_CYCLES):
                busy.cycle()
            growth = (rss_anon_bytes(daemon.proc.pid) - before) / MIB
            for call in calls:
                call.cancel()
        client.close()
    return growth, floor, admitted


def watch() -> list[Row]:
    rows = []
    for max_streams in (64, WATCH_STREAMS):
        growth, floor, admitted = _watch_growth(max_streams, WATCH_STREAMS)
        rows.append(Row(
            "buffers", f"daemon RssAnon growth, {WATCH_STREAMS} never-read WatchEvents streams "
            f"({admitted} admitted), 20 churn cycles of 4,096 rows", growth, "MiB",
            floor=f"{floor:.1f} MiB same churn, no stream", target="bounded by max_watch_streams",
        ))  # fmt: skip
    return rows


def run() -> list[Row]:
    return churn() + watch()


if __name__ == "__main__":
    from benchmarks.common import print_table

    print_table(run())
