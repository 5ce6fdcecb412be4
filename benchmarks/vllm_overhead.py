"""kvtierd's cost under vLLM's OpenAI server at 0 % reuse, against a do-nothing spec.

Usage (from the repository root, with the vLLM venv; the env of ``make bench-vllm``)::

    PYTHONPATH=$PWD/client:$PWD VLLM_TARGET_DEVICE=cpu \\
        .venv-vllm/bin/python -m benchmarks.vllm_overhead [--rounds 2] [--configs none,noop,kvtierd]

Issue #21's last target: "vLLM OpenAI server at 0 % reuse: kvtierd's cost over
a do-nothing spec <= 3 % of throughput". Every run starts vLLM's OpenAI server
(``vllm.entrypoints.openai.api_server``, multiprocess as users run it; the tiny
local Llama of ``benchmarks/vllm_model.py``; ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
in every run so that every configuration binds the same cores) one of three
ways, alternating within each round so that all see the same background load:

- ``none``: no ``--kv-transfer-config``;
- ``noop``: vLLM's ``OffloadingConnector`` with ``benchmarks.vllm_noop_spec``
  (every lookup a MISS, no store): vLLM's connector machinery alone;
- ``kvtierd``: the ``OffloadingConnector`` with the kvtierd plug-in
  (``KvtierdOffloadingSpec``) and a fresh daemon (primary tier only, a pool of
  ``--pool-bytes``): every prompt block is looked up and stored.

Every prompt is unique (no block is ever loaded). Measured per run, after
``--warmup`` requests: ``--sequential`` streamed requests one at a time
(requests/s; vLLM's own mean time to first token and inter-token latency, i.e.
decode ms per token, from its ``/metrics`` deltas), then ``--concurrent``
requests ``--concurrency`` at a time (requests/s), and over both the CPU time
per request of the server's whole process group (API server, engine core,
worker) plus, for kvtierd, the daemon's. On a busy 2-core machine the CPU per
request is the steadier measure: throughput there is the inverse of the CPU a
request needs, and wall times swing with the other load. Prints a markdown
table and each configuration's throughput and CPU against ``noop`` and
``none``. Benchmarks are not tests: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import devshm
from benchmarks.common import BenchDaemon, cpu_seconds
from benchmarks.vllm_storm import Server, child_env, completion, free_port, send_all

ITL = "vllm:inter_token_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"

CONFIGS = ("none", "noop", "kvtierd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_overhead",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--rounds", type=int, default=3, help="rounds; each runs every config once, in order")
    add("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    add("--warmup", type=int, default=4, help="unmeasured requests after the server starts")
    add("--sequential", type=int, default=40, help="measured requests, one at a time")
    add("--concurrent", type=int, default=48, help="measured requests, --concurrency at a time")
    add("--concurrency", type=int, default=4, help="requests in flight in the concurrent part")
    add("--prompt-tokens", type=int, default=256, help="tokens per (unique) prompt")
    add("--max-tokens", type=int, default=32, help="tokens generated per request")
    add("--pool-bytes", type=int, default=64 << 20, help="kvtierd: the plug-in's cpu_bytes_to_use")
    add("--kv-cache-bytes", type=int, default=128 << 20, help="vLLM's --kv-cache-memory-bytes")
    add("--max-num-seqs", type=int, default=4, help="vLLM's --max-num-seqs")
    add("--memory-budget", default="256MiB", help="the daemon's memory.budget")
    add("--start-timeout", type=float, default=300.0, help="seconds a server may take to start")
    add("--bound", type=float, default=300.0, help="seconds after which a part stops waiting")
    add("--output", default="", help="also write the markdown table to this file")
    return parser.parse_args(argv)


def server_command(
    args: argparse.Namespace, config: str, model: str, port: int, address: str
) -> list[str]:
    """The server's command line for ``config``: the same in every configuration
    but for ``--kv-transfer-config`` (absent for ``none``)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
        "--enable-prefix-caching", "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes), "--seed", "0",
    ]  # fmt: skip
    if config == "none":
        return command
    if config == "noop":
        extra = {"spec_name": "NoopOffloadingSpec", "spec_module_path": "benchmarks.vllm_noop_spec"}
    else:
        extra = {
            "spec_name": "KvtierdOffloadingSpec",
            "spec_module_path": "kvtierd_client.vllm",
            "kvtierd_address": address,
            "cpu_bytes_to_use": args.pool_bytes,
        }
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": extra}  # fmt: skip
    return [*command, "--kv-transfer-config", json.dumps(kv)]


