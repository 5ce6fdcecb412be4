"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo-runtime)
as a real consumer of the daemon's KV events, and engines that store described blocks.

:func:`start_indexer` runs the indexer on a free port with its ``--workers`` and waits
for ``/health``; :class:`Indexer` asks ``/query`` what each instance holds, per tier
(``gpu``, ``cpu``, ``disk``: cumulative, ``disk >= cpu >= gpu``, in tokens), and
``/register`` adds a worker with a replay endpoint. :class:`Prompt` is a prompt the way
an engine hashes it: token ids made from a seed, blocks of ``block_size`` tokens, 64-bit
chained block hashes (any over 2**63 travels as a msgpack uint64), grouped ``per_key``
blocks to a daemon key, each key with the ``BlockDescription`` the engine hands to
``complete_store``. :func:`wait_listening` makes sure the indexer hears the daemon
before a test relies on it (a ZMQ subscriber misses what was published before it joined).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from daemon_harness import eventually, free_port
from engine_harness import Engine, payload

from kvtierd_client.types import BlockDescription, hash64

ANSI = re.compile(r"\x1b\[[0-9;]*m")
MODEL = "default"  # the indexer's model name for its --workers and /query
BLOCK_TOKENS = 16  # the engines' block size in tokens (the indexer's --block-size)
POOL = "llama"  # the pool the engines share
PROBE_POOL = "probe"  # where wait_listening's probes go, apart from the tests' capacity


@dataclass
class Indexer:
    """A running ``dynamo.indexer`` process; ``stop`` ends it."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        """The indexer's output, its terminal colours taken out."""
        return ANSI.sub("", self.log_path.read_text(errors="replace"))

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def query(self, token_ids: list[int]) -> dict[str, dict[str, Any]]:
        """``/query``'s ``instances``: per instance id (a string) its ``gpu``, ``cpu``
        and ``disk`` matches in tokens (and ``dp``, ``longest_matched``)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"the indexer exited with {self.proc.returncode}:\n{self.log()}")
        return self._post("/query", {"token_ids": token_ids, "model_name": MODEL})["instances"]

    def tiers(self, token_ids: list[int]) -> dict[str, tuple[int, int, int]]:
        """``{instance: (gpu, cpu, disk)}`` matched tokens of ``token_ids``."""
        return {
            instance: (found["gpu"], found["cpu"], found["disk"])
            for instance, found in self.query(token_ids).items()
        }

    def register(self, instance_id: int, dp_rank: int, endpoint: str, replay: str = "") -> None:
        """``POST /register``: listen to ``endpoint`` as ``instance_id``'s ``dp_rank``."""
        body: dict[str, Any] = {
            "instance_id": instance_id, "dp_rank": dp_rank, "endpoint": endpoint,
            "model_name": MODEL, "block_size": BLOCK_TOKENS,
        }  # fmt: skip
        if replay:
            body["replay_endpoint"] = replay
        try:
            self._post("/register", body)
        except urllib.error.HTTPError as err:
            raise AssertionError(f"/register refused: {err.read().decode()}") from None

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the indexer exited with {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:  # not listening yet
            return False

    def wait_tiers(
        self, token_ids: list[int], expected: dict[str, tuple[int, int, int]], timeout: float = 30
    ) -> None:
        """Until ``tiers(token_ids)`` is ``expected`` exactly (instances and tiers)."""
        seen: list[object] = []

        def matches() -> bool:
            seen[:] = [self.tiers(token_ids)]
            return seen[0] == expected

        eventually(
            matches, timeout,
            lambda: f"/query to be {expected}; last {seen}\nindexer log tail:\n"
            + self.log()[-3000:],
            interval=0.05,
        )  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_indexer(workdir: Path, workers: str = "", timeout: float = 60) -> Indexer:
    """``python -m dynamo.indexer`` on a free port, listening to ``workers``
    (``"id[:dp_rank]=endpoint,..."``; empty: none, add them with ``register``)."""
    port = free_port()
    log_path = workdir / f"indexer-{port}.log"
    args = [
        sys.executable, "-m", "dynamo.indexer", "--port", str(port),
        "--block-size", str(BLOCK_TOKENS), "--model-name", MODEL, "--threads", "1",
    ]  # fmt: skip
    if workers:
        args += ["--workers", workers]
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    indexer = Indexer(proc, port, log_path)
    try:
        eventually(indexer.healthy, timeout, lambda: f"indexer /health:\n{indexer.log()}")
    except BaseException:
        indexer.stop()
        raise
    return indexer


SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kv-events" / "dynamo-indexer.sh"


def start_indexer_script(workdir: Path, engines: str, timeout: float = 60, **env: str) -> Indexer:
    """The shipped ``deploy/kv-events/dynamo-indexer.sh`` on a free port, with
    ``ENGINES=engines`` and ``env`` (KVTIERD_EVENTS, KVTIERD_REPLAY, BLOCK_SIZE); waits
    until it has registered the daemon under every engine's instance id."""
    port = free_port()
    log_path = workdir / f"indexer-script-{port}.log"
    full_env = {
        **os.environ, "PYTHON": sys.executable, "PORT": str(port), "ENGINES": engines,
        "MODEL": MODEL, **env,
    }  # fmt: skip
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            ["sh", str(SCRIPT)], stdout=log_file, stderr=subprocess.STDOUT, env=full_env
        )
    indexer = Indexer(proc, port, log_path)
    ids = [engine.split("=")[0] for engine in engines.split()]

    def registered() -> bool:
        indexer.healthy()  # raises once the script exited
        return all(f"instance {i}: kvtierd's events" in indexer.log() for i in ids)

    try:
        eventually(registered, timeout, lambda: f"the script registered:\n{indexer.log()}")
    except BaseException:
        indexer.stop()
        raise
    return indexer


