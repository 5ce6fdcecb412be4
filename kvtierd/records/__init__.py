"""A pool's bounded records: its sequenced block events and its removal history.

- ``events``: the sequenced block events TakeEvents and WatchEvents serve;
- ``history``: why a key left a tier, for Explain;
- ``packedkeys``: keys packed into one ``bytes``, as the event log retains them.

Invariants: both are bounded twice, in entries and in accounted bytes, and dropping the
oldest entry is the only way they shrink. Neither is durable: a restart starts them empty.

May import: the root vocabulary (``kvtierd.contract``, ``kvtierd.errors``) and
``kvtierd.util``.
"""
