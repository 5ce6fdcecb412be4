"""``KvtierdOffloadingSpec``: vLLM's ``OffloadingSpec`` putting KV offloading on kvtierd.

Loaded by vLLM's ``OffloadingConnector`` from::

    kv_connector_extra_config = {
        "spec_name": "KvtierdOffloadingSpec",
        "spec_module_path": "kvtierd_client.vllm",
        "cpu_bytes_to_use": 8 << 30,          # pool capacity
        "kvtierd_address": "unix:///run/kvtierd/kvtierd.sock",   # optional
    }

vLLM builds one spec per process: the engine core calls :meth:`get_manager`
(scheduler side), every worker calls :meth:`get_worker`; the API server only
calls the classmethods :meth:`build_metric_definitions` and (vLLM 0.33)
:meth:`config_info_keys`. Constructing a spec does no I/O (it logs one warning
per process when the installed vLLM is not a supported release:
:mod:`kvtierd_client.vllm.compat`); ``get_manager`` / ``get_worker`` open a
daemon session and fail the engine start with :class:`DaemonStartError` when
the daemon cannot be reached or refuses the pool.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtierd_client.vllm.accounting import METRIC_NAMES
from kvtierd_client.vllm.common import default_client_name, open_pool_session
from kvtierd_client.vllm.compat import warn_if_unknown
from kvtierd_client.vllm.descriptions import start_describer
from kvtierd_client.vllm.manager import CONFIG_INFO_KEYS, KvtierdOffloadingManager
from kvtierd_client.vllm.settings import PluginSettings, PoolPlan, plan_pool
from kvtierd_client.vllm.worker import KvtierdOffloadingWorker

__all__ = ["KvtierdOffloadingSpec"]


class KvtierdOffloadingSpec(OffloadingSpec):
    """Offloads vLLM's KV cache to a kvtierd pool (see the module docstring).

    Attributes: ``settings`` (the extra config keys), ``plan`` (pool name,
    row size, capacity, layout fingerprint).
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            METRIC_NAMES["lookups"]: OffloadingCounterMetadata(
                documentation="Offload lookups answered by kvtierd, by result.",
                labelnames=("result",),
            ),
            METRIC_NAMES["rpc_failures"]: OffloadingCounterMetadata(
                documentation="kvtierd calls that failed (each turns into misses).",
            ),
            METRIC_NAMES["reconnects"]: OffloadingCounterMetadata(
                documentation="New kvtierd sessions after the daemon forgot the old one.",
            ),
            METRIC_NAMES["round_trips"]: OffloadingCounterMetadata(
                documentation="Round trips to kvtierd made by the scheduler's manager.",
            ),
            METRIC_NAMES["steps"]: OffloadingCounterMetadata(
                documentation="Scheduler steps seen by the kvtierd manager "
                "(round_trips / scheduler_steps: round trips per step).",
            ),
            METRIC_NAMES["used_blocks"]: OffloadingGaugeMetadata(
                documentation="Rows in use in the kvtierd pool (every engine sharing it).",
            ),
            METRIC_NAMES["capacity_blocks"]: OffloadingGaugeMetadata(
                documentation="Rows of the kvtierd pool.",
            ),
        }

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33+: the labels of ``vllm:kv_offload_config_info`` the manager's
        ``config_info`` fills."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: OffloadingConfig) -> None:
        warn_if_unknown()
        super().__init__(config)
        self.settings = PluginSettings.from_extra_config(self.extra_config)
        self.plan: PoolPlan = plan_pool(config, self.settings)
        self._manager: KvtierdOffloadingManager | None = None
        self._worker: KvtierdOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        """The scheduler's manager over a new daemon session (created once); with
        ``kvtierd_events = "daemon"`` it listens to vLLM's KV events to describe
        its stores (:mod:`~kvtierd_client.vllm.descriptions`)."""
        if self._manager is None:
            name = default_client_name("scheduler")
            client, session = open_pool_session(
                self.settings, self.plan, name, queue_completions=True
            )
            events_on = self.kv_events_config.enable_kv_cache_events
            describer = None
            if self.settings.events == "daemon":
                describer = start_describer(self.settings, self.config, events_on=events_on)
            self._manager = KvtierdOffloadingManager(
                client,
                session,
                self.settings,
                self.plan,
                events_enabled=events_on,
                client_name=name,
                describer=describer,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """This rank's worker over the pool's region (created once)."""
        if self._worker is None:
            rank = self.config.parallel.rank
            name = default_client_name(f"worker{rank}")
            client, session = open_pool_session(self.settings, self.plan, name)
            try:
                self._worker = KvtierdOffloadingWorker(kv_caches, self.plan, rank, client, session)
            except BaseException:
                client.close()
                raise
        return self._worker