class OverheadServer(Server):
    """``vllm_storm.Server`` with the connector of one configuration (or none), in
    ``vllm_storm.child_env()`` (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: every
    configuration binds the same cores)."""

    def __init__(self, args: argparse.Namespace, config: str, model: str, address: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        fd, self.log_path = tempfile.mkstemp(prefix=f"vllm-overhead-{config}-", suffix=".log")
        os.close(fd)
        command = server_command(args, config, model, self.port, address)
        self.shm_before = devshm.entries()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                start_new_session=True,
            )  # fmt: skip


@dataclass
class Run:
    round: int
    config: str
    sequential_wall: float = 0.0
    ttft: float = float("nan")  # vLLM's mean time to first token, sequential part
    decode_per_token: float = float("nan")  # vLLM's mean inter-token latency, sequential
    concurrent_wall: float = 0.0
    errors: list[str] = field(default_factory=list)
    server_cpu: float = 0.0  # CPU seconds of the server's process group, both parts
    daemon_cpu: float = 0.0  # the daemon's (kvtierd runs only), both parts
    load: tuple[float, float] = (0.0, 0.0)

    def sequential_rps(self, count: int) -> float:
        return count / self.sequential_wall if self.sequential_wall else 0.0

    def concurrent_rps(self, count: int) -> float:
        return count / self.concurrent_wall if self.concurrent_wall else 0.0


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds so far of the live processes of process group ``pgid``."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid:
            total += cpu_fields_seconds(fields)
    return total


def cpu_fields_seconds(fields: list[str]) -> float:
    """utime + stime of a /proc/<pid>/stat line's fields after the command name."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _delta_mean(before: dict[str, float], after: dict[str, float], name: str) -> float:
    count = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
    total = after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)
    return total / count if count else float("nan")


def _prompts(args: argparse.Namespace, config: str, round_no: int, count: int) -> list[list[int]]:
    from benchmarks.vllm_model import random_prompt

    base = (CONFIGS.index(config) + 1) * 1_000_003 + round_no * 10_007
    return [random_prompt(args.prompt_tokens, seed=base + 7919 * i) for i in range(count)]


def run_once(args: argparse.Namespace, config: str, round_no: int, model: str) -> Run:
    run = Run(round_no, config)
    daemon = BenchDaemon("--memory-budget", args.memory_budget) if config == "kvtierd" else None
    server = None
    try:
        server = OverheadServer(args, config, model, daemon.address if daemon else "")
        server.wait_ready(args.start_timeout)
        total = args.warmup + args.sequential + args.concurrent
        prompts = _prompts(args, config, round_no, total)
        for prompt in prompts[: args.warmup]:
            server.post("/v1/completions", {**completion(model, prompt, args.max_tokens),
                                            "stream": False})  # fmt: skip
        sequential = prompts[args.warmup : args.warmup + args.sequential]
        concurrent = prompts[args.warmup + args.sequential :]
        run.load = (os.getloadavg()[0], 0.0)
        metrics_before = server.metrics()
        daemon_before = cpu_seconds(daemon.proc.pid) if daemon else 0.0
        server_before = group_cpu_seconds(server.proc.pid)
        started = time.perf_counter()
        for prompt in sequential:
            outcomes, _ = asyncio.run(
                send_all(server.url, [completion(model, prompt, args.max_tokens)], 1, args.bound)
            )
            run.errors += [o.error for o in outcomes if o.error]
        run.sequential_wall = time.perf_counter() - started
        metrics_after = server.metrics()
        run.ttft = _delta_mean(metrics_before, metrics_after, TTFT)
        run.decode_per_token = _delta_mean(metrics_before, metrics_after, ITL)
        bodies = [completion(model, prompt, args.max_tokens) for prompt in concurrent]
        outcomes, run.concurrent_wall = asyncio.run(
            send_all(server.url, bodies, args.concurrency, args.bound)
        )
        run.errors += [o.error for o in outcomes if o.error]
        run.server_cpu = group_cpu_seconds(server.proc.pid) - server_before
        if daemon:
            run.daemon_cpu = cpu_seconds(daemon.proc.pid) - daemon_before
        run.load = (run.load[0], os.getloadavg()[0])
    finally:
        if server is not None:
            server.stop()
            os.unlink(server.log_path)
        if daemon is not None:
            daemon.close()
    return run


def cpu_per_request(args: argparse.Namespace, run: Run) -> float:
    """CPU seconds per measured request: the server's process group and the daemon."""
    return (run.server_cpu + run.daemon_cpu) / (args.sequential + args.concurrent)


