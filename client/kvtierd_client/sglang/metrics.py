"""The backend's transfer counters, and SGLang's ``StorageMetrics`` made from them.

SGLang (``--enable-cache-report`` / storage metrics on) calls ``get_stats()`` now
and then and feeds what it returns into its Prometheus histograms
(``sglang:prefetch_pgs``, ``sglang:backup_pgs``, ``sglang:prefetch_bandwidth``,
``sglang:backup_bandwidth``): pages per batch and GB/s per batch since the last
call. The lists are bounded (:data:`MAX_SAMPLES` each, the oldest dropped), so a
server that never asks holds at most a few hundred KiB. The totals
(:meth:`TransferCounters.totals`) are kept always. Thread-safe: one lock, held
for list and integer updates only.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_SAMPLES", "TransferCounters", "TransferTotals"]

MAX_SAMPLES = 4096  # per list, between two get_stats() calls


@dataclass(frozen=True)
class TransferTotals:
    pages_found: int = 0
    pages_loaded: int = 0
    pages_not_loaded: int = 0
    pages_stored: int = 0
    pages_not_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0


class TransferCounters:
    """Totals, and per-batch samples for SGLang when ``enabled``."""

    def __init__(self, *, enabled: bool) -> None:
        self._enabled = enabled
        self._lock = threading.Lock()
        self._totals = collections.Counter[str]()
        self._samples: dict[str, collections.deque[float]] = {
            name: collections.deque(maxlen=MAX_SAMPLES)
            for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")
        }

    def found(self, pages: int) -> None:
        with self._lock:
            self._totals["pages_found"] += pages

    def loaded(self, pages: int, missed: int, page_bytes: int, seconds: float) -> None:
        self._record("prefetch", "loaded", pages, missed, page_bytes, seconds)

    def stored(self, pages: int, missed: int, page_bytes: int, seconds: float) -> None:
        self._record("backup", "stored", pages, missed, page_bytes, seconds)

    def _record(
        self, sample: str, total: str, pages: int, missed: int, page_bytes: int, seconds: float
    ) -> None:
        with self._lock:
            self._totals[f"pages_{total}"] += pages
            self._totals[f"pages_not_{total}"] += missed
            self._totals[f"bytes_{total}"] += pages * page_bytes
            if self._enabled and pages > 0:
                self._samples[f"{sample}_pgs"].append(pages)
                if seconds > 0:
                    self._samples[f"{sample}_bandwidth"].append(pages * page_bytes / seconds / 1e9)

    def totals(self) -> TransferTotals:
        with self._lock:
            return TransferTotals(**self._totals)

    def drain_storage_metrics(self) -> Any:
        """SGLang's ``StorageMetrics`` with the samples since the last call (which it
        clears); None when SGLang's metrics module cannot be imported."""
        with self._lock:
            samples = {name: list(values) for name, values in self._samples.items()}
            for values in self._samples.values():
                values.clear()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(int(v) for v in samples["prefetch_pgs"])
        metrics.backup_pgs.extend(int(v) for v in samples["backup_pgs"])
        metrics.prefetch_bandwidth.extend(samples["prefetch_bandwidth"])
        metrics.backup_bandwidth.extend(samples["backup_bandwidth"])
        return metrics
