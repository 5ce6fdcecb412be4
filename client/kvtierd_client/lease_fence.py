"""The copier's fence: copy a job's rows only while the session that holds them
is proven alive (docs/design/leases.md). Used by the vLLM plug-in's workers,
whose jobs' rows belong to the scheduler's session.

The rows of a job belong to the scheduler's session (its reservation or its
pins). If that session's lease ran out, the daemon aborted the reservation and
released the pins, and after the quarantine it may give the rows to another
session: a late copy into them would overwrite another engine's block, a late
copy out of them would load another key's bytes. And a store the worker skips
while the session is still alive would be completed with whatever the rows
held. So a job is, by the scheduler session's lease:

* proven alive (its beacon's proof is ahead of now, or a KeepAlive of that
  session just answered): copied now;
* dead (the daemon forgot the session): never copied; a store is dropped (the
  daemon ignores completions of a session it forgot), a load fails;
* unknown (keepalives unanswered: a daemon stall, a frozen scheduler): deferred
  until one of the above. Sessions never come back, so a lease proven again
  after a gap never ran out, and the rows are still the session's.

vLLM's offloading worker asserts that every job succeeds, so deferral, not a
failure, is how "not yet" is expressed.
"""

from __future__ import annotations

import time

from kvtierd_client._rpc.session_state import fence_margin
from kvtierd_client.client import Client
from kvtierd_client.errors import KvtierError, NotFound
from kvtierd_client.lease_beacon import LeaseBeaconReader, LeaseState

RENEW_EVERY = 0.1  # seconds between two KeepAlives for one unproven session
RENEW_TIMEOUT = 0.5  # one such KeepAlive's deadline


class LeaseFence:
    """Tells a worker whether the session holding a job's rows is alive."""

    def __init__(self, client: Client, lease_ms: int) -> None:
        self._client = client
        self._margin = fence_margin(lease_ms)
        self._lease = lease_ms / 1000.0
        self._beacons: dict[str, LeaseBeaconReader] = {}
        # session id -> (monotonic proof from our own KeepAlive, last attempt)
        self._renewed: dict[str, tuple[float, float]] = {}
        self._dead: set[str] = set()

    def state(self, beacon_path: str | None, session_id: str | None) -> LeaseState:
        """The lease of ``session_id`` (published at ``beacon_path``) right now."""
        if beacon_path is None or session_id is None:
            return LeaseState.PROVEN  # a spec of an older scheduler: no fence to apply
        if session_id in self._dead:
            return LeaseState.DEAD
        try:
            state = self._beacon(beacon_path).state(self._margin)
        except OSError:
            # No readable beacon (its owner already removed it, or it is not one):
            # the daemon, not the file, is the authority on the session.
            state = LeaseState.UNPROVEN
        if state is not LeaseState.UNPROVEN:
            return state
        return self._renew(session_id)

    def _beacon(self, path: str) -> LeaseBeaconReader:
        reader = self._beacons.get(path)
        if reader is None:
            reader = LeaseBeaconReader(path)  # raises: the open readers stay as they are
            for old in self._beacons.values():  # one live generation at a time
                old.close()  # a closed reader reads DEAD: it must never stay cached
            self._beacons = {path: reader}
        return reader

    def _renew(self, session_id: str) -> LeaseState:
        """Proves the session alive ourselves: one KeepAlive, at most every RENEW_EVERY."""
        now = time.monotonic()
        proven, tried = self._renewed.get(session_id, (0.0, 0.0))
        if now < proven - self._margin:
            return LeaseState.PROVEN
        if now - tried < RENEW_EVERY:
            return LeaseState.UNPROVEN
        try:
            lease_ms = self._client.renew_lease(session_id, timeout=RENEW_TIMEOUT)
        except NotFound:
            self._dead.add(session_id)
            self._renewed.pop(session_id, None)
            return LeaseState.DEAD
        except KvtierError:
            self._renewed[session_id] = (proven, now)
            return LeaseState.UNPROVEN
        # The lease the daemon answered, not the one this fence was made with: a
        # daemon restarted with a shorter lease would otherwise be trusted too long.
        self._lease = lease_ms / 1000.0
        self._margin = fence_margin(lease_ms)
        self._renewed = {session_id: (now + self._lease, now)}
        return LeaseState.PROVEN

    def close(self) -> None:
        for reader in self._beacons.values():
            reader.close()
        self._beacons.clear()
