"""A do-nothing ``OffloadingSpec`` for vLLM's ``OffloadingConnector``: the floor
of ``benchmarks/vllm_overhead.py`` (issue #21's last target).

Every lookup answers MISS and every ``prepare_store`` answers "nothing to
store" (a ``PrepareStoreOutput`` with no keys, so vLLM moves past those blocks
and submits no transfer), so the connector runs all of vLLM's own machinery
(the scheduler's per-block lookups, the per-step connector metadata, the
worker's job polling) and none of an offload tier's work. Not None: vLLM reads
None as "cannot store now", logs a WARNING and asks again for the same blocks
at every step (a first version measured that: 1.6-1.8x the CPU per request of
no connector). What kvtierd costs beyond this spec is
kvtierd's; what this spec costs beyond no connector at all is vLLM's.

Used as ``kv_connector_extra_config = {"spec_name": "NoopOffloadingSpec",
"spec_module_path": "benchmarks.vllm_noop_spec"}`` (the repository root on
``PYTHONPATH``). Needs the vLLM venv; nothing else in the repository imports it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)

__all__ = ["NoopOffloadingSpec"]

_NOWHERE = LoadStoreSpec()  # the store spec of "nothing to store": never handed to a worker


class NoopOffloadingManager(OffloadingManager):
    """Holds nothing: every key is a MISS and no block needs storing."""

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        raise RuntimeError("NoopOffloadingManager holds nothing: no lookup answered HIT")

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        return PrepareStoreOutput(keys_to_store=[], store_spec=_NOWHERE, evicted_keys=[])

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


class NoopOffloadingWorker(OffloadingWorker):
    """Is never given a transfer (the manager stores and loads nothing)."""

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        return False

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return False  # ``expedited``: vLLM 0.33's sync loads (never asked: nothing is a HIT)

    def get_finished(self) -> list[TransferResult]:
        return []

    def wait(self, job_ids: set[int]) -> None:
        return None


class NoopOffloadingSpec(OffloadingSpec):
    """The do-nothing spec (see the module doc)."""

    def get_manager(self) -> OffloadingManager:
        return NoopOffloadingManager()

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        return NoopOffloadingWorker()