def table(args: argparse.Namespace, runs: list[Run]) -> str:
    lines = [
        "| round | config | sequential req/s | TTFT ms (vLLM, mean) | decode ms/token (vLLM "
        f"ITL, mean) | concurrent ({args.concurrency}) req/s | server CPU ms/req | "
        "daemon CPU ms/req | errors | load start/end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    requests = args.sequential + args.concurrent
    for r in runs:
        daemon = f"{r.daemon_cpu / requests * 1e3:.2f}" if r.config == "kvtierd" else ""
        lines.append(
            f"| {r.round} | {r.config} | {r.sequential_rps(args.sequential):.2f} | "
            f"{r.ttft * 1e3:.1f} | {r.decode_per_token * 1e3:.2f} | "
            f"{r.concurrent_rps(args.concurrent):.2f} | {r.server_cpu / requests * 1e3:.1f} | "
            f"{daemon} | {len(r.errors)} | {r.load[0]:.1f}/{r.load[1]:.1f} |"
        )
    lines.append("")
    for config, base in (("kvtierd", "noop"), ("noop", "none"), ("kvtierd", "none")):
        seq, conc, cpu = [], [], []
        for round_no in sorted({r.round for r in runs}):
            by = {r.config: r for r in runs if r.round == round_no}
            if config in by and base in by:
                a, b = by[config], by[base]
                seq.append(a.sequential_rps(args.sequential) / b.sequential_rps(args.sequential))
                conc.append(a.concurrent_rps(args.concurrent) / b.concurrent_rps(args.concurrent))
                cpu.append(cpu_per_request(args, a) / cpu_per_request(args, b))
        if seq:
            lines.append(
                f"{config} / {base}, per round: throughput sequential "
                f"{', '.join(f'{x:.3f}' for x in seq)} (median {statistics.median(seq):.3f}); "
                f"concurrent {', '.join(f'{x:.3f}' for x in conc)} (median "
                f"{statistics.median(conc):.3f}); CPU per request (server + daemon) "
                f"{', '.join(f'{x:.3f}' for x in cpu)} (median {statistics.median(cpu):.3f})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        print(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if args.max_tokens < 2:
        print("--max-tokens must be at least 2 (decode time per token)", file=sys.stderr)
        return 2
    from benchmarks.vllm_model import build_tiny_llama

    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as model_dir:
        model = str(build_tiny_llama(model_dir))
        for round_no in range(1, args.rounds + 1):
            for config in configs:
                print(f"round {round_no}: {config} ...", file=sys.stderr, flush=True)
                runs.append(run_once(args, config, round_no, model))
    text = table(args, runs)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
