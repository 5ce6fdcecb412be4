"""Secondary tiers (docs/design/tiers.md): where blocks live besides the primary region.

- ``base``: the tier contract (:class:`~kvtierd.tiers.base.SecondaryTier`, its jobs,
  reports and statistics) that every tier type implements and ``tests/tiers/`` checks;
- ``configured``: what the daemon holds for one ``[[tiers]]`` table for its whole life
  (:class:`~kvtierd.tiers.configured.ConfiguredTier`), and the errors of a tier's start;
- ``registry``: the tier types this build knows, by the ``type`` of a ``[[tiers]]`` table;
- ``options``: how a tier type declares its options once (default, help and reader
  of each; the table the parser, ``--help`` and the docs read) and the shared readers;
- ``blockformat``: the block format the fs and redis tiers share (a header naming key,
  pool and checksums, sealed with a MAC under integrity keys; then the row);
- ``iopool``: the I/O threads the fs and redis tiers run their jobs on (completions
  reported on the loop, cascade writes bounded);
- ``budget``: a tier's write budget (``max_write_bytes_per_s``), a token bucket on an
  injected clock shared by the tier's pools;
- ``failures``: why a block did not load (missing, corrupt, transient, fault), one
  classification for every tier;
- ``integrity``: keyed integrity (a MAC) of the values of a tier other hosts can write;
  ``keyfiles``: its key files, read at daemon start;
- ``memory``: an in-memory tier, the reference implementation of the contract (tests
  only: not a configurable type);
- ``fs``: the fs tier type, one file per block under a root directory;
- ``redis``: the redis tier type, one value per block in Redis or Valkey. The two tier
  types import nothing of each other: what they share is in this package.

Invariants: a tier only copies blocks (the pool's tiering decides what moves, and the
primary's manager owns the rows); a tier's methods run on the event loop and never
block, its I/O runs on its own threads or processes; every job it accepts reports
exactly once; a loaded block is served only once its bytes are verified to be the
bytes stored under its key. The configuration and the pools reach a tier type only
through ``registry``.

May import: ``kvtierd.primary`` (its rows), ``kvtierd.security`` (trusted directories),
the root vocabulary and ``kvtierd.util``: the layers below it. Never ``kvtierd.tiering``,
the configuration, the pools or the API.
"""
