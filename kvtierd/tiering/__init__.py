"""Moving blocks between one pool's primary tier and its secondary tiers.

- ``manager``: :class:`Tiering`: cascades after CompleteStore (primary -> every tier)
  and promotions on Lookup (a tier -> the primary);
- ``holds``: promotion holds, pool-owned pins that keep a promoted block in the
  primary until the engine that asked comes back for it;
- ``remote``: a Lookup's bounded wait for what its remote tiers (Redis, a shared fs
  root) hold;
- ``retries``: which promotions failed lately, and when each key may be promoted from
  its tier again;
- ``admission``: which blocks each tier is written (``always``, ``reused``,
  ``tinylfu``), counted per tier and reason;
- ``sketch``: the frequency sketch ``tinylfu`` decides by, fixed in bytes;
- ``budget``: the write-budget gate after admission (what a tier's
  ``max_write_bytes_per_s`` lets through now; the rest is dropped and counted).

Invariants: a cascade job owns one pin per key it copies and a promotion owns the
reservation of the row it fills; both are released exactly once, when the tier answers
or the pool closes. Sessions never see or release them.

May import: ``kvtierd.tiers`` (the tier contract), ``kvtierd.primary``,
``kvtierd.records``, the root vocabulary and ``kvtierd.util``.
"""
