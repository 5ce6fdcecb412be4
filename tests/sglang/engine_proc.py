"""A second SGLang engine in its own process, driven over a pipe (JSON lines).

``python engine_proc.py`` reads one command per line on stdin and answers one JSON
line (prefixed ``@@``) on stdout; SGLang's and the backend's logs go to stderr.
Commands: ``attach`` (a real host pool of ``kind`` / ``layout`` and the backend from
SGLang's factory, replacing the previous one), ``store`` (fill host pages with
bytes of ``seed``, ``batch_set_v1``), ``load`` (``batch_get_v1``; answers the
SHA-256 of every page afterwards), ``exists``, ``stats``, ``close``.
:class:`EngineProcess` is the test's end of the pipe.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PREFIX = "@@"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class EngineProcess:
    """The parent's handle on an engine process."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine_proc.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env={**os.environ, **(env or {})},
        )  # fmt: skip

    def call(self, op: str, **args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine process exited ({self.proc.wait()}) during {op}")
            if line.startswith(PREFIX):
                answer = json.loads(line[len(PREFIX) :])
                if "error" in answer:
                    raise RuntimeError(f"engine process: {op}: {answer['error']}")
                return answer["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close")
            finally:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=60)


def _serve() -> None:
    sys.path[:0] = [str(HERE.parents[1])]
    from benchmarks import sglang_env as env

    state: dict[str, Any] = {}

    def attach(kind: str, layout: str, address: str, **config: Any) -> str:
        if "backend" in state:
            state["backend"].close()
        pool = env.mha_host_pool(layout) if kind == "mha" else env.mla_host_pool(layout)
        cfg = env.storage_config(address, mla=kind == "mla", layout=layout, **config)
        state["pool"], state["backend"] = pool, env.create_backend(cfg, pool)
        return str(env.unwrap(state["backend"]).statistics().pool)

    def store(keys: list[str], pages: list[int], seed: int) -> list[bool]:
        env.fill_pages(state["pool"], pages, seed)
        return list(state["backend"].batch_set_v1(keys, env.token_slots(state["pool"], pages)))

    def load(keys: list[str], pages: list[int]) -> dict[str, Any]:
        ok = state["backend"].batch_get_v1(keys, env.token_slots(state["pool"], pages))
        return {
            "ok": list(ok),
            "digests": [digest(env.page_bytes(state["pool"], p)) for p in pages],
        }

    def exists(keys: list[str]) -> int:
        return int(state["backend"].batch_exists(keys))

    def stats() -> dict[str, Any]:
        return dict(env.unwrap(state["backend"]).statistics().__dict__)

    def close() -> None:
        if "backend" in state:
            state.pop("backend").close()

    ops = {"attach": attach, "store": store, "load": load, "exists": exists, "stats": stats,
           "close": close}  # fmt: skip
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            answer = {"result": ops[op](**command)}
        except Exception as err:  # noqa: BLE001 - reported to the test, which fails
            answer = {"error": f"{type(err).__name__}: {err}"}
        sys.stdout.write(PREFIX + json.dumps(answer) + "\n")
        sys.stdout.flush()
        if op == "close":
            break


if __name__ == "__main__":
    _serve()
