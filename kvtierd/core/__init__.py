"""Pools and sessions: the state every request works on.

- ``pools``: the table of pools and the global shared-memory budget;
- ``pool``: one pool (its region, primary manager, tiering, event log and claims);
- ``sessions``: sessions, their leases and their expiry;
- ``claims``: what each session holds in a pool (its pins and reservations);
- ``statistics``: a pool's numbers, computed in one place for GetStats and metrics.

Invariants: a pin or a reservation belongs to exactly one session (or to the pool's
tiering); releasing a session releases all it holds. Every method runs on the event loop
and checks its input before changing state.

May import: ``kvtierd.config`` (settings sections), ``kvtierd.tiering``, ``kvtierd.tiers``,
``kvtierd.primary``, ``kvtierd.records``, ``kvtierd.security``, the root vocabulary and
``kvtierd.util``. Never the API or the daemon's lifecycle.
"""
