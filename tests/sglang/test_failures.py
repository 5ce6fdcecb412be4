"""The data path never raises: a daemon that stops and restarts is a run of misses,
logged once per kind, then hits again through the same backend; SGLang's controller
threads (prefetch, prefetch I/O, backup) call at once, through a restart and with
SGLang's own fault injector on, and every page reported loaded is bit-exact.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import pytest
from daemon_harness import eventually, start_daemon

from benchmarks import sglang_env as env

FAST_RETRY = {"kvtierd_retry_interval": 0.05, "kvtierd_timeout": 2}


def _backend(address: str, **extra: object) -> tuple[object, object]:
    pool = env.mha_host_pool("page_first", device_tokens=256)
    return pool, env.create_backend(env.storage_config(address, **extra), pool)


def test_daemon_restart_is_misses_then_hits_again_without_a_new_backend(caplog):
    daemon = start_daemon("--memory-budget", "256MiB")
    try:
        pool, b = _backend(daemon.address, **FAST_RETRY)
        keys = env.page_keys("restart", 4)
        env.fill_pages(pool, [1, 2, 3, 4], seed=1)
        assert b.batch_set_v1(keys, env.token_slots(pool, [1, 2, 3, 4])) == [True] * 4
        assert daemon.stop() == 0

        caplog.set_level(logging.WARNING, logger="kvtierd_client.sglang")
        slots = env.token_slots(pool, [5, 6, 7, 8])
        calls, until = 0, time.monotonic() + 1.0  # retries every 0.05 s meanwhile
        while time.monotonic() < until:
            assert b.batch_exists(keys) == 0
            assert b.batch_get_v1(keys, slots) == [False] * 4
            assert b.batch_set_v1(keys, slots) == [False] * 4
            calls += 3
            time.sleep(0.01)  # lets the retry interval pass now and then
        lines = [r for r in caplog.records if r.name.startswith("kvtierd_client.sglang.")]
        # one line per kind ("gone": the session died with the daemon; "unavailable":
        # reconnects fail; "refused": an answer of the stopping daemon) however many calls
        assert calls > 100 and 1 <= len(lines) <= 3, [r.getMessage() for r in lines]
        assert any("serving misses" in r.getMessage() for r in lines)

        daemon = daemon.restart()
        more = env.page_keys("after-restart", 3)
        env.fill_pages(pool, [9, 10, 11], seed=2)
        eventually(
            lambda: b.batch_set_v1(more, env.token_slots(pool, [9, 10, 11])) == [True] * 3,
            30, "stores through the same backend after the restart",
        )  # fmt: skip
        assert b.batch_get_v1(more, env.token_slots(pool, [12, 13, 14])) == [True] * 3
        assert [env.page_bytes(pool, p) for p in (12, 13, 14)] == [
            env.page_bytes(pool, p) for p in (9, 10, 11)
        ]
        stats = env.unwrap(b).statistics()
        assert stats.generation == 2 and stats.connected and stats.failures > 0
        b.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


class _Threads:
    """SGLang's three storage threads on one backend and one host pool: a backup thread
    storing new pages, a prefetch thread asking batch_exists, and a prefetch-I/O thread
    loading stored pages; each on its own host pages. Every loaded page is compared
    with the bytes stored under its key."""

    def __init__(self, backend: object, pool: object) -> None:
        self.backend, self.pool = backend, pool
        self.stop = threading.Event()
        self.stored: dict[str, bytes] = {}  # key -> its page's bytes (reported stored)
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.counts = {"stored": 0, "loaded": 0, "missed": 0, "exists": 0}

    def run(self, target: Callable[[int], None], seed: int) -> threading.Thread:
        def loop() -> None:
            i = 0
            try:
                while not self.stop.is_set():
                    target(i)
                    i += 1
            except BaseException as err:  # noqa: BLE001 - the test asserts there is none
                self.errors.append(err)

        thread = threading.Thread(target=loop, name=f"sglang-{seed}")
        thread.start()
        return thread

    def backup(self, i: int) -> None:
        pages = [1 + (i * 4 + j) % 40 for j in range(4)]
        keys = env.page_keys(f"threads-{i}", 4)
        env.fill_pages(self.pool, pages, seed=1000 + i)
        expected = [env.page_bytes(self.pool, p) for p in pages]
        ok = self.backend.batch_set_v1(keys, env.token_slots(self.pool, pages))
        with self.lock:
            for key, good, data in zip(keys, ok, expected, strict=True):
                if good:
                    self.stored[key] = data
                    self.counts["stored"] += 1

    def prefetch(self, i: int) -> None:
        keys = self._some_keys(8)
        if keys:
            found = self.backend.batch_exists(keys)
            assert 0 <= found <= len(keys)
            with self.lock:
                self.counts["exists"] += found

    def prefetch_io(self, i: int) -> None:
        keys = self._some_keys(6)
        if not keys:
            time.sleep(0.001)
            return
        pages = [60 + j for j in range(len(keys))]
        ok = self.backend.batch_get_v1(keys, env.token_slots(self.pool, pages))
        leading = ok.index(False) if False in ok else len(ok)
        assert ok == [True] * leading + [False] * (len(ok) - leading)
        for key, page, good in zip(keys, pages, ok, strict=True):
            if good:
                assert env.page_bytes(self.pool, page) == self.stored[key], key
        with self.lock:
            self.counts["loaded"] += leading
            self.counts["missed"] += len(ok) - leading

    def _some_keys(self, n: int) -> list[str]:
        with self.lock:
            known = list(self.stored)
        return random.sample(known, min(n, len(known)))

    def start(self) -> list[threading.Thread]:
        return [
            self.run(f, s) for s, f in enumerate((self.backup, self.prefetch, self.prefetch_io))
        ]

    def finish(self, threads: list[threading.Thread]) -> None:
        self.stop.set()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive()
        assert not self.errors, self.errors


def test_controller_threads_at_once_through_a_daemon_restart():
    daemon = start_daemon("--memory-budget", "256MiB")
    try:
        pool, b = _backend(daemon.address, **FAST_RETRY)
        run = _Threads(b, pool)
        threads = run.start()
        eventually(lambda: run.counts["loaded"] >= 20 or run.errors, 60, "loads before")
        assert daemon.stop() == 0
        before = dict(run.counts)
        daemon = daemon.restart()
        eventually(
            lambda: run.counts["loaded"] >= before["loaded"] + 20 or run.errors, 60,
            lambda: f"loads after the restart ({run.counts}, before {before})",
        )  # fmt: skip
        run.finish(threads)
        assert env.unwrap(b).statistics().generation >= 2
        b.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("failure", ["0.3"])
def test_sglangs_fault_injector_with_the_controller_threads(daemon, monkeypatch, failure):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", failure)
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    pool, b = _backend(daemon.address)
    assert type(b).__name__ == "HiCacheStorageFailureInjector"  # SGLang's own wrapper
    run = _Threads(b, pool)
    threads = run.start()
    eventually(
        lambda: (run.counts["loaded"] >= 30 and run.counts["missed"] >= 5) or run.errors,
        90, lambda: f"loads and injected misses ({run.counts})",
    )  # fmt: skip
    run.finish(threads)
    b.close()
