"""The worker's attachment path without an engine: a real daemon, the plug-in's
own worker (``KvtierdOffloadingWorker``) over CPU tensors.

A worker maps the pool's region by the descriptor the daemon passes when the
daemon offers one (``Region.fd_socket``), asking with a live session of the
pool: its own at start, the scheduler's session holding a job's rows for a new
region. With an older daemon (no ``fd_socket``) it maps by path and checks the
announced identity. Regions are tiny (4 rows of 4 KiB).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kvtierd_client._shm.region_fd as region_fd
from kvtierd_client._shm.region_fd import RegionAccessDenied
from kvtierd_client.client import Client, Session
from kvtierd_client.region import RegionIdentityError
from kvtierd_client.vllm.common import RegionIdentity
from kvtierd_client.vllm.settings import PoolPlan
from kvtierd_client.vllm.worker import KvtierdOffloadingWorker, _attach_exactly

BLOCK = 4096
BLOCKS = 4
PLAN = PoolPlan(
    name="unused", block_bytes=BLOCK, num_blocks=BLOCKS, layout="", world_size=1,
    blocks_per_chunk=1, sub_block_bytes=BLOCK,
)  # fmt: skip


def kv_caches() -> SimpleNamespace:
    """vLLM's CanonicalKVCaches, as much as the worker reads: one group, one tensor."""
    tensor = torch.zeros(8, BLOCK, dtype=torch.uint8)
    return SimpleNamespace(
        tensors=[SimpleNamespace(tensor=tensor)],
        group_data_refs=[[SimpleNamespace(tensor_idx=0)]],
    )


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The session ids the worker asks the daemon's descriptor socket with."""
    asked: list[str] = []
    real = region_fd.request_region_fd

    def spy(
        socket_path: str,
        session_id: str,
        timeout: float = region_fd.REQUEST_TIMEOUT_S,
        *,
        server_uid: int | None = None,
    ) -> int:
        asked.append(session_id)
        return real(socket_path, session_id, timeout, server_uid=server_uid)

    monkeypatch.setattr(region_fd, "request_region_fd", spy)
    return asked


@pytest.fixture
def sessions(kvtierd) -> Iterator[Client]:
    with Client(kvtierd.address) as client:
        yield client


def open_pool(client: Client, name: str) -> Session:
    return client.open_session(name, block_bytes=BLOCK, num_blocks=BLOCKS)


class SwappedPath:
    """The attack of issue #18: the region file at the path is replaced by another
    file of the same size (the daemon's file set aside, put back on exit)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.aside = self.path.with_name(self.path.name + ".aside")

    def __enter__(self) -> SwappedPath:
        os.rename(self.path, self.aside)
        self.path.write_bytes(b"\xee" * (BLOCK * BLOCKS))
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.replace(self.aside, self.path)


def test_the_region_identity_carries_the_descriptor_socket_but_is_not_it(sessions):
    session = open_pool(sessions, "worker/identity")
    identity = RegionIdentity.of_session(session)
    assert identity.fd_socket == session.region.fd_socket
    assert identity.fd_socket.endswith(".regions")
    assert identity == replace(identity, fd_socket="")  # how to reach it, not what it is
    assert hash(identity) == hash(replace(identity, fd_socket=""))
    session.close()


def test_a_worker_maps_the_region_by_descriptor_with_its_own_session(kvtierd, requests):
    client = Client(kvtierd.address)
    session = open_pool(client, "worker/own")
    with SwappedPath(session.region.path) as swap:
        worker = KvtierdOffloadingWorker(kv_caches(), PLAN, 0, client, session)  # type: ignore[arg-type]
        try:
            assert requests == [session.session_id]
            # the daemon's region is mapped, not the file at the path
            worker._current.region.numpy()[2][:5] = memoryview(b"fd-in")
            assert swap.aside.read_bytes()[2 * BLOCK : 2 * BLOCK + 5] == b"fd-in"
            assert swap.path.read_bytes()[:4] == b"\xee" * 4
        finally:
            worker.shutdown()  # closes the client and the session too


def test_a_new_region_is_mapped_through_the_session_holding_the_jobs_rows(
    kvtierd, sessions, requests
):
    client = Client(kvtierd.address)
    own = open_pool(client, "worker/first")
    worker = KvtierdOffloadingWorker(kv_caches(), PLAN, 0, client, own)  # type: ignore[arg-type]
    try:
        # the scheduler's session on a new region of the pool (as after a daemon
        # restart, when the worker's own session is the old daemon's)
        scheduler = open_pool(sessions, "worker/second")
        fresh = RegionIdentity.of_session(scheduler)
        attachment = worker._attachment_for(fresh, scheduler.session_id)
        assert attachment is not None and worker.region == fresh
        assert requests == [own.session_id, scheduler.session_id]
        attachment.region.numpy()[1][:3] = memoryview(b"new")
        assert Path(fresh.path).read_bytes()[BLOCK : BLOCK + 3] == b"new"
        scheduler.close()
    finally:
        worker.shutdown()


def test_with_an_older_daemon_the_worker_maps_by_path_and_checks_the_identity(
    sessions, monkeypatch
):
    def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("no descriptor socket was announced: nothing to ask")

    monkeypatch.setattr(region_fd, "request_region_fd", refuse)
    session = open_pool(sessions, "worker/older")
    older = replace(RegionIdentity.of_session(session), fd_socket="")  # as an older daemon
    region = _attach_exactly(older, session.session_id)
    assert region.size == BLOCK * BLOCKS
    region.close()
    with SwappedPath(session.region.path), pytest.raises(FileNotFoundError, match="replaced"):
        _attach_exactly(older, session.session_id)
    session.close()


def test_the_path_way_still_refuses_a_file_swapped_while_it_opens(sessions, monkeypatch):
    session = open_pool(sessions, "worker/race")
    older = replace(RegionIdentity.of_session(session), fd_socket="")
    monkeypatch.setattr(RegionIdentity, "still_current", lambda self: True)  # swapped after
    with SwappedPath(session.region.path), pytest.raises(RegionIdentityError):
        _attach_exactly(older, session.session_id)
    session.close()


def test_a_refused_descriptor_is_not_retried_by_path(sessions, monkeypatch):
    def refused(socket_path: str, session_id: str, timeout: float = 5.0, **_: object) -> int:
        raise RegionAccessDenied("permission denied: uid 1 gid 1 may not map pool 'p'")

    monkeypatch.setattr(region_fd, "request_region_fd", refused)
    session = open_pool(sessions, "worker/refused")
    with pytest.raises(RegionAccessDenied, match="may not map"):
        _attach_exactly(RegionIdentity.of_session(session), session.session_id)
    session.close()


def test_an_unknown_session_gets_no_descriptor(sessions):
    session = open_pool(sessions, "worker/unknown")
    with pytest.raises(RegionAccessDenied, match="unknown, closed or expired"):
        _attach_exactly(RegionIdentity.of_session(session), "0" * 32)
    session.close()
