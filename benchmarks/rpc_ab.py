"""A lookup that needs no remote tier is no slower: ``make bench``'s rpc rows, A/B.

``python -m benchmarks.rpc_ab --before DIR [--rounds 4]``: this checkout's daemon and
another checkout's (``DIR``: e.g. the tree before the remote wait in the lookup,
``git archive <commit> | tar -x -C DIR`` plus its generated stubs) both run with the
same Redis Cluster tier (a local 3-master :class:`BenchCluster`, ``key_prefix``
apart). Each round runs the rpc suite's one-client operations
(:func:`benchmarks.rpc._run_clients`: empty RPC, ``Lookup`` of 32 keys the primary
holds, ``PrepareStore+CompleteStore`` of 16 new keys, ``PrepareLoad+CompleteLoad``
of 16) against one daemon, then the other, alternating which goes first, so load
on the machine falls on both alike. Every ``Lookup`` here is answered by the
primary: the remote tier is never needed, and must cost nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import BenchDaemon, Row, machine, percentile, print_table
from benchmarks.rediscluster import BenchCluster
from benchmarks.rpc import BLOCK, POOL, _keys, _run_clients

SIDES = ("before", "after")


def _config(directory: str, urls: list[str], side: str) -> str:
    quoted = ", ".join(f'"{url}"' for url in urls)
    path = os.path.join(directory, f"{side}.toml")
    Path(path).write_text(
        f'[[tiers]]\ntype = "redis"\nname = "fleet"\nurls = [{quoted}]\n'
        f'cluster = true\nkey_prefix = "kvtb-ab-{side}"\n'
    )
    return path


def measure(before: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per side, per operation: every call's seconds over all rounds."""
    from kvtierd_client.client import Client

    cluster = BenchCluster(3)
    work = tempfile.mkdtemp(prefix="kvtb-rpc-ab-")
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    env = {**os.environ, "PYTHONPATH": f"{before}:{before}/client"}
    try:
        daemons = {
            "before": BenchDaemon(
                "--config", _config(work, cluster.urls, "before"), "--memory-budget", "2GiB",
                env=env,
            ),
            "after": BenchDaemon(
                "--config", _config(work, cluster.urls, "after"), "--memory-budget", "2GiB"
            ),
        }  # fmt: skip
        try:
            for daemon in daemons.values():
                with Client(daemon.address) as client:
                    setup = client.open_session(POOL, block_bytes=BLOCK, num_blocks=262144)
                    hot = _keys("hot", 32)
                    setup.complete_store(setup.prepare_store(hot).keys_to_store)
                    setup.close()
            for i in range(rounds):
                order = SIDES if i % 2 == 0 else SIDES[::-1]
                for side in order:
                    for name, (values, _) in _run_clients(daemons[side].address, 1).items():
                        samples[side].setdefault(name, []).extend(values)
        finally:
            for daemon in daemons.values():
                daemon.close()
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    return samples


def rows(samples: dict[str, dict[str, list[float]]]) -> list[Row]:
    out: list[Row] = []
    for name in samples["after"]:
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            old = percentile(samples["before"][name], q)
            new = percentile(samples["after"][name], q)
            out.append(Row("rpc A/B, 1 client", f"{name} {label}: before", old * 1e6, "us"))
            out.append(Row(
                "rpc A/B, 1 client", f"{name} {label}: after", new * 1e6, "us",
                f"before {old * 1e6:.0f} us", new / old, "<= 1.05x" if label == "p50" else "",
            ))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rpc_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--before", required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    samples = measure(args.before, args.rounds)
    calls = len(next(iter(samples["after"].values())))
    print(f"machine: {machine()}; {args.rounds} rounds, {calls} calls per operation and side\n")
    print_table(rows(samples))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
