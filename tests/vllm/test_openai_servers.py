"""vLLM as users run it (issue #16, item 3): two OpenAI servers on one daemon.

Both servers run ``python -m vllm.entrypoints.openai.api_server`` in vLLM's default
multiprocess mode (API server, engine core and worker are separate processes) with
the kvtierd plug-in, against one real daemon with an fs tier; they are started once
for this module (a start costs 20-40 s here). Texts are greedy (temperature 0), and
a prompt is always computed first by server A (its *cold* run, nothing loaded), then
asked of server B, whose own prefix cache never saw it, so whatever B does not
compute comes from kvtierd.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonProcess, eventually, start_daemon
from openai_server import OpenAIServer
from vllm_e2e import SPEC, TOKENS_PER_BLOCK

from benchmarks.vllm_model import random_prompt
from kvtierd_client.client import Client

pytestmark = pytest.mark.engine  # runs vLLM engines: vLLM's CPU build (make test-vllm)

PROMPT_TOKENS = 1100
FULL_BLOCKS = PROMPT_TOKENS // TOKENS_PER_BLOCK  # 8
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"


def daemon_config(fs_root: Path) -> str:
    """An fs tier behind the primary."""
    return f'[[tiers]]\ntype = "fs"\nname = "fs"\nroot = "{fs_root}"\ncapacity = "1GiB"\n'


@dataclass
class Cluster:
    """One daemon on a fixed socket (it survives restarts), servers A and B, and one
    client of the daemon kept open (a connection per poll costs a handshake that a
    daemon starved of CPU by two busy servers may not answer within gRPC's limit)."""

    address: str
    fs_root: Path
    daemon: DaemonProcess
    a: OpenAIServer
    b: OpenAIServer
    client: Client

    def restart_daemon(self) -> None:
        self.client.close()
        assert self.daemon.stop() == 0, self.daemon.log()
        self.daemon.cleanup()
        self.daemon = start_cluster_daemon(self.address, self.fs_root)
        self.client = Client(self.address, timeout=30)

    def pools(self) -> list[Any]:
        """The daemon's pools as GetStats reports them (none until a server opens its)."""
        return list(self.client.get_stats("").pools)

    def stats(self) -> Any:
        """The servers' one pool as GetStats reports it."""
        pools = self.pools()
        assert len(pools) == 1, [p.name for p in pools]
        return pools[0]


def start_cluster_daemon(address: str, fs_root: Path) -> DaemonProcess:
    return start_daemon(
        "--memory-budget", "256MiB", "--listen", address, config=daemon_config(fs_root)
    )  # fmt: skip


def kv_transfer_config(address: str) -> dict[str, Any]:
    extra = {
        **SPEC,
        "kvtierd_address": address,
        "cpu_bytes_to_use": 64 << 20,
        "kvtierd_retry_interval": 0.2,
    }
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_model: Path) -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))  # short: sun_path is 108 bytes
    fs_root = base / "fs"
    fs_root.mkdir()
    address = f"unix://{base}/kvtierd.sock"
    started: list[OpenAIServer] = []
    daemon = start_cluster_daemon(address, fs_root)
    group = None
    try:
        started.append(OpenAIServer(tiny_model, kv_transfer_config(address)))
        started.append(OpenAIServer(tiny_model, kv_transfer_config(address)))
        for server in started:  # both start at once
            server.wait_ready()
        group = Cluster(
            address, fs_root, daemon, started[0], started[1], Client(address, timeout=30)
        )
        yield group
    finally:
        for server in started:
            server.stop()
        if group is not None:
            group.client.close()
            daemon = group.daemon
        code = daemon.stop()
        log = daemon.log()
        daemon.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    assert code == 0, f"daemon exited with {code}:\n{log}"


def text_and_loaded(server: OpenAIServer, prompt: list[int]) -> tuple[str, float]:
    """The completion's text and the prompt tokens the server loaded from kvtierd
    for it (vLLM's external-transfer count). The count is read once vLLM's metrics
    include this request (its prompt tokens), since they are updated after the
    answer is sent."""
    before = server.metrics()
    text = server.text(prompt)
    want = before.get(PROMPT_TOKENS_TOTAL, 0.0) + len(prompt)
    after: dict[str, float] = {}

    def counted() -> bool:
        after.update(server.metrics())
        return after.get(PROMPT_TOKENS_TOTAL, 0.0) >= want

    eventually(counted, 30, "vLLM's metrics to count the request's prompt tokens")
    return text, after.get(EXTERNAL, 0.0) - before.get(EXTERNAL, 0.0)


EXTERNAL = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'


def wait_stored(cluster: Cluster, grew: Callable[[Any], bool], what: str) -> None:
    """Waits until the pool's stats satisfy ``grew`` and no tier job is in flight."""

    def done() -> bool:
        stats = cluster.stats()
        return grew(stats) and all(t.jobs_in_flight == 0 for t in stats.tiers)

    eventually(done, 60, what)


def block_files(root: Path) -> set[Path]:
    return set(root.rglob("*.kvb"))


