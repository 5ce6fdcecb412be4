"""Warm restart's hashing off the daemon (kvtierd.primary.warm.hashworker): the journal's row
checksums are computed by a helper process of a real daemon. A worker that
stalls delays the journal but never makes it drop a completed block (the backlog
holds one entry per row) nor holds the daemon's stop; a worker that dies is
replaced; whatever was journaled comes back bit-exact after a restart."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from daemon_harness import DaemonProcess, Exits, ctl, eventually, gone
from warm_harness import BLOCK, HIT, MISS, assert_bit_exact, restart, store

from kvtierd_client.client import Client

ROWS = 16
_CLOSED = re.compile(r"(\d+) completed blocks journaled, (\d+) handed out again")


def hash_workers(daemon: DaemonProcess) -> list[int]:
    """Process ids of the daemon's hash workers (its children running
    kvtierd.primary.warm.hashworker)."""
    pids: list[int] = []
    for task in os.listdir(f"/proc/{daemon.proc.pid}/task"):
        try:
            children = Path(f"/proc/{daemon.proc.pid}/task/{task}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        for child in map(int, children):
            try:
                if (
                    b"kvtierd.primary.warm.hashworker"
                    in Path(f"/proc/{child}/cmdline").read_bytes()
                ):
                    pids.append(child)
            except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
                continue
    return pids


def _stall_and_store(daemon: DaemonProcess, session) -> tuple[int, list[bytes]]:
    """Stores one block (so a worker runs), SIGSTOPs the worker, then stores 6 x ROWS
    blocks into the ROWS-row pool (every row handed out again and again while
    nothing gets hashed). Returns the worker's pid and the keys that are ready."""
    store(session, [b"first"])
    (worker,) = eventually(lambda: hash_workers(daemon), 30, "the daemon's hash worker")
    # the daemon's own priority: a niced worker got no CPU on a saturated node
    assert os.getpriority(os.PRIO_PROCESS, worker) == os.getpriority(
        os.PRIO_PROCESS, daemon.proc.pid
    )
    os.kill(worker, signal.SIGSTOP)
    keys = [f"lag-{i}".encode() for i in range(6 * ROWS)]
    for first in range(0, len(keys), ROWS // 2):
        started = time.monotonic()
        store(session, keys[first : first + ROWS // 2])
        # the store path does not wait for the hashing (generous: a busy CI box)
        assert time.monotonic() - started < 5.0
    final = keys[-ROWS:]
    assert session.lookup(final) == [HIT] * ROWS
    return worker, final


def test_a_stalled_hash_worker_delays_the_journal_but_drops_no_completed_block(warm_daemon):
    """97 completions in a 16-row pool while the worker is stopped: the backlog keeps
    one entry per row (a bounded queue of 2 x rows used to drop the newest, the very
    blocks still ready), so once the worker goes on every ready block is journaled
    and a SIGTERM restart serves all of them bit-exact."""
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = client.open_session("lag", block_bytes=BLOCK, num_blocks=ROWS, layout="l1")
        worker, final = _stall_and_store(daemon, session)
        # the lag shows: GetStats (the metric's source) and kvtierctl stats
        lag = lambda: client.get_stats("lag").pools[0].journal_lag_seconds  # noqa: E731
        eventually(lambda: lag() >= 0.5, 30, lambda: f"the journal's lag grown; {lag()}s")
        header, primary, *_ = ctl(daemon.address, "stats", "--pool", "lag").stdout.splitlines()
        column = header.split().index("lag") - len(header.split())  # from the end
        assert float(primary.split()[column].removesuffix("s")) >= 0.5, primary
        os.kill(worker, signal.SIGCONT)
        eventually(lambda: lag() == 0.0, 30, lambda: f"the journal caught up; lag {lag()}s")
    daemon = restart(daemon)
    warm_daemon.append(daemon)
    closed = _CLOSED.search(daemon.log())
    assert closed is not None, daemon.log()
    journaled, stale = int(closed.group(1)), int(closed.group(2))
    assert journaled + stale == 1 + 6 * ROWS  # every completion accounted for, none dropped
    with Client(daemon.address) as client:
        session = client.open_session("lag", block_bytes=BLOCK, num_blocks=ROWS, layout="l1")
        assert session.lookup(final) == [HIT] * ROWS
        assert_bit_exact(session, final)


def test_a_worker_stopped_for_good_neither_holds_the_stop_nor_loses_the_blocks(warm_daemon):
    """SIGTERM while the worker is still stopped: the stop waits the journal's drain
    (10 s), then interrupts the worker and hashes the backlog on the journal's own
    thread; the worker dies with it (PR_SET_PDEATHSIG / kill), the blocks come back."""
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = client.open_session("stuck", block_bytes=BLOCK, num_blocks=ROWS, layout="l1")
        worker, final = _stall_and_store(daemon, session)
    started = time.monotonic()
    daemon.stop(signal.SIGTERM, timeout=60)
    assert time.monotonic() - started < 40  # 10 s of drain, then the stop goes on
    assert daemon.proc.returncode == 0, daemon.log()
    eventually(lambda: gone(worker), 30, "the stopped worker killed", wake=Exits(worker))
    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("stuck", block_bytes=BLOCK, num_blocks=ROWS, layout="l1")
        assert session.lookup(final) == [HIT] * ROWS
        assert_bit_exact(session, final)
        assert session.lookup([b"first"]) == [MISS]  # evicted long ago


def test_a_killed_worker_is_replaced_and_a_crash_adopts_what_was_journaled(warm_daemon):
    """A worker killed by SIGBUS (what a client truncating the region under its
    hashing causes) costs no daemon and no block: the batch is hashed on the
    journal's thread and a new worker starts; after the daemon's SIGKILL the
    worker dies too and the next daemon adopts the journaled blocks bit-exact."""
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = client.open_session("bus", block_bytes=BLOCK, num_blocks=ROWS, layout="l1")
        store(session, [b"a"])
        (first,) = eventually(lambda: hash_workers(daemon), 30, "the daemon's hash worker")
        os.kill(first, signal.SIGBUS)
        eventually(lambda: gone(first), 30, "the worker dead", wake=Exits(first))
        keys = [f"after-{i}".encode() for i in range(8)]
        store(session, keys[:4])
        time.sleep(1.5)  # past the one-start-per-second backoff
        store(session, keys[4:])
        (second,) = eventually(lambda: hash_workers(daemon), 30, "a new hash worker")
        assert second != first and daemon.alive()
        lag = lambda: client.get_stats("bus").pools[0].journal_lag_seconds  # noqa: E731
        eventually(lambda: lag() == 0.0, 30, lambda: f"every completion journaled; lag {lag()}s")
    daemon.stop(signal.SIGKILL)
    eventually(lambda: gone(second), 30, "the worker killed with the daemon", wake=Exits(second))
    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("bus", block_bytes=BLOCK, num_blocks=ROWS, layout="l1")
        assert session.lookup([b"a", *keys]) == [HIT] * 9
        assert_bit_exact(session, [b"a", *keys])
