"""The manager's connection to a real daemon: a new session after the old one is
gone, and what a failed OpenSession costs (client/kvtierd_client/vllm/connection.py).

The OpenSession failures are injected into ``reopen`` (a CANCELLED needs a daemon's
GOAWAY to race the call: tests/integration/ops/test_takeover.py causes it for real
but cannot time it); the daemon, the sessions and the lost session are real."""

from __future__ import annotations

import grpc
import pytest

from kvtierd_client.client import Client, Session
from kvtierd_client.errors import KvtierError, Unavailable
from kvtierd_client.vllm.accounting import ManagerCounters, StepAccounting
from kvtierd_client.vllm.connection import DaemonConnection
from kvtierd_client.wire.results import LookupResult

POOL = "connection"
RETRY_S = 30.0  # long enough that a test would notice a backoff


def connection_whose_session_is_gone(
    client: Client, fails: list[KvtierError]
) -> tuple[DaemonConnection, ManagerCounters, list[int]]:
    """A connection whose session the daemon forgot (closed, then used), and whose
    next OpenSessions raise ``fails`` in turn before they reach the daemon."""

    def reopen() -> Session:
        if fails:
            raise fails.pop(0)
        return client.open_session(POOL, block_bytes=4096, num_blocks=8)

    counters, lost = ManagerCounters(), []
    first = client.open_session(POOL, block_bytes=4096, num_blocks=8)
    connection = DaemonConnection(
        client, first, reopen, pool_name=POOL, retry_interval=RETRY_S, counters=counters,
        accounting=StepAccounting(), on_session_lost=lambda: lost.append(1),
    )  # fmt: skip
    gen = connection.usable()
    assert gen is not None
    first.close()  # the daemon forgets it: the next call finds it gone
    assert connection.call(gen, "lookup", gen.session.lookup, [b"k"]) is None
    assert connection.generation is None and lost == [1]
    return connection, counters, lost


def cancelled() -> KvtierError:
    return KvtierError("cancelled: the daemon sent GOAWAY", grpc.StatusCode.CANCELLED)


def test_a_reopen_cancelled_by_a_handing_over_daemon_is_sent_again_at_once(kvtierd):
    with Client(kvtierd.address) as client:
        connection, counters, _ = connection_whose_session_is_gone(client, [cancelled()])
        gen = connection.usable()
        assert gen is not None and gen.number == 2  # no retry_interval of misses
        assert counters.reconnects == 1
        assert gen.session.lookup([b"k"]) == [LookupResult.MISS]  # a live session
        gen.session.close()


@pytest.mark.parametrize(
    "fails",
    [
        lambda: [cancelled(), cancelled()],
        lambda: [Unavailable("the daemon is down", grpc.StatusCode.UNAVAILABLE)],
    ],
    ids=["cancelled twice", "unavailable"],
)
def test_a_reopen_that_fails_otherwise_serves_misses_for_retry_interval(kvtierd, fails):
    with Client(kvtierd.address) as client:
        connection, counters, _ = connection_whose_session_is_gone(client, fails())
        assert connection.usable() is None  # misses for retry_interval, not a storm
        assert connection.usable() is None  # and no second try meanwhile
        assert counters.reconnects == 0
