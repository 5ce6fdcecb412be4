"""The gap a client sees while the daemon is replaced (issue #33 item 5;
docs/operations/upgrades.md): a takeover (``kvtierd --takeover``) against a plain
stop then start (what ``systemctl restart`` does), alternating, ``--rounds`` times.

One client thread runs a tight loop against the socket: Lookups of the 64 keys
stored before (every tenth call a KeepAlive), a new session when the daemon
forgot its session. Per replacement: the longest interval between two
successful calls (the gap), the calls refused for want of a listening socket
(``connection refused`` / no socket file), the other failed calls, and whether
the last Lookup answered HIT for every key (warm restart adopted the pool).

``--vllm`` (run with the vLLM venv: ``make bench-upgrade-vllm``): the loop is the
shipped plug-in's ``KvtierdOffloadingManager`` instead (``lookup`` +
``touch`` every step), the gap the longest interval between two steps whose
lookup found every stored block.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from benchmarks.common import BenchDaemon, Row, machine, print_table
from kvtierd_client.client import Client, LookupResult, Session
from kvtierd_client.errors import KvtierError, NotFound

POOL = "bench/upgrade"
BLOCK = 4096
ROWS = 256
KEYS = [f"upgrade-{i}".encode() for i in range(64)]
REFUSALS = ("connection refused", "no such file or directory", "failed to connect")
SETTLE = 1.0  # seconds of calls before the replacement and after the first one after it


def is_refusal(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, ConnectionRefusedError | FileNotFoundError) or any(
        words in text for words in REFUSALS
    )


@dataclass
class Loop:
    """``step()`` as fast as it can in a thread: True when the call succeeded with
    every key found; each exception is counted (refusals apart)."""

    step: Callable[[], bool | None]
    successes: list[float] = field(default_factory=list)
    refused: int = 0
    failed: int = 0
    last_found_all: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Loop:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                found = self.step()
            except (KvtierError, OSError) as err:
                self.refused += is_refusal(err)
                self.failed += 1
                continue
            if found is None:  # the step answered without the daemon (plug-in: down)
                continue
            self.last_found_all = found
            if found:
                self.successes.append(time.monotonic())

    def longest_gap(self) -> float:
        times = self.successes
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


class ClientStep:
    """The Python client's loop step: a Lookup of the stored keys (every tenth call a
    KeepAlive) on a session reopened when the daemon forgot it."""

    def __init__(self, address: str) -> None:
        self.client = Client(address)
        self.session: Session | None = None
        self.calls = 0
        session = self.client.open_session(POOL, block_bytes=BLOCK, num_blocks=ROWS, layout="l1")
        grant = session.prepare_store(KEYS)
        assert grant is not None
        session.complete_store(grant.keys_to_store)
        session.close()

    def __call__(self) -> bool:
        if self.session is None:
            self.session = self.client.open_session(
                POOL, block_bytes=BLOCK, num_blocks=ROWS, layout="l1", keepalive=False
            )
        self.calls += 1
        try:
            if self.calls % 10 == 0:
                self.session.keep_alive()
                return True
            answer = self.session.lookup(KEYS)
        except NotFound:
            self.session = None
            raise
        return all(result is LookupResult.HIT for result in answer)

    def counters(self) -> dict[str, int]:
        return {}  # the loop counts this client's failures itself

    def close(self) -> None:
        self.client.close()


def _spawn(old: BenchDaemon, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*old.proc.args, *extra], stdout=old.log, stderr=subprocess.STDOUT
    )  # fmt: skip


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Step(Protocol):
    def __call__(self) -> bool | None: ...

    def counters(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def replace_once(how: str, make_step: Callable[[str], Step]) -> dict[str, Any]:
    """One replacement (``takeover`` or ``restart``) under the loop; its figures."""
    old = BenchDaemon("--memory-budget", "256MiB")
    new: subprocess.Popen[bytes] | None = None
    try:
        step = make_step(old.address)
        loop = Loop(step).start()
        try:
            _wait_until(lambda: len(loop.successes) > 10, 60, "calls before")
            time.sleep(SETTLE)  # calls before the replacement, on purpose
            if how == "takeover":
                new = _spawn(old, "--takeover")
                old.proc.wait(60)
            else:  # systemctl restart: stop, wait for the exit, start
                old.proc.send_signal(signal.SIGTERM)
                old.proc.wait(60)
                new = _spawn(old)
            gone = time.monotonic()  # the old daemon has exited: later calls reach the new
            _wait_until(lambda: loop.successes[-1] > gone, 60, "a call after")
            time.sleep(SETTLE)  # calls after it, on purpose
        finally:
            loop.stop()
            counted = step.counters()
            step.close()
        return {
            "gap": loop.longest_gap(),
            "refused": loop.refused,
            "failed": loop.failed,
            "hit": loop.last_found_all,
            "calls": len(loop.successes),
            **counted,
        }
    finally:
        if new is not None and new.poll() is None:
            new.send_signal(signal.SIGTERM)
            new.wait(60)
        old.close()


def run(
    rounds: int = 5, make_step: Callable[[str], Step] = ClientStep, label: str = "client"
) -> list[Row]:
    figures: dict[str, list[dict[str, Any]]] = {"takeover": [], "restart": []}
    for _ in range(rounds):
        for how in figures:  # alternating, same machine state
            figures[how].append(replace_once(how, make_step))
    rows = []
    for how, runs in figures.items():
        rows.extend(_rows(f"upgrade ({label})", how, runs))
    return rows


def _rows(group: str, how: str, runs: list[dict[str, Any]]) -> list[Row]:
    gaps = [r["gap"] * 1000 for r in runs]
    rows = [
        Row(group, f"{how}: longest gap, median of {len(runs)}", statistics.median(gaps), "ms"),
        Row(group, f"{how}: longest gap, worst", max(gaps), "ms"),
    ]
    if "reconnects" in runs[0]:  # the plug-in swallows errors: its own counters
        rows.append(Row(group, f"{how}: failed RPCs (plug-in counter), all rounds",
                        sum(r["failed"] for r in runs), "calls"))  # fmt: skip
        rows.append(Row(group, f"{how}: new sessions (plug-in counter), all rounds",
                        sum(r["reconnects"] for r in runs), "sessions"))  # fmt: skip
    else:
        rows.append(Row(group, f"{how}: refused connections, all rounds",
                        sum(r["refused"] for r in runs), "calls"))  # fmt: skip
        rows.append(Row(group, f"{how}: other failed calls, all rounds",
                        sum(r["failed"] - r["refused"] for r in runs), "calls"))  # fmt: skip
    rows.append(Row(group, f"{how}: rounds ending all HIT",
                    sum(bool(r["hit"]) for r in runs), f"of {len(runs)}"))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.upgrade", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vllm", action="store_true", help="the plug-in's manager as client")
    args = parser.parse_args()
    if args.vllm:
        from benchmarks.upgrade_vllm import ManagerStep

        rows = run(args.rounds, ManagerStep, "vLLM manager")
    else:
        rows = run(args.rounds)
    print(f"\nmachine: {machine()}; load {os.getloadavg()[0]:.2f}\n")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
