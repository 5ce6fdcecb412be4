"""vLLM's OpenAI server under a promotion storm (issue #15, item 5), with and without the fs tier.

Usage (from the repository root, with the vLLM venv)::

    .venv-vllm/bin/python -m benchmarks.vllm_storm [--rounds 3] [--configs fs,primary] ...

The issue's real-world scenario end to end: vLLM's OpenAI-compatible server
(``vllm.entrypoints.openai.api_server``, default multiprocess mode: API server,
engine core and worker are separate processes) runs the tiny local Llama of
``benchmarks/vllm_model.py`` with the kvtierd plug-in; the daemon is a real
process on a private socket. Per run:

1. a fresh daemon (``--configs``: ``fs`` = an fs tier in a temporary directory
   behind the primary; ``primary`` = no ``[[tiers]]``; ``fs-nohold`` = the fs
   tier with ``limits.promotion_hold = "0s"``, the daemon before promotion holds)
   and a fresh server whose pool has ``--pool-bytes`` of rows (8 MiB: 128 rows of
   64 KiB) and whose own KV cache is ``--kv-cache-bytes`` (4 MiB: 64 blocks, fewer
   than the documents' 220 blocks and the pool's rows, as a GPU cache is smaller
   than its CPU offload pool, so the daemon serves repeated loads all run long;
   with the 128 MiB of ``llm_kwargs()`` vLLM's own prefix cache keeps every
   document after its first load and the daemon loads each document once);
2. warm-up: every document once, one after the other; the run waits until the
   daemon stored all their blocks (with an fs tier: until the fs tier holds them
   all; a pass that falls short is repeated, see :func:`warm_up`),
   then flushes the pool's primary (``FlushPool``) and vLLM's own prefix cache
   (``POST /reset_prefix_cache``, dev mode): nothing is cached anywhere but in
   the fs tier, so with ``fs`` later hits are promotions from disk and with
   ``primary`` every document is recomputed once;
3. ``--requests`` streamed ``/v1/completions`` requests, ``--concurrency`` at a
   time: each a seeded-random document of ``--doc-blocks`` full blocks (the
   block size is read from the pool's layout) plus ``--suffix-tokens`` unique
   tokens, ``--max-tokens`` greedy tokens.

Measured: wall time and requests/s of the run, TTFT (first streamed chunk) and
request latency p50/p99/max, failed requests, and deltas over the run of the
daemon's ``GetStats`` (fs ``promoted_blocks``, ``promotion_no_room``; primary
``evictions`` and ``bytes_out`` / block bytes, which counts every ``CompleteLoad``,
including the lookup pins the plug-in releases unloaded) and of vLLM's
``/metrics``: blocks actually loaded (``prompt_tokens_by_source`` external /
block tokens, and ``kv_offload_load_bytes`` / row bytes), the mean wait for
pending keys (``kv_offload_lookup_async_delay_seconds``), the plug-in's key
lookups by result, round trips and scheduler steps; ``promoted / loaded``
divides by vLLM's token count. Also the 1-minute load average at the start and
end of the requests, ERROR lines in the daemon's and the server's logs (start
to stop) and WARNING lines during the requests. Configurations alternate within
each round (A, B, A, B, ...) so both see the same background load. Prints a
markdown table. Benchmarks are not tests: nothing here asserts.

The daemon and the server run this checkout's ``kvtierd`` and ``kvtierd_client``
(``PYTHONPATH``) when its gRPC stubs were generated (``make gen``), else the
copies installed in the venv. Environment of the server: ``VLLM_TARGET_DEVICE=cpu``,
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (the CPU build binds its cores differently when
a ``kv_transfer_config`` is given; the same value in every run keeps the binding
equal), ``VLLM_SERVER_DEV_MODE=1`` (for ``/reset_prefix_cache``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import devshm
from benchmarks.vllm_http import stop_server_group, vllm_metrics

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("fs", "primary", "fs-nohold")
CONFIG_HELP = {
    "fs": "an fs tier behind the primary (config A)",
    "primary": "no [[tiers]]: the primary tier alone (config B)",
    "fs-nohold": 'the fs tier with limits.promotion_hold = "0s" (the daemon before holds)',
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_storm",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--rounds", type=int, default=3, help="rounds; each runs every config once, in order")
    add(
        "--configs",
        default="fs,primary",
        help="comma-separated configs run in this order in every round: "
        + "; ".join(f"{k} = {v}" for k, v in CONFIG_HELP.items()),
    )
    add("--requests", type=int, default=200, help="measured requests per run")
    add("--concurrency", type=int, default=32, help="requests in flight at once")
    add("--docs", type=int, default=20, help="shared documents")
    add("--doc-blocks", type=int, default=11, help="full KV blocks per document")
    add("--suffix-tokens", type=int, default=4, help="unique tokens after the document")
    add("--max-tokens", type=int, default=8, help="tokens generated per request")
    add("--seed", type=int, default=0, help="seed of the documents, picks and suffixes")
    add(
        "--pool-bytes",
        type=int,
        default=8 << 20,
        help="the plug-in's cpu_bytes_to_use: rows = this // row bytes (64 KiB here)",
    )
    add(
        "--kv-cache-bytes",
        type=int,
        default=4 << 20,
        help="vLLM's own KV cache (--kv-cache-memory-bytes): 64 blocks of 64 KiB, fewer "
        "than the documents' blocks; llm_kwargs() uses 128 MiB, which holds them all",
    )
    add("--max-num-seqs", type=int, default=4, help="vLLM's --max-num-seqs (as llm_kwargs())")
    add("--memory-budget", default="256MiB", help="the daemon's memory.budget")
    add(
        "--fs-dir",
        default=os.environ.get("KVTIERD_BENCH_FS_ROOT", "/var/tmp"),
        help="parent of the fs tier's temporary root ($KVTIERD_BENCH_FS_ROOT)",
    )
    add("--bound", type=float, default=300.0, help="seconds after which a run stops waiting")
    add("--start-timeout", type=float, default=300.0, help="seconds the server may take to start")
    add(
        "--model-dir",
        default="",
        help="the tiny Llama's directory (built there if empty; default: a temporary one)",
    )
    add("--keep-logs", default="", help="copy each run's daemon and server logs into this dir")
    add("--output", default="", help="also write the markdown table to this file")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- processes


def child_env() -> dict[str, str]:
    """The environment of the daemon and the server: this checkout's code first."""
    env = dict(os.environ)
    if (REPO / "client" / "kvtierd_client" / "_proto").is_dir():
        paths = [str(REPO), str(REPO / "client")]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default: multiprocess
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_NUM_OF_RESERVED_CPU="1",
        VLLM_SERVER_DEV_MODE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def code_origin(env: dict[str, str]) -> str:
    probe = "import kvtierd, kvtierd_client; print(kvtierd.__file__, kvtierd_client.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd="/", capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_config(name: str, fs_root: str, budget: str) -> str:
    text = f'[memory]\nbudget = "{budget}"\n'
    if name == "fs-nohold":
        text += '[limits]\npromotion_hold = "0s"\n'
    if name in ("fs", "fs-nohold"):
        text += f'[[tiers]]\ntype = "fs"\nname = "fs"\nroot = "{fs_root}"\n'
    return text


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group."""

    def __init__(self, args: argparse.Namespace, model: str, address: str, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        fd, self.log_path = tempfile.mkstemp(prefix="vllm-storm-server-", suffix=".log")
        os.close(fd)
        kv = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KvtierdOffloadingSpec",
                "spec_module_path": "kvtierd_client.vllm",
                "kvtierd_address": address,
                "cpu_bytes_to_use": args.pool_bytes,
            },
        }
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
            "--enable-prefix-caching", "--max-num-seqs", str(args.max_num_seqs),
            "--kv-cache-memory-bytes", str(args.kv_cache_bytes), "--seed", "0",
            "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip
        self.shm_before = devshm.entries()  # what is in /dev/shm before it: not its to clean
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = "\n".join(self.log().splitlines()[-40:])
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM server not healthy after {timeout:.0f} s (log {self.log_path})")

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + path, data, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples, keyed by ``name{labels}`` minus the common labels."""
        return vllm_metrics(self.url)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to what is left of the whole group (engine core and
        worker too); the shared memory a SIGKILL left in /dev/shm is removed."""
        stop_server_group(self.proc, self.shm_before)


# ---------------------------------------------------------------- requests


@dataclass
class Outcome:
    ttft: float | None = None
    latency: float | None = None
    error: str = ""


async def one_request(session: Any, url: str, body: dict[str, Any], timeout: float) -> Outcome:
    import aiohttp

    start = time.perf_counter()
    outcome = Outcome()
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return outcome
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                if line.strip() == b"data: [DONE]":
                    break
                if b'"error"' in line:
                    outcome.error = line.decode(errors="replace")[:200]
                if outcome.ttft is None:
                    outcome.ttft = time.perf_counter() - start
        outcome.latency = time.perf_counter() - start
    except TimeoutError:
        outcome.error = f"timeout after {timeout:.0f} s"
    except Exception as exc:  # noqa: BLE001 - every failure is a counted outcome
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    return outcome


async def send_all(
    url: str, bodies: list[dict[str, Any]], concurrency: int, bound: float
) -> tuple[list[Outcome], float]:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        deadline = start + bound

        async def gated(body: dict[str, Any]) -> Outcome:
            async with gate:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return Outcome(error=f"not sent: run bound of {bound:.0f} s reached")
                return await one_request(session, url + "/v1/completions", body, left)

        outcomes = await asyncio.gather(*(gated(body) for body in bodies))
        return list(outcomes), time.perf_counter() - start


def completion(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


# ---------------------------------------------------------------- one run


@dataclass
class RunResult:
    round: int
    config: str
    rows: int = 0
    block_tokens: int = 0
    warm_blocks: int = 0  # blocks the warm-up stored into the primary
    warm_on_disk: int = 0  # of them, on the fs tier after the cascades
    wall: float = 0.0
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    promoted: int = 0
    no_room: int = 0
    promotion_failures: int = 0
    completed_loads: int = 0  # primary bytes_out / block bytes (every CompleteLoad)
    external_blocks: float = 0.0  # vLLM: external_kv_transfer tokens / block tokens
    copied_blocks: float = 0.0  # vLLM: kv_offload_load_bytes / block bytes
    pending_wait: float = float("nan")  # vLLM: mean kv_offload_lookup_async_delay, s
    evictions: int = 0
    lookups: float = 0.0
    lookup_results: dict[str, float] = field(default_factory=dict)
    steps: float = 0.0
    round_trips: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at start, end
    log_errors: int = 0  # ERROR / Traceback lines of both logs, start to stop
    log_warnings: int = 0  # WARNING lines of both logs during the measured requests
    note: str = ""


def pool_of(address: str) -> Any:
    from kvtierd_client.client import Client

    with Client(address) as client:
        pools = client.get_stats("").pools
    if len(pools) != 1:
        raise RuntimeError(f"expected the server's one pool, found {[p.name for p in pools]}")
    return pools[0]


def tier_named(stats: Any, name: str) -> Any:
    return next((t for t in stats.tiers if t.tier == name), None)


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def documents(count: int, tokens: int, seed: int) -> list[list[int]]:
    from benchmarks.vllm_model import random_prompt

    return [random_prompt(tokens, seed=seed * 1_000_003 + 7919 * (i + 1)) for i in range(count)]


def reset_local_cache(server: Server) -> None:
    """Empties vLLM's own prefix cache (not the connector's)."""
    for _ in range(50):
        if server.post("/reset_prefix_cache").get("success"):
            return
        time.sleep(0.2)
    raise RuntimeError("vLLM refused to reset its prefix cache")


def warm_up(
    server: Server,
    client: Any,
    pool: str,
    docs: list[list[int]],
    model: str,
    expected: int,
    result: RunResult,
) -> None:
    """Sends every document once, one after the other, and waits until the daemon
    stored their ``expected`` blocks (with an fs tier: until the fs tier holds them
    all and no tier job is in flight). A pass whose stores stop short (a store
    refused, a last completion never sent) is repeated with vLLM's own cache reset,
    so what the daemon holds is loaded and only what is missing is stored again; at
    most three passes, then the run goes on and says how many blocks it had."""

    def state() -> tuple[int, int, int]:
        stats = client.get_stats(pool).pools[0]
        fs = tier_named(stats, "fs")
        jobs = sum(t.jobs_in_flight for t in stats.tiers[1:])
        on_disk = int(fs.used_blocks) if fs is not None else -1
        return int(stats.tiers[0].bytes_in // stats.block_bytes), on_disk, jobs

    def done(now: tuple[int, int, int]) -> bool:
        stored, on_disk, jobs = now
        return jobs == 0 and (on_disk >= expected if on_disk >= 0 else stored >= expected)

    now = state()
    for attempt in range(3):
        if attempt:
            reset_local_cache(server)
        for i, doc in enumerate(docs):
            body = {**completion(model, doc + [3 + i], 1), "stream": False}
            server.post("/v1/completions", body)
        last, since, deadline = None, time.monotonic(), time.monotonic() + 60
        while not done(now := state()) and time.monotonic() < deadline:
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > 5:
                break  # no progress: another pass
            time.sleep(0.1)
        if done(now):
            break
    result.warm_blocks, result.warm_on_disk = now[0], max(now[1], 0)
    if not done(now):
        result.note += (
            f"warm-up short after 3 passes: {now[0]} blocks stored, {now[1]} on disk, "
            f"{now[2]} tier jobs in flight (of {expected}); "
        )


def run_once(
    args: argparse.Namespace, config: str, round_no: int, model: str, env: dict[str, str]
) -> RunResult:
    from daemon_harness import start_daemon  # the tests' daemon launcher

    from kvtierd_client.client import Client

    result = RunResult(round_no, config)
    fs_root = tempfile.mkdtemp(prefix="kvtierd-vllm-storm-", dir=args.fs_dir)
    saved_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the harness starts the daemon with os.environ
    try:
        daemon = start_daemon(
            "--log-level", "info",
            config=daemon_config(config, fs_root, args.memory_budget),
        )  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    server = None
    try:
        server = Server(args, model, daemon.address, env)
        server.wait_ready(args.start_timeout)
        pool = pool_of(daemon.address)
        result.rows = int(pool.num_blocks)
        block_bytes = int(pool.block_bytes)
        match = re.search(r"tokens_per_hash=(\d+)", pool.layout)
        if not match:
            raise RuntimeError(f"no tokens_per_hash in the pool's layout {pool.layout!r}")
        block_tokens = result.block_tokens = int(match.group(1))
        docs = documents(args.docs, args.doc_blocks * block_tokens, args.seed)
        rng = random.Random(args.seed)
        picks = [rng.randrange(args.docs) for _ in range(args.requests)]
        bodies = [
            completion(
                model,
                docs[doc] + [rng.randrange(3, 1000) for _ in range(args.suffix_tokens)],
                args.max_tokens,
            )
            for doc in picks
        ]

        # warm-up: every document once, then nothing cached but in the fs tier
        expected = args.docs * args.doc_blocks
        with Client(daemon.address) as client:
            warm_up(server, client, pool.name, docs, model, expected, result)
            reset_local_cache(server)
            client.flush_pool(pool.name)
            used = client.get_stats(pool.name).pools[0].tiers[0].used_blocks
            if used:
                result.note += f"{used} blocks still in the primary after FlushPool; "
            before = client.get_stats(pool.name).pools[0]
            metrics_before = server.metrics()

            result.load = (os.getloadavg()[0], 0.0)
            marks = (len(daemon.log()), len(server.log()))
            outcomes, result.wall = asyncio.run(
                send_all(server.url, bodies, args.concurrency, args.bound)
            )
            result.load = (result.load[0], os.getloadavg()[0])
            result.log_warnings = count_lines(daemon.log()[marks[0] :], " WARNING ")
            result.log_warnings += count_lines(server.log()[marks[1] :], " WARNING ")
            try:
                wait_for(
                    lambda: all(
                        t.jobs_in_flight == 0 for t in client.get_stats(pool.name).pools[0].tiers
                    ),
                    30,
                    "tier jobs to end",
                )
            except RuntimeError as exc:
                result.note += f"{exc}; "
            after = client.get_stats(pool.name).pools[0]
        metrics_after = server.metrics()

        for outcome in outcomes:
            if outcome.error:
                result.errors.append(outcome.error)
            else:
                result.ok += 1
            if outcome.ttft is not None:
                result.ttft.append(outcome.ttft)
            if outcome.latency is not None:
                result.latency.append(outcome.latency)
        p0, p1 = before.tiers[0], after.tiers[0]
        result.completed_loads = (p1.bytes_out - p0.bytes_out) // block_bytes
        result.evictions = p1.evictions - p0.evictions
        f0, f1 = tier_named(before, "fs"), tier_named(after, "fs")
        if f0 is not None and f1 is not None:
            result.promoted = f1.promoted_blocks - f0.promoted_blocks
            result.no_room = f1.promotion_no_room - f0.promotion_no_room
            result.promotion_failures = f1.promotion_failures - f0.promotion_failures

        def delta(key: str) -> float:
            return metrics_after.get(key, 0.0) - metrics_before.get(key, 0.0)

        external = delta('vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}')
        result.external_blocks = external / block_tokens
        copied = first_delta(delta, metrics_after, "vllm:kv_offload_load_bytes")
        result.copied_blocks = copied / block_bytes
        waits = first_delta(
            delta, metrics_after, "vllm:kv_offload_lookup_async_delay_seconds_count"
        )
        if waits:
            total = first_delta(
                delta, metrics_after, "vllm:kv_offload_lookup_async_delay_seconds_sum"
            )
            result.pending_wait = total / waits
        for key in metrics_after:
            found = re.fullmatch(r'vllm:kv_offload_kvtierd_lookups_total\{result="(\w+)"\}', key)
            if found:
                result.lookup_results[found.group(1)] = delta(key)
        result.lookups = sum(result.lookup_results.values())
        result.steps = delta("vllm:kv_offload_kvtierd_scheduler_steps_total")
        result.round_trips = delta("vllm:kv_offload_kvtierd_round_trips_total")
    finally:
        result.log_errors = count_errors(daemon.log())
        if server is not None:
            result.log_errors += count_errors(server.log())  # not vLLM's own shutdown noise
            server.stop()
        daemon.stop()
        if args.keep_logs:
            os.makedirs(args.keep_logs, exist_ok=True)
            stem = f"{round_no}-{config}"
            shutil.copy(daemon.log_path, os.path.join(args.keep_logs, f"{stem}-daemon.log"))
            if server is not None:
                shutil.copy(server.log_path, os.path.join(args.keep_logs, f"{stem}-server.log"))
        daemon.cleanup()
        if server is not None:
            os.unlink(server.log_path)
        shutil.rmtree(fs_root, ignore_errors=True)
    return result


def count_errors(log: str) -> int:
    return sum(1 for line in log.splitlines() if " ERROR " in line or line.startswith("Traceback"))


def count_lines(log: str, marker: str) -> int:
    return sum(1 for line in log.splitlines() if marker in line)


def first_delta(delta: Any, metrics: dict[str, float], name: str) -> float:
    """The delta of ``name`` as a counter (``_total``) or as it is, whichever vLLM exports."""
    for key in (name + "_total", name):
        if key in metrics:
            return float(delta(key))
    return 0.0


# ---------------------------------------------------------------- table


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def table(results: list[RunResult]) -> str:
    header = [
        "round", "config", "wall s", "req/s", "TTFT p50 / p99 / max ms",
        "latency p50 / p99 / max ms", "ok / failed", "promoted (fs)",
        "loaded (vLLM: tokens / bytes)", "promoted / loaded", "CompleteLoad (daemon)",
        "evictions", "promotion no room", "pending wait mean s",
        "key lookups (hit / pending / miss)", "round trips", "steps", "load avg 1m",
        "log errors / warnings",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in results:

        def ms3(samples: list[float]) -> str:
            if not samples:
                return "-"
            return " / ".join(f"{pct(samples, q) * 1000:,.0f}" for q in (0.5, 0.99, 1.0))

        lr = r.lookup_results
        other = sum(v for k, v in lr.items() if k not in ("hit", "hit_pending", "miss"))
        lookups = (
            f"{r.lookups:,.0f} ({lr.get('hit', 0):,.0f} / {lr.get('hit_pending', 0):,.0f} / "
            f"{lr.get('miss', 0):,.0f}{f' / {other:,.0f} other' if other else ''})"
        )
        ratio = f"{r.promoted / r.external_blocks:.2f}" if r.external_blocks else "-"
        wait = "-" if r.pending_wait != r.pending_wait else f"{r.pending_wait:.2f}"  # NaN: none
        cells = [
            str(r.round), r.config, f"{r.wall:.1f}", f"{r.ok / r.wall:.1f}" if r.wall else "-",
            ms3(r.ttft), ms3(r.latency), f"{r.ok} / {len(r.errors)}",
            f"{r.promoted:,}" if r.config != "primary" else "-",
            f"{r.external_blocks:,.0f} / {r.copied_blocks:,.0f}", ratio,
            f"{r.completed_loads:,}", f"{r.evictions:,}",
            f"{r.no_room:,}" if r.config != "primary" else "-", wait, lookups,
            f"{r.round_trips:,.0f}", f"{r.steps:,.0f}",
            f"{r.load[0]:.1f} -> {r.load[1]:.1f}", f"{r.log_errors} / {r.log_warnings}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: list[RunResult], configs: list[str]) -> list[str]:
    out = []
    for config in configs:
        runs = [r for r in results if r.config == config and r.wall]
        if not runs:
            continue
        rates = [r.ok / r.wall for r in runs]
        out.append(
            f"- {config}: median {statistics.median(rates):.1f} req/s over {len(runs)} runs "
            f"(min {min(rates):.1f}, max {max(rates):.1f}); slowest request "
            f"{max(max(r.latency, default=0) for r in runs):.1f} s; failed requests "
            f"{sum(len(r.errors) for r in runs)}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from benchmarks.common import machine
    from benchmarks.vllm_model import build_tiny_llama

    env = child_env()
    print(f"machine: {machine()}", flush=True)
    print(f"code (daemon, server): {code_origin(env)}", flush=True)
    model_tmp = None
    model = args.model_dir
    if not model:
        model_tmp = tempfile.mkdtemp(prefix="tiny-llama-")
        model = model_tmp
    if not (Path(model) / "config.json").exists():
        build_tiny_llama(model)
    results: list[RunResult] = []
    try:
        for round_no in range(1, args.rounds + 1):
            for config in configs:
                print(f"round {round_no}, {config} ...", flush=True)
                start = time.monotonic()
                try:
                    result = run_once(args, config, round_no, model, env)
                except Exception as exc:  # noqa: BLE001 - a failed run is a result
                    print(f"  failed: {type(exc).__name__}: {exc}", flush=True)
                    result = RunResult(round_no, config, note=f"failed: {exc}"[:300])
                results.append(result)
                print(
                    f"  {result.ok}/{args.requests} ok in {result.wall:.1f} s "
                    f"(run incl. start {time.monotonic() - start:.0f} s); rows {result.rows}, "
                    f"block {result.block_tokens} tokens, warm-up {result.warm_blocks} blocks "
                    f"stored, {result.warm_on_disk} on disk; promoted {result.promoted}, "
                    f"loaded {result.external_blocks:.0f} / {result.copied_blocks:.0f}"
                    f"{'; ' + result.note if result.note else ''}",
                    flush=True,
                )
                for error in sorted(set(result.errors))[:5]:
                    print(f"  error: {error}", flush=True)
    finally:
        if model_tmp:
            shutil.rmtree(model_tmp, ignore_errors=True)
    text = "\n".join(
        [
            "",
            f"vLLM OpenAI server storm: {args.requests} requests, {args.concurrency} concurrent, "
            f"{args.docs} documents x {args.doc_blocks} blocks, pool {args.pool_bytes >> 20} MiB, "
            f"vLLM KV cache {args.kv_cache_bytes >> 20} MiB, max_num_seqs {args.max_num_seqs}",
            "",
            table(results),
            "",
            *summary(results, configs),
        ]
    )
    print(text, flush=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