def test_a_prefix_server_a_computed_is_loaded_by_server_b(cluster: Cluster) -> None:
    """Scenario: A computes a prompt; B (which never saw it) loads all its full blocks
    from the shared pool: vLLM's external-transfer count on B and the daemon's loads
    agree, and B's text is A's cold text."""
    prompt = random_prompt(PROMPT_TOKENS, seed=1601)
    cold, loaded_by_a = text_and_loaded(cluster.a, prompt)
    assert loaded_by_a == 0  # a cold run: nothing of it was in kvtierd
    block_bytes = cluster.stats().block_bytes
    wait_stored(
        cluster,
        lambda s: s.tiers[0].bytes_in >= FULL_BLOCKS * block_bytes,
        "A's blocks stored in the pool",
    )

    before = cluster.stats().tiers[0]
    warm, loaded_by_b = text_and_loaded(cluster.b, prompt)
    after = cluster.stats().tiers[0]

    assert warm == cold
    assert loaded_by_b == FULL_BLOCKS * TOKENS_PER_BLOCK
    assert after.bytes_out - before.bytes_out == FULL_BLOCKS * block_bytes  # loads, in bytes
    assert after.hits - before.hits >= FULL_BLOCKS


def test_fs_promotion_after_a_restart_and_corrupted_files_are_refused(cluster: Cluster) -> None:
    """Scenario: A computes two prompts, both reach the fs tier; the daemon restarts
    under the running servers and its primary is flushed (FlushPool). B loads
    the first prompt's blocks promoted from the fs tier, with A's cold text. The
    second prompt's files get every payload byte inverted (header intact): the
    daemon refuses them (checksum), B loads nothing and still answers A's cold
    text. With the payload check disabled in the daemon, B loads the inverted
    bytes and its text differs: what the fs tier promotes is what B uses."""
    promoted_prompt = random_prompt(PROMPT_TOKENS, seed=1602)
    corrupted_prompt = random_prompt(PROMPT_TOKENS, seed=1603)
    files: list[set[Path]] = []
    colds: list[str] = []
    for prompt in (promoted_prompt, corrupted_prompt):
        known = block_files(cluster.fs_root)
        used = sum(p.tiers[1].used_blocks for p in cluster.pools())
        cold, loaded = text_and_loaded(cluster.a, prompt)
        assert loaded == 0
        wait_stored(
            cluster,
            lambda s, used=used: s.tiers[1].used_blocks >= used + FULL_BLOCKS,
            "A's blocks written to the fs tier",
        )
        files.append(block_files(cluster.fs_root) - known)
        colds.append(cold)
    assert [len(f) for f in files] == [FULL_BLOCKS, FULL_BLOCKS]

    block_bytes = cluster.stats().block_bytes
    cluster.restart_daemon()
    inverted: dict[Path, bytes] = {}
    for path in files[1]:  # in place: the header (and its checksums) stay, the payload is
        data = bytearray(path.read_bytes())  # inverted: loaded, it changes the text
        data[-block_bytes:] = bytes(b ^ 0xFF for b in data[-block_bytes:])
        path.write_bytes(bytes(data))
        inverted[path] = bytes(data)
    reconnect(cluster, cluster.b)
    cluster.client.flush_pool(cluster.stats().name)  # what a warm restart kept: fs tier only

    fs_before = cluster.stats().tiers[1]
    warm, loaded = text_and_loaded(cluster.b, promoted_prompt)
    fs_after = cluster.stats().tiers[1]
    assert warm == colds[0]
    assert loaded == FULL_BLOCKS * TOKENS_PER_BLOCK
    assert fs_after.promoted_blocks - fs_before.promoted_blocks == FULL_BLOCKS
    assert fs_after.checksum_failures == fs_before.checksum_failures

    again, loaded = text_and_loaded(cluster.b, corrupted_prompt)
    fs_last = cluster.stats().tiers[1]
    assert again == colds[1]
    assert loaded == 0
    assert fs_last.checksum_failures - fs_after.checksum_failures >= 1
    assert fs_last.promoted_blocks == fs_after.promoted_blocks
    # the refused files are removed (B's own stores of the prompt may write new ones)
    eventually(
        lambda: not any(holds(path, inverted[path]) for path in files[1]),
        10,
        "the inverted files removed from the fs tier",
    )


def holds(path: Path, data: bytes) -> bool:
    """Whether the file at ``path`` exists and holds exactly ``data``."""
    try:
        return path.read_bytes() == data
    except FileNotFoundError:
        return False


def reconnect(cluster: Cluster, server: OpenAIServer) -> None:
    """Sends ``server`` short fresh prompts until the restarted daemon has stored
    blocks of one (the plug-in opened its session on the new daemon); a first one
    may still meet the old session and be recomputed without kvtierd."""
    seeds = iter(range(1700, 1800))

    def stored_after_one_more_prompt() -> bool:
        server.text(random_prompt(2 * TOKENS_PER_BLOCK + 1, seed=next(seeds)), max_tokens=1)
        try:
            eventually(
                lambda: any(p.tiers[0].bytes_in > 0 for p in cluster.pools()),
                2,
                "a store on the new daemon",
            )
        except AssertionError:
            return False  # met the old session: recomputed without kvtierd
        return True

    eventually(stored_after_one_more_prompt, 60, "the server reached the new daemon", interval=0)
