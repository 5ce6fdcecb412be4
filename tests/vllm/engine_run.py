"""One vLLM engine offloading to kvtierd, run as its own process by the tests.

Usage: ``python engine_run.py '<json>'`` with keys ``model``, ``address``, ``prompt``
(token ids) and optional ``extra`` (extra config keys). Prints one line
``RESULT <json>``: the greedy tokens, the prompt tokens not computed, the
manager's lookup counts and the pool name.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE.parent, HERE):
    sys.path.insert(0, str(path))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM
    from vllm_e2e import generate, kv_transfer_config, manager_of, shutdown_llm

    from benchmarks.vllm_model import llm_kwargs

    args = json.loads(sys.argv[1])
    config = kv_transfer_config(args["address"], **args.get("extra", {}))
    llm = LLM(**llm_kwargs(args["model"], config))
    tokens, cached = generate(llm, args["prompt"])
    manager = manager_of(llm)
    result = {
        "tokens": tokens,
        "cached": cached,
        "lookups": dict(manager.counters.lookups),
        "pool": manager.pool_name,
    }
    shutdown_llm(llm)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
