"""The restart-gap benchmark's loop through the shipped vLLM plug-in
(``python -m benchmarks.upgrade --vllm``, in the vLLM venv): one scheduler step
per call of :class:`ManagerStep`, driven as vLLM's scheduler drives
``KvtierdOffloadingManager`` (benchmarks/vllm_managers.py's order for the
installed vLLM)."""

from __future__ import annotations

from typing import Any

from benchmarks.vllm_managers import plugin_manager, set_vllm_env

POOL = "bench/upgrade-vllm"
CAPACITY = 256
CHAIN = [f"upgrade-vllm-{i}".encode() for i in range(64)]


class ManagerStep:
    """One step: a request whose 64 blocks are looked up in order, the hits loaded
    (prepare/complete load, touch), the rest stored; True when every block was a
    hit (the plug-in answers MISS without asking the daemon for
    ``kvtierd_retry_interval`` after a failed call: default 1 s; it swallows the
    errors, which :meth:`counters` reports)."""

    def __init__(self, address: str) -> None:
        set_vllm_env()
        from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

        self._hit = LookupResult.HIT
        self._keys = [OffloadKey(k) for k in CHAIN]
        self._context = ReqContext
        self._end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
        self.manager: Any
        self.manager, self._close = plugin_manager(address, POOL, CAPACITY, store_ahead=False)
        self._steps = 0
        while not self():  # stores the chain (a step), then finds it
            pass

    def __call__(self) -> bool:
        manager = self.manager
        self._steps += 1
        ctx = self._context(req_id=str(self._steps))
        for position, key in enumerate(self._keys):
            ctx.set_offload_key_position(key, (position + 1) * 16)
        manager.on_new_request(ctx)
        n = 0
        for key in self._keys:
            if manager.lookup(key, ctx) is not self._hit:
                break
            n += 1
        if n:
            loaded = self._keys[:n]
            manager.prepare_load(loaded, ctx)
            manager.complete_load(loaded, ctx)
            manager.touch(loaded, ctx)
        rest = self._keys[n:]
        if rest:
            out = manager.prepare_store(rest, ctx)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx)
        manager.on_schedule_end(self._end)
        return n == len(self._keys)

    def counters(self) -> dict[str, int]:
        c = self.manager.counters
        return {"failed": c.rpc_failures, "reconnects": c.reconnects}

    def close(self) -> None:
        self._close()
