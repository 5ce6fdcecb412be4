"""``KvtierdStorage``: SGLang's HiCache L3 storage backend over a kvtierd pool.

SGLang loads it through its dynamic backend factory::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtierd",
        "module_path": "kvtierd_client.sglang", "class_name": "KvtierdStorage",
        "interface_v1": 1, "kvtierd_address": "unix:///run/kvtierd/kvtierd.sock"}'

The factory builds ``KvtierdStorage(storage_config, kwargs)`` (no daemon call),
SGLang's cache controller then calls :meth:`register_mem_pool_host` with the
rank's host pool: the backend works out the pages' layout and the rank's pool
(:mod:`~kvtierd_client.sglang.host_pages`, :mod:`~kvtierd_client.sglang.pool_plan`),
opens a session and maps the pool's region. Anything wrong there (an unknown
layout, a daemon that is not running, a pool over the budget, a pool of another
geometry) is one ERROR line saying what to change, and SGLang runs on without the
backend's hits: a configuration or host pool this backend cannot use stays off;
a daemon that did not answer or refused is asked again after
``kvtierd_retry_interval``.

The data path (``batch_exists``, ``batch_get_v1``, ``batch_set_v1`` and the
generic ``exists``, ``get``, ``batch_get``, ``set``, ``batch_set``) never raises:
a failure is a miss (0, False, None), logged once per kind and
``kvtierd_log_interval``. SGLang's prefetch, prefetch-I/O and backup threads may
call at once; each copies in its own thread (:mod:`~kvtierd_client.sglang.transfers`).

With ``kvtierd_events = "daemon"`` the pages loaded that this backend did not
describe (stored by another node in a shared tier, promoted here) are described
once SGLang's events show them (SGLang publishes a page it inserts into its host
tree after a prefetch): at the next store, with its queued completions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtierd_client.engine_events import Describer
from kvtierd_client.errors import KvtierError
from kvtierd_client.sglang import transfers
from kvtierd_client.sglang.descriptions import start_describer
from kvtierd_client.sglang.host_pages import HostPages, UnsupportedHostPool, describe_host_pool
from kvtierd_client.sglang.link import DaemonLink, Generation, describe_refusal
from kvtierd_client.sglang.metrics import TransferCounters
from kvtierd_client.sglang.pool_plan import PoolPlan, encode_keys, plan_pool
from kvtierd_client.sglang.quiet_log import QuietLog
from kvtierd_client.sglang.settings import SettingsError, StorageSettings

__all__ = ["KvtierdStorage", "StorageStatistics"]

log = logging.getLogger(__name__)
T = TypeVar("T")
STORAGE_BATCH_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: pages per batch_*_v1 call


@dataclass(frozen=True)
class StorageStatistics:
    """A snapshot of the backend (``KvtierdStorage.statistics()``)."""

    pool: str | None  # None until a host pool was registered
    enabled: bool  # False: a registration error turned the backend off for good
    registration_error: str | None
    connected: bool
    generation: int  # sessions opened (a new one after each daemon restart)
    failures: int  # daemon calls that failed (each a miss)
    pages_found: int  # leading pages batch_exists reported
    pages_loaded: int
    pages_not_loaded: int  # asked for by a get, not reported loaded
    pages_stored: int
    pages_not_stored: int
    bytes_loaded: int
    bytes_stored: int
    round_trips: int  # daemon calls of the data path (completions sent alone included)


class KvtierdStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over kvtierd (see the module doc).

    ``storage_config``: SGLang's ``HiCacheStorageConfig`` (its ``extra_config`` holds
    the keys of :data:`kvtierd_client.sglang.settings.EXTRA_KEYS`); ``kwargs``: what
    the factory passes besides (unused). ``clock``: monotonic seconds (tests).
    """

    def __init__(
        self,
        storage_config: Any,
        kwargs: dict[str, Any] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage_config = storage_config
        self._clock = clock
        self._lock = threading.Lock()  # guards _link, _pages, _plan, _error, _describer
        # held by a store from describing the loaded pages to its completion, so no
        # reservation of this backend's session is live while they are described
        self._storing = threading.Lock()
        self._describer: Describer | None = None  # kvtierd_events = "daemon"
        self._link: DaemonLink | None = None
        self._pages: HostPages | None = None
        self._plan: PoolPlan | None = None
        self._error: str | None = None
        self._counters = TransferCounters(
            enabled=bool(getattr(storage_config, "enable_storage_metrics", False))
        )
        extra = getattr(storage_config, "extra_config", None) or {}
        try:
            self.settings: StorageSettings | None = StorageSettings.from_extra_config(extra)
        except SettingsError as err:
            self.settings = None
            self._refuse(str(err))
        interval = self.settings.log_interval if self.settings else 30.0
        self._quiet = QuietLog(log, interval, clock)

    # -- registration ----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Plans the rank's pool from ``mem_pool_host`` and connects. Never raises: a
        problem is one ERROR line and the backend serves misses (see the module doc)."""
        super().register_mem_pool_host(mem_pool_host)
        self._close_link()
        if self.settings is None:
            return
        try:
            pages = describe_host_pool(mem_pool_host)
            plan = plan_pool(self.settings, self.storage_config, pages)
        except (UnsupportedHostPool, ValueError) as err:
            self._refuse(str(err))
            return
        link = DaemonLink(self.settings, plan, pages, self._quiet, clock=self._clock)
        describer = None
        if self.settings.events == "daemon" and plan.writer:
            describer = start_describer(self.settings, self.storage_config, pages.page_size)
        with self._lock:
            self._pages, self._plan, self._link, self._error = pages, plan, link, None
            self._describer = describer
        self._connect_first(link, plan)

    def _connect_first(self, link: DaemonLink, plan: PoolPlan) -> None:
        assert self.settings is not None
        try:
            gen = link.connect(first=True)
        except KvtierError as err:
            link.failed_to_start()
            log.error(
                "%s; the HiCache storage backend serves misses until it answers",
                describe_refusal(err, self.settings, plan),
            )
            return
        except (OSError, ValueError) as err:
            link.failed_to_start()
            log.error("kvtierd: mapping the region of pool %s failed: %s", plan.name, err)
            return
        log.info(
            "kvtierd: HiCache pages of %s go to pool %s at %s (%d rows of %d bytes, "
            "region %s%s)", type(self._host_pool()).__name__, plan.name,
            self.settings.address, gen.region.num_blocks, plan.block_bytes, gen.region.path,
            "" if plan.writer else "; this MLA rank loads only, the storage writer stores",
        )  # fmt: skip
        if gen.region.num_blocks < STORAGE_BATCH_PAGES:
            log.warning(
                "kvtierd: pool %s has %d rows, fewer than SGLang's batch of %d pages: a "
                "longer backup fails; raise kvtierd_pool_bytes", plan.name,
                gen.region.num_blocks, STORAGE_BATCH_PAGES,
            )  # fmt: skip

    def _refuse(self, message: str) -> None:
        """Turns the backend off for good: ``message`` (what to change) is logged once."""
        with self._lock:
            self._error = message
        log.error("%s; the HiCache storage backend is off (SGLang runs without it)", message)

    def _host_pool(self) -> Any:
        return getattr(self, "mem_pool_host", None)

    # -- zero-copy (v1) data path ----------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` the pool holds (HIT, or being promoted)."""
        if not keys:
            return 0
        found = self._guard("batch_exists", 0, transfers.count_leading, encode_keys(keys))
        self._counters.found(found)
        return found

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Loads the leading pages the pool holds into the host pool; True per page
        loaded (always a leading run)."""
        n = len(keys)
        if n == 0:
            return []
        pages = self._host_pages(host_indices, n)
        if pages is None:
            return [False] * n
        settings = self.settings
        assert settings is not None
        started = time.perf_counter()
        encoded = encode_keys(keys)
        got = self._guard(
            "batch_get_v1", 0, transfers.load_pages, encoded, pages, wait=settings.load_wait
        )
        self._loaded(encoded[:got])
        self._counters.loaded(got, n - got, self._page_bytes(), time.perf_counter() - started)
        return [True] * got + [False] * (n - got)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Stores host pages under ``keys``; True per page the pool holds afterwards.
        An MLA rank that is not SGLang's storage writer stores nothing and answers
        True (the writer stores the same pages)."""
        n = len(keys)
        if n == 0:
            return []
        plan = self._plan
        if plan is not None and not plan.writer:
            return [True] * n
        pages = self._host_pages(host_indices, n)
        if pages is None:
            return [False] * n
        started = time.perf_counter()
        with self._storing:
            self._describe_loaded()
            ok = self._guard(
                "batch_set_v1", None, transfers.store_pages, encode_keys(keys), pages,
                self._describe(),
            )  # fmt: skip
        ok = ok if ok is not None else [False] * n
        stored = sum(ok)
        self._counters.stored(stored, n - stored, self._page_bytes(), time.perf_counter() - started)
        return ok

    # -- the generic path (interface_v1 off): flat pages SGLang stages ---------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) >= 1

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Loads the leading pages the pool holds into ``target_locations`` (flat
        pages; new tensors when None); one entry per key, None from the first miss."""
        n = len(keys)
        targets = self._flat_targets(target_locations, n)
        if n == 0 or targets is None:
            return [None] * n
        page_bytes = self._page_bytes()
        wait = self.settings.load_wait if self.settings else 0.0
        encoded = encode_keys(keys)
        got = self._guard("get", 0, transfers.load_flat, encoded, targets, page_bytes, wait=wait)
        self._loaded(encoded[:got])
        self._counters.loaded(got, n - got, page_bytes, 0.0)
        return [targets[i] if i < got else None for i in range(n)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:  # fmt: skip
        """Stores the flat pages ``values`` under ``keys``; True when all are held."""
        plan = self._plan
        if not keys:
            return True
        if plan is not None and not plan.writer:
            return True
        if values is None or len(values) != len(keys) or not self._flat_pages(values):
            return False
        page_bytes = self._page_bytes()
        with self._storing:
            self._describe_loaded()
            ok = bool(
                self._guard(
                    "set",
                    False,
                    transfers.store_flat,
                    encode_keys(keys),
                    values,
                    page_bytes,
                    self._describe(),
                )  # fmt: skip
            )
        self._counters.stored(len(keys) if ok else 0, 0 if ok else len(keys), page_bytes, 0.0)
        return ok

    # -- SGLang's v2 interface (hybrid pools): not served, answered as misses ------------

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """Hybrid-model pools (Mamba, SWA, ...) are not stored here: no hit."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        self._quiet.log(logging.WARNING, "v2", "kvtierd: the v2 interface is not served: misses")
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    # -- maintenance -----------------------------------------------------------------

    def clear(self) -> None:
        """Evicts every ready, unpinned page of this rank's pool from the daemon's
        memory (``FlushPool``; every engine sharing the pool loses them). Secondary
        tiers (fs, redis) keep their copies. Never raises."""
        plan, link = self._plan, self._link
        if plan is None or link is None:
            return
        try:
            with link.use() as gen:
                if gen is not None:  # queued completions first: this rank's pins go
                    gen.session.flush()
            evicted = link.client.flush_pool(plan.name)
        except KvtierError as err:
            self._quiet.log(logging.WARNING, "clear", "kvtierd: clear of %s failed: %s",
                            plan.name, err)  # fmt: skip
            return
        log.info("kvtierd: cleared pool %s (%d pages evicted)", plan.name, evicted)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the batches since the last call (pages per
        batch and GB/s, as SGLang's Prometheus histograms take them)."""
        return self._counters.drain_storage_metrics()

    def statistics(self) -> StorageStatistics:
        """This backend's counters and connection state."""
        link, plan = self._link, self._plan
        state = link.statistics() if link is not None else None
        totals = self._counters.totals()
        return StorageStatistics(
            pool=plan.name if plan else None,
            enabled=self._error is None and self.settings is not None,
            registration_error=self._error,
            connected=bool(state and state.connected),
            generation=state.generation if state else 0,
            failures=state.failures if state else 0,
            pages_found=totals.pages_found,
            pages_loaded=totals.pages_loaded,
            pages_not_loaded=totals.pages_not_loaded,
            pages_stored=totals.pages_stored,
            pages_not_stored=totals.pages_not_stored,
            bytes_loaded=totals.bytes_loaded,
            bytes_stored=totals.bytes_stored,
            round_trips=link.round_trips() if link is not None else 0,
        )

    def close(self) -> None:
        """Closes the session (the daemon releases what it held), unmaps the region
        and stops listening to SGLang's KV events."""
        self._close_link()

    @property
    def describer(self) -> Describer | None:
        """What describes the stored pages (``kvtierd_events = "daemon"``), or None."""
        return self._describer

    def _describe(self) -> transfers.Describe | None:
        describer = self._describer
        return None if describer is None else describer.describe

    def _loaded(self, keys: list[bytes]) -> None:
        """Pages loaded: those this backend did not describe wait for SGLang's events."""
        describer = self._describer
        if describer is not None and keys:
            describer.late.loaded(keys)

    def _describe_loaded(self) -> None:
        """Queues a ``CompleteStore`` of the loaded pages SGLang's events now describe
        (ready keys: the daemon keeps the descriptions, the completion changes
        nothing); the store's first call carries it. Called with ``_storing`` held:
        no reservation of this session is live, so none is completed by it."""
        describer = self._describer
        if describer is None or not describer.late.waiting:
            return
        keys, descriptions = describer.late.take()
        if keys:
            self._guard("describe", None, transfers.describe_loaded, keys, descriptions)

    def _close_link(self) -> None:
        with self._lock:
            link, self._link = self._link, None
            describer, self._describer = self._describer, None
        if link is not None:
            link.close()
        if describer is not None:
            describer.close()

    # -- plumbing --------------------------------------------------------------------

    def _guard(self, op: str, default: T, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(generation, *args)`` on the current generation; ``default`` (a miss)
        when there is none or anything fails. Never raises."""
        link = self._link
        if link is None:
            return default
        try:
            with link.use() as gen:
                if gen is None:
                    return default
                return self._run(link, gen, op, default, fn, *args, **kw)
        except Exception as err:  # the data path never raises: a bug is a miss too
            self._quiet.log(logging.ERROR, f"bug:{op}", "kvtierd: %s failed: %r", op, err,
                            exc_info=True)  # fmt: skip
            return default

    def _run(
        self, link: DaemonLink, gen: Generation, op: str, default: T,
        fn: Callable[..., T], *args: Any, **kw: Any,
    ) -> T:  # fmt: skip
        try:
            return fn(gen, *args, **kw)
        except KvtierError as err:
            link.failed(gen, op, err)
        except ValueError as err:
            self._quiet.log(logging.WARNING, f"input:{op}", "kvtierd: %s: %s", op, err)
        return default

    def _host_pages(self, host_indices: Any, count: int) -> list[int] | None:
        pages = self._pages
        if pages is None:
            return None
        try:
            return transfers.pages_of(host_indices, count, pages.page_size)
        except (ValueError, RuntimeError, AttributeError, TypeError) as err:
            self._quiet.log(logging.WARNING, "input:host_indices", "kvtierd: %s", err)
            return None

    def _flat_targets(self, locations: Any, count: int) -> list[torch.Tensor] | None:
        pages = self._pages
        if pages is None:
            return None
        if locations is None:
            locations = [None] * count
        if len(locations) != count:
            return None
        dtype = pages.tensors[0].dtype
        elements = pages.page_bytes // dtype.itemsize
        targets = [t if t is not None else torch.empty(elements, dtype=dtype) for t in locations]
        return targets if self._flat_pages(targets) else None

    def _flat_pages(self, tensors: Any) -> bool:
        """Whether every one of ``tensors`` is a flat page of this pool (logged if not)."""
        page_bytes = self._page_bytes()
        try:
            for tensor in tensors:
                transfers.flat_bytes(tensor, page_bytes)
        except (ValueError, RuntimeError, AttributeError, TypeError) as err:
            self._quiet.log(logging.WARNING, "input:flat", "kvtierd: %s", err)
            return False
        return page_bytes > 0

    def _page_bytes(self) -> int:
        pages = self._pages
        return pages.page_bytes if pages is not None else 0

    def __repr__(self) -> str:
        return f"<KvtierdStorage pool={self._plan.name if self._plan else None!r}>"
