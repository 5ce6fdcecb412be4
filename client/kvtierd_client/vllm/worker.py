"""The worker side: vLLM's ``OffloadingWorker`` copying KV pages to and from region rows.

One worker per vLLM worker process (rank ``r`` of ``world_size``). It maps the
pool's region (by the descriptor the daemon passes to processes that may map the
pool, ``Region.fd_socket``; by path and announced identity with an older daemon
that serves none) and moves bytes with :class:`kvtierd_client.copy_engine.CopyEngine`:
CUDA tensors are copied on the engines' own streams behind the compute stream
and tracked with events; CPU tensors are copied inside ``submit_*``.

Row layout (see :mod:`kvtierd_client.vllm.settings`): rank ``r``'s page of a row
holds ``blocks_per_chunk`` sub-blocks of ``worker_kv_bytes_per_block`` bytes, and
sub-block ``j`` of rank ``r`` is the copy engine "rank" ``r * blocks_per_chunk +
j``. A KV group's tensors are laid out from the start of the sub-block, in the
order vLLM lists them. GPU block ``k`` of a group whose first block has logical
index ``i0`` lives in sub-block ``(i0 % bpc + k) % bpc`` of the group's
``(i0 % bpc + k) // bpc``-th chunk (a partial first chunk skips ``i0 % bpc``).

Ownership: the worker owns its region mappings, its copy engines and its daemon
session (used once, at start, to learn the region; closed at ``shutdown``). The
daemon decides which rows a job may touch; the scheduler's pins and reservations
protect them while the job runs. A job names the region its rows belong to; the
worker copies only into or out of that very region file (same inode), attaching a
new one after a daemon restart. A store into a region whose daemon is gone is
dropped (nobody can ever read those rows), a load that cannot be served safely is
reported failed, never filled with unprotected bytes. A job is copied only while
the scheduler session holding its rows is proven alive (:mod:`kvtierd_client.lease_fence`): jobs
wait while it is unknown, and are never copied once it is gone.

Not thread-safe: vLLM drives a worker from one thread.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtierd_client.client import Client, Session
from kvtierd_client.copy_engine import CopyEngine
from kvtierd_client.lease_beacon import LeaseState
from kvtierd_client.lease_fence import LeaseFence
from kvtierd_client.region import AttachedRegion, attach_region
from kvtierd_client.vllm.common import KvtierdLoadStoreSpec, RegionIdentity, log
from kvtierd_client.vllm.settings import PoolPlan

__all__ = ["KvtierdOffloadingWorker", "plan_copies"]


class _Attachment:
    """One mapped region and the copy engines over it: ``engines[g][j]`` copies KV
    group ``g``'s tensors into sub-block ``j`` of this rank's page. ``session_id``:
    a live session of the region's pool (asks the daemon for its descriptor)."""

    def __init__(
        self,
        identity: RegionIdentity,
        session_id: str | None,
        groups: list[list[torch.Tensor]],
        plan: PoolPlan,
        rank: int,
    ) -> None:
        region = _attach_exactly(identity, session_id)
        try:
            self.engines = [
                [
                    CopyEngine(
                        region,
                        tensors,
                        rank=rank * plan.blocks_per_chunk + j,
                        page_bytes=plan.sub_block_bytes,
                    )
                    for j in range(plan.blocks_per_chunk)
                ]
                for tensors in groups
            ]
        except BaseException:
            region.close()
            raise
        self.identity = identity
        self.region = region

    def close(self) -> None:
        """Waits for every copy, then unmaps (the file stays: it is the daemon's)."""
        for engines in self.engines:
            for engine in engines:
                engine.close()
        self.engines = []
        self.region.close()


@dataclass
class _Job:
    job_id: int
    is_load: bool
    num_bytes: int
    started: float
    parts: list[tuple[CopyEngine, int]] = field(default_factory=list)


class KvtierdOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` over a kvtierd region (see the module docstring).

    ``client`` and ``session`` (the pool's, opened by the spec) are owned from
    here on. Raises ValueError when the KV tensors do not fit the pool's rows.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        plan: PoolPlan,
        rank: int,
        client: Client,
        session: Session,
    ) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"kvtierd: rank {rank} outside world size {plan.world_size}")
        self._plan = plan
        self._rank = rank
        self._client = client
        self._session = session
        self._groups = _group_tensors(kv_caches)
        for g, tensors in enumerate(self._groups):
            page = sum(t.shape[1] * t.element_size() for t in tensors)
            if page > plan.sub_block_bytes:
                raise ValueError(
                    f"kvtierd: KV group {g} has {page} bytes per block but the pool's "
                    f"sub-blocks have {plan.sub_block_bytes}"
                )
        self._group_bytes = [
            sum(t.shape[1] * t.element_size() for t in tensors) for tensors in self._groups
        ]
        self._current = _Attachment(
            RegionIdentity.of_session(session), session.session_id, self._groups, plan, rank
        )
        self._jobs: dict[int, _Job] = {}  # submitted, not yet reported
        self._done: dict[CopyEngine, set[int]] = {}  # engine job ids finished, per engine
        # jobs whose rows' session is not proven alive yet, in submission order
        self._deferred: dict[int, tuple[GPULoadStoreSpec, KvtierdLoadStoreSpec, bool]] = {}
        self._fence = LeaseFence(client, session.lease_ms)
        self._results: list[TransferResult] = []  # finished, not yet reported

    @property
    def region(self) -> RegionIdentity:
        return self._current.identity

    # -- vLLM's OffloadingWorker API -------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """GPU blocks -> region rows. Always returns True (vLLM asserts it); a job that
        cannot run is reported by ``get_finished`` as failed, after an error log."""
        self._submit(job_id, src_spec, dst_spec, is_load=False)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Region rows -> GPU blocks; see :meth:`submit_store`.

        ``expedited`` (vLLM 0.33's sync loads, ``sync_load_budget_bytes`` > 0): vLLM
        calls :meth:`wait` for the job within the step. Copied like any load (the
        lease check first; CPU tensors inside this call, CUDA tensors on the copy
        engines' streams behind the copies queued before it); vLLM 0.32 never
        passes it."""
        self._submit(job_id, dst_spec, src_spec, is_load=True)
        return True

    def get_finished(self) -> list[TransferResult]:
        self._collect()
        results, self._results = self._results, []
        return results

    def wait(self, job_ids: set[int]) -> None:
        while any(job_id in self._deferred for job_id in job_ids):
            self._retry_deferred()
            if any(job_id in self._deferred for job_id in job_ids):
                time.sleep(0.01)  # the lease is unknown: wait for its proof
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            for engine, part_id in job.parts:
                engine.wait([part_id])

    def shutdown(self) -> None:
        """Waits for every copy, unmaps the region and closes the daemon session.
        Deferred copies are dropped: nobody waits for them any more."""
        self._deferred.clear()
        try:
            self._current.close()
        finally:
            self._fence.close()
            self._client.close()

    # -- internals -------------------------------------------------------------------

    def _submit(
        self, job_id: int, gpu: GPULoadStoreSpec, rows: LoadStoreSpec, *, is_load: bool
    ) -> None:
        job = _Job(job_id, is_load, 0, time.perf_counter())
        try:
            if not isinstance(rows, KvtierdLoadStoreSpec):
                raise TypeError(f"expected a KvtierdLoadStoreSpec, got {type(rows).__name__}")
            if not rows.valid or rows.region is None:
                raise RuntimeError("the scheduler could not pin the rows of this load")
            lease = self._fence.state(rows.lease_beacon, rows.session_id)
            if lease is LeaseState.UNPROVEN:
                self._defer(job_id, gpu, rows, is_load)
                return
            if lease is LeaseState.DEAD:
                self._drop_dead(job, rows, is_load)
                return
            attachment = self._attachment_for(rows.region, rows.session_id)
            if attachment is None:
                if is_load:
                    raise RuntimeError(
                        f"region {rows.region.path} of this load is gone (daemon restarted)"
                    )
                log.warning(
                    "kvtierd: dropping store job %d: its region %s is gone (daemon "
                    "restarted); its blocks will be misses", job_id, rows.region.path,
                )  # fmt: skip
                self._jobs[job_id] = job
                return
            plan = plan_copies(gpu, rows.block_ids, self._plan.blocks_per_chunk)
            for (g, j), pairs in plan.items():
                engine = attachment.engines[g][j]
                if is_load:
                    part = engine.submit_load([(row, blk) for blk, row in pairs])
                else:
                    part = engine.submit_store(pairs)
                job.parts.append((engine, part))
                job.num_bytes += len(pairs) * self._group_bytes[g]
        except Exception as err:
            log.error(
                "kvtierd: %s job %d failed: %s", "load" if is_load else "store", job_id, err,
                exc_info=not isinstance(err, (RuntimeError, TypeError)),
            )  # fmt: skip
            self._wait_parts(job)
            self._results.append(TransferResult(job_id, success=False))
            return
        self._jobs[job_id] = job

    def _defer(
        self, job_id: int, gpu: GPULoadStoreSpec, rows: KvtierdLoadStoreSpec, is_load: bool
    ) -> None:
        if not self._deferred:
            log.warning(
                "kvtierd: the scheduler's session is not proven alive (keepalives "
                "unanswered); copies wait until it is, or until it is known gone",
            )
        self._deferred[job_id] = (gpu, rows, is_load)

    def _drop_dead(self, job: _Job, rows: KvtierdLoadStoreSpec, is_load: bool) -> None:
        """The session holding the rows is gone: never copy. A store is dropped (the
        daemon ignores completions of a forgotten session); a load fails."""
        if is_load:
            raise RuntimeError(
                "the scheduler session that pinned the rows of this load is gone (lease "
                "expired or daemon restarted); the rows may hold other blocks now"
            )
        log.warning(
            "kvtierd: dropping store job %d: the scheduler session that reserved its "
            "rows is gone; its blocks will be misses", job.job_id,
        )  # fmt: skip
        self._jobs[job.job_id] = job

    def _finish(self, job: _Job) -> None:
        del self._jobs[job.job_id]
        self._results.append(
            TransferResult(
                job.job_id,
                success=True,
                transfer_size=job.num_bytes,
                transfer_time=time.perf_counter() - job.started,
            )
        )

    def _wait_parts(self, job: _Job) -> None:
        """Parts of a failed job already submitted must end before it is reported."""
        for engine, part_id in job.parts:
            engine.wait([part_id])

    def _collect(self, wait: bool = False) -> None:
        """Moves finished jobs (all their parts done) to the results; with ``wait``,
        waits for every job in flight first."""
        if wait:
            for job in self._jobs.values():
                self._wait_parts(job)
        self._retry_deferred()
        for engines in self._current.engines:
            for engine in engines:
                self._done.setdefault(engine, set()).update(engine.poll())
        for job in list(self._jobs.values()):
            if all(part_id in self._done.get(e, ()) for e, part_id in job.parts):
                for e, part_id in job.parts:
                    self._done[e].discard(part_id)
                self._finish(job)

    def _retry_deferred(self) -> None:
        """Submits the deferred jobs whose session's lease is known again, in order."""
        for job_id, (gpu, rows, is_load) in list(self._deferred.items()):
            if self._fence.state(rows.lease_beacon, rows.session_id) is LeaseState.UNPROVEN:
                return  # keep the order: later jobs wait behind this one
            del self._deferred[job_id]
            self._submit(job_id, gpu, rows, is_load=is_load)

    def _attachment_for(
        self, identity: RegionIdentity, session_id: str | None
    ) -> _Attachment | None:
        """The attachment of ``identity``, attaching it when it is a new region of the
        pool (daemon restarted; by descriptor through ``session_id``, the scheduler's
        session holding the job's rows: this worker's own session is the old
        daemon's); None when that region is gone."""
        if identity == self._current.identity:
            return self._current
        if not identity.still_current():
            return None
        fresh = _Attachment(identity, session_id, self._groups, self._plan, self._rank)
        # Every job in flight ends (and is queued for reporting) before the old
        # region is unmapped.
        self._collect(wait=True)
        old, self._current = self._current, fresh
        for engines in old.engines:
            for engine in engines:
                self._done.pop(engine, None)
        old.close()
        log.warning("kvtierd: worker attached the pool's new region %s", identity.path)
        return fresh


def plan_copies(
    gpu: GPULoadStoreSpec, chunk_ids: np.ndarray, blocks_per_chunk: int
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(group, sub-block) -> [(GPU block id, row id)] for one job.

    GPU blocks are listed group by group (``group_sizes``), rows (chunks) too;
    group ``g``'s first GPU block has logical index ``block_indices[g]``, so the
    group's first chunk is entered at sub-block ``block_indices[g] % bpc`` and the
    group spans ``ceil((size + skip) / bpc)`` chunks. Raises ValueError when the
    two specs disagree on the number of chunks.
    """
    gpu_ids = np.asarray(gpu.block_ids).tolist()
    rows = np.asarray(chunk_ids).tolist()
    sizes = list(gpu.group_sizes) if gpu.group_sizes is not None else [len(gpu_ids)]
    starts = list(gpu.block_indices) if gpu.block_indices is not None else [0] * len(sizes)
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    gi = ci = 0
    for g, (size, first) in enumerate(zip(sizes, starts, strict=True)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        num_chunks = math.ceil((size + skip) / blocks_per_chunk)
        if ci + num_chunks > len(rows):
            raise ValueError(
                f"group {g}: {size} GPU blocks from logical block {first} need {num_chunks} "
                f"rows, the job names {len(rows) - ci}"
            )
        for k in range(size):
            pos = skip + k
            out.setdefault((g, pos % blocks_per_chunk), []).append(
                (gpu_ids[gi + k], rows[ci + pos // blocks_per_chunk])
            )
        gi += size
        ci += num_chunks
    if ci != len(rows) or gi != len(gpu_ids):
        raise ValueError(
            f"the job names {len(rows)} rows and {len(gpu_ids)} GPU blocks; its groups "
            f"cover {ci} and {gi}"
        )
    return out


def _group_tensors(kv_caches: CanonicalKVCaches) -> list[list[torch.Tensor]]:
    """Per KV group, its distinct canonical tensors in vLLM's order."""
    groups: list[list[torch.Tensor]] = []
    for refs in kv_caches.group_data_refs:
        indices = list(dict.fromkeys(ref.tensor_idx for ref in refs))
        groups.append([kv_caches.tensors[i].tensor for i in indices])
    if not groups or any(not g for g in groups):
        raise ValueError("kvtierd: vLLM passed a KV group without tensors")
    return groups


def _attach_exactly(identity: RegionIdentity, session_id: str | None) -> AttachedRegion:
    """Maps the region ``identity`` names, checked on the descriptor it maps (same
    device and inode).

    By descriptor when the daemon serves them (``identity.fd_socket``) and
    ``session_id`` names a session of the region's pool: the daemon passes it to
    this process only if it may map the pool (RegionAccessDenied otherwise, never
    retried by path), and the path plays no part. Otherwise (an older daemon) by
    path, checking before and after that the file at that path is that very file.
    """
    if identity.fd_socket and session_id:
        return attach_region(
            identity.path,
            identity.num_blocks,
            identity.block_bytes,
            identity=(identity.device, identity.inode),
            fd_socket=identity.fd_socket,
            session_id=session_id,
            daemon_uid=identity.daemon_uid,
        )
    if not identity.still_current():
        raise FileNotFoundError(f"region {identity.path} is gone or was replaced")
    region = attach_region(
        identity.path,
        identity.num_blocks,
        identity.block_bytes,
        identity=(identity.device, identity.inode),  # checked on the fd it maps
        daemon_uid=identity.daemon_uid,  # and its owner
    )
    if not identity.still_current():
        region.close()
        raise FileNotFoundError(f"region {identity.path} was replaced while attaching")
    return region
