"""Fixtures of the KV-event tests with a real router: NVIDIA Dynamo's standalone indexer.

Run with ``make test-dynamo`` (``.venv-dynamo``: ai-dynamo-runtime 1.6.1, pyzmq, msgpack
and this repository); ``make test`` does not collect this folder. Every test starts a
real daemon publishing KV events on free TCP ports, a real ``python -m dynamo.indexer``
listening to it, and engines that are real client sessions of one pool. Like every
suite, the session ends with ``tests/conftest.py``'s check that it left nothing in
/dev/shm.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, REPO / "tests", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from daemon_harness import DaemonProcess, free_port, start_daemon  # noqa: E402
from engine_harness import Engine  # noqa: E402
from indexer_harness import (  # noqa: E402
    BLOCK_TOKENS,
    POOL,
    PROBE_POOL,
    Indexer,
    start_indexer,
    start_indexer_script,
)
from kv_events_harness import shipped_config  # noqa: E402

SHIPPED_CONFIG = REPO / "deploy" / "kv-events" / "kvtierd-dynamo.toml"


def events_config(
    publish: str, replay: str, fs_root: Path | None, *, fs_capacity: str = "1GiB",
    warm_restart: bool = False,
) -> str:  # fmt: skip
    """A daemon config publishing ``POOL`` and ``PROBE_POOL`` on ``publish`` (a PUB) with
    replays on ``replay`` (a ROUTER), and an fs tier at ``fs_root`` when given."""
    text = (
        "[kv_events]\n"
        f'endpoint = "{publish}"\n'
        f'replay_endpoint = "{replay}"\n'
        f'pools = ["{POOL}", "{PROBE_POOL}"]\n'
        'model = "default"\n'
    )
    if warm_restart:
        text += "[memory]\nwarm_restart = true\n"
    if fs_root is not None:
        text += (
            f'[[tiers]]\ntype = "fs"\nname = "fs0"\nroot = "{fs_root}"\n'
            f'create_root = true\ncapacity = "{fs_capacity}"\n'
            # write-through: these tests follow blocks the fs tier's LRU evicts (its
            # default, tinylfu, would keep one-shot blocks out once it is full)
            'admission = "always"\n'
        )
    return text


@dataclass
class Stack:
    """A daemon publishing KV events, the indexer listening to it, engines of a pool."""

    daemon: DaemonProcess
    indexer: Indexer
    publish: str
    replay: str
    engines: list[Engine] = field(default_factory=list)

    def engine(self, pool: str = POOL, num_blocks: int = 8) -> Engine:
        """A new engine: a client session of ``pool`` on the daemon."""
        engine = Engine(self.daemon, pool, num_blocks=num_blocks)
        self.engines.append(engine)
        return engine

    def close_engines(self) -> None:
        for engine in self.engines:
            engine.close()
        self.engines.clear()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """``stack(fs=..., fs_capacity=..., warm_restart=..., workers=...)`` starts a daemon
    with [kv_events] and (unless not ``fs``) an fs tier, and the indexer. ``workers``:
    the indexer's --workers with ``{pub}`` for the daemon's endpoint; None: both
    engines' instance ids (1 and 2) at dp_rank 1 through ``/register``, with the
    replay endpoint. ``shipped_engines``: deploy/kv-events/kvtierd-dynamo.toml and
    dynamo-indexer.sh as shipped, with that ENGINES."""
    made: list[Stack] = []

    def make(
        *, fs: bool = True, fs_capacity: str = "1GiB", warm_restart: bool = False,
        workers: str | None = None, shipped_engines: str | None = None,
    ) -> Stack:  # fmt: skip
        publish = f"tcp://127.0.0.1:{free_port()}"
        replay = f"tcp://127.0.0.1:{free_port()}"
        fs_root = tmp_path / "fs" if fs else None
        if shipped_engines is None:
            config = events_config(
                publish, replay, fs_root, fs_capacity=fs_capacity, warm_restart=warm_restart
            )
        else:  # deploy/kv-events as shipped, on this machine's ports and paths
            (tmp_path / "fs").mkdir()
            config = shipped_config(
                SHIPPED_CONFIG, endpoint=publish, replay_endpoint=replay, root=tmp_path / "fs",
                pools=[POOL, PROBE_POOL],
            )  # fmt: skip
        daemon = start_daemon("--memory-budget", "256MiB", config=config)
        try:
            if shipped_engines is not None:
                indexer = start_indexer_script(
                    tmp_path, shipped_engines, KVTIERD_EVENTS=publish, KVTIERD_REPLAY=replay,
                    BLOCK_SIZE=str(BLOCK_TOKENS),
                )  # fmt: skip
            else:
                indexer = start_indexer(tmp_path, workers.format(pub=publish) if workers else "")
        except BaseException:
            daemon.stop()
            daemon.cleanup()
            raise
        if workers is None and shipped_engines is None:
            for instance in (1, 2):
                indexer.register(instance, 1, publish, replay)
        made.append(Stack(daemon, indexer, publish, replay))
        return made[-1]

    try:
        yield make
    finally:
        for each in made:
            each.close_engines()
            each.indexer.stop()
            code = each.daemon.stop()
            each.daemon.cleanup()
            assert code == 0, f"daemon exited with {code}:\n{each.daemon.log()}"
