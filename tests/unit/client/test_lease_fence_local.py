"""The copier's fence (LeaseFence) against a scripted daemon: what it trusts when
the beacon file is gone, and how long its own KeepAlive proves a lease; and the
owner's beacon (LeaseBeacon): once DEAD, always DEAD."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from kvtierd_client.client import Client
from kvtierd_client.errors import NotFound, Unavailable
from kvtierd_client.lease_beacon import LeaseBeacon, LeaseBeaconReader, LeaseState
from kvtierd_client.lease_fence import LeaseFence
from kvtierd_client.wire.proto import pb2


class ScriptedDaemon:
    """``renew_lease`` as the daemon answers it: the lease in ms, or an error."""

    def __init__(self, lease_ms: int = 10_000) -> None:
        self.lease_ms = lease_ms
        self.gone: set[str] = set()
        self.down = False
        self.renewals: list[str] = []

    def renew_lease(self, session_id: str, *, timeout: float | None = None) -> int:
        self.renewals.append(session_id)
        if self.down:
            raise Unavailable("scripted: daemon down")
        if session_id in self.gone:
            raise NotFound("scripted: session gone")
        return self.lease_ms


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now


def test_the_copiers_own_proof_lasts_the_lease_the_daemon_answered(clock):
    """The fence was made when the lease was 10 s; the (restarted) daemon now
    answers 1 s. The copier's own KeepAlive proves the session for 1 s, not 10 s:
    past that it asks again, and without an answer the lease is unknown."""
    daemon = ScriptedDaemon(lease_ms=1000)
    fence = LeaseFence(daemon, lease_ms=10_000)
    owner = LeaseBeacon()  # publishes 0.0: the owner proves nothing
    try:
        assert fence.state(owner.path, "s") is LeaseState.PROVEN
        assert daemon.renewals == ["s"]
        clock[0] += 1.5  # the daemon expires a silent session after 1 s
        daemon.down = True
        assert fence.state(owner.path, "s") is LeaseState.UNPROVEN
        assert daemon.renewals == ["s", "s"]
    finally:
        fence.close()
        owner.close()


def test_a_removed_beacon_is_settled_by_the_daemon_not_raised(clock):
    """The owner removed its beacon (its session object is gone) before the copier
    read it: the copier asks the daemon instead of failing the job."""
    daemon = ScriptedDaemon()
    fence = LeaseFence(daemon, lease_ms=10_000)
    beacon = LeaseBeacon()
    path = beacon.path
    beacon.close()
    assert not os.path.exists(path)
    daemon.gone.add("old")
    assert fence.state(path, "old") is LeaseState.DEAD
    assert fence.state(path + "-never-existed", "alive") is LeaseState.PROVEN
    fence.close()


def test_an_old_generations_removed_beacon_never_makes_the_live_one_dead(clock):
    """A job of the old session (beacon removed, daemon restarted) is retried after
    the new session's beacon was read: the new session must still read PROVEN,
    or its stores would be dropped while the scheduler completes them (their rows
    would be served with whatever they held)."""
    daemon = ScriptedDaemon()
    fence = LeaseFence(daemon, lease_ms=10_000)
    old, new = LeaseBeacon(), LeaseBeacon()
    try:
        old.publish(clock[0] + 10)
        new.publish(clock[0] + 10)
        assert fence.state(old.path, "old") is LeaseState.PROVEN
        old.close()  # declared dead and removed
        daemon.gone.add("old")
        assert fence.state(new.path, "new") is LeaseState.PROVEN
        assert fence.state(old.path, "old") is LeaseState.DEAD
        assert fence.state(new.path, "new") is LeaseState.PROVEN
        assert daemon.renewals == ["old"]  # the live one was proven by its beacon
    finally:
        fence.close()
        new.close()


class NotFoundError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND

    def details(self) -> str:
        return "unknown session"


class LateKeepAliveStub:
    """A daemon that holds one KeepAlive's answer until told, and has forgotten the
    session by the time anything else arrives."""

    def __init__(self) -> None:
        self.keepalive_arrived = threading.Event()
        self.answer_keepalive = threading.Event()

    def OpenSession(self, request, **kwargs):  # noqa: N802
        return pb2.OpenSessionResponse(session_id="s", lease_ms=10_000)

    def KeepAlive(self, request, **kwargs):  # noqa: N802
        self.keepalive_arrived.set()
        assert self.answer_keepalive.wait(5), "the test never released the KeepAlive"
        return pb2.KeepAliveResponse(lease_ms=10_000)

    def Lookup(self, request, **kwargs):  # noqa: N802
        raise NotFoundError()


def test_a_keepalive_answered_after_the_session_ended_never_revives_its_beacon():
    """A KeepAlive in flight while the owner learns its session is gone (or closes
    it) is answered after the beacon said DEAD: the copiers must keep reading DEAD,
    or they would copy into rows the daemon has quarantined and freed."""
    stub = LateKeepAliveStub()
    session = Client("unix:///nowhere", stub=stub).open_session("p", 4096, keepalive=False)
    beacon = session.lease_beacon()
    reader = LeaseBeaconReader(beacon.path)
    late = threading.Thread(target=session.keep_alive)
    try:
        assert reader.state() is LeaseState.PROVEN  # proven by the OpenSession answer
        late.start()
        assert stub.keepalive_arrived.wait(5)
        with pytest.raises(NotFound):
            session.lookup([b"k"])  # the daemon forgot the session meanwhile
        assert reader.state() is LeaseState.DEAD
        stub.answer_keepalive.set()  # the late answer
        late.join(5)
        assert not late.is_alive()
        assert session.lease_ms == 10_000 and session.closed
        assert reader.state() is LeaseState.DEAD
        beacon.publish(time.monotonic() + 100)
        assert reader.state() is LeaseState.DEAD
        beacon.close()
        beacon.publish(time.monotonic() + 100)  # after close: nothing, no error
        assert reader.state() is LeaseState.DEAD
    finally:
        stub.answer_keepalive.set()
        reader.close()
        session.close()
