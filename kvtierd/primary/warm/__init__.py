"""Warm restart of the primary tier (``memory.warm_restart``; docs/design/journal.md).

- ``journal``: one pool's append-only journal of completed and freed rows (its
  writer), ``journalformat`` its records and reading them back, ``clock`` the
  instants it records;
- ``holds``: what the previous daemon's clients may still touch after a restart,
  and for how long;
- ``rowsums``: what a row checksum covers, and where it is computed;
- ``hashworker``: the helper process that hashes rows from its own read-only
  mapping (its SIGBUS never reaches the daemon);
- ``adoption``: reading a journal back and adopting the rows it vouches for;
- ``journalfiles``: the journal's own files in a shared directory, opened so that a
  file another user planted is reported, never followed or removed.

Invariant: a row is adopted only if the journal names it ready with a checksum that the
row's bytes still match; anything else starts cold or is dropped, with one log line.

May import: ``kvtierd.primary`` (region, rows, safecopy), the root vocabulary and
``kvtierd.util``.
"""