_seeds = count(1)


@dataclass
class Prompt:
    """A prompt of ``keys x per_key`` blocks, as an engine hashes and describes it."""

    keys: int
    per_key: int = 2
    seed: int = field(default_factory=lambda: next(_seeds))

    @property
    def blocks(self) -> int:
        return self.keys * self.per_key

    @property
    def token_ids(self) -> list[int]:
        """``blocks x BLOCK_TOKENS`` token ids, a function of the seed."""
        tokens = range(self.blocks * BLOCK_TOKENS)
        return [(self.seed * 7919 + i * 104729) % 150_000 for i in tokens]

    @property
    def block_hashes(self) -> list[int]:
        """The engine's chained block hashes: the low 64 bits of a sha256 over the
        parent's hash and the block's tokens (as vLLM hands them on: ``hash64``)."""
        hashes: list[int] = []
        parent = self.seed.to_bytes(8, "big")
        tokens = self.token_ids
        for block in range(self.blocks):
            chunk = tokens[block * BLOCK_TOKENS : (block + 1) * BLOCK_TOKENS]
            digest = hashlib.sha256(parent + repr(chunk).encode()).digest()
            hashes.append(hash64(digest))
            parent = digest
        return hashes

    def daemon_keys(self) -> list[bytes]:
        """One daemon key per ``per_key`` blocks (its last block's hash, as a chunk's)."""
        hashes = self.block_hashes
        return [
            b"blk-" + hashes[(key + 1) * self.per_key - 1].to_bytes(8, "big")
            for key in range(self.keys)
        ]

    def descriptions(self) -> list[BlockDescription]:
        hashes, tokens, n = self.block_hashes, self.token_ids, self.per_key
        return [
            BlockDescription(
                block_hashes=tuple(hashes[key * n : (key + 1) * n]),
                parent_block_hash=hashes[key * n - 1] if key else None,
                token_ids=tuple(tokens[key * n * BLOCK_TOKENS : (key + 1) * n * BLOCK_TOKENS]),
                block_size=BLOCK_TOKENS,
            )
            for key in range(self.keys)
        ]

    @property
    def tokens_matched(self) -> int:
        return self.blocks * BLOCK_TOKENS


def store_described(engine: Engine, prompt: Prompt, at_a_time: int = 64) -> None:
    """``engine`` stores every key of ``prompt`` with its description, in prefix order,
    ``at_a_time`` keys a CompleteStore (a primary smaller than the prompt evicts its
    first keys on the way)."""
    keys, descriptions = prompt.daemon_keys(), prompt.descriptions()
    by_key = dict(zip(keys, descriptions, strict=True))
    for start in range(0, len(keys), at_a_time):
        chunk = keys[start : start + at_a_time]
        grant = eventually(
            lambda chunk=chunk: engine.session.prepare_store(chunk), 30,
            "the primary accepted the store", interval=0.01,
        )  # fmt: skip
        rows = engine.region.numpy()
        for key, block_id in zip(grant.keys_to_store, grant.block_ids, strict=True):
            rows[block_id][:] = memoryview(payload(key))
        engine.session.complete_store(
            grant.keys_to_store, descriptions=[by_key[key] for key in grant.keys_to_store]
        )


def wait_listening(
    indexer: Indexer, engine: Engine, instances: tuple[str, ...], timeout: float = 60
) -> list[Prompt]:
    """Until the indexer applies what the daemon publishes, for each of ``instances``:
    ``engine`` stores a new one-key prompt at each look until one of them shows at
    ``/query`` for all of them (a subscriber that joined after a message misses it;
    one registered with a replay endpoint has it replayed once the next message shows
    the gap). Returns the probes stored."""
    probes: list[Prompt] = []

    def heard() -> bool:
        probe = Prompt(keys=1, per_key=1)
        store_described(engine, probe)
        probes.append(probe)
        return any(set(indexer.query(p.token_ids)) >= set(instances) for p in probes)

    eventually(
        heard, timeout, lambda: f"the indexer hears the daemon:\n{indexer.log()[-3000:]}",
        interval=0.2,
    )  # fmt: skip
    return probes
