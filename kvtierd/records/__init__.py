"""A pool's bounded records: its sequenced block events (``events``: what TakeEvents and
WatchEvents serve) and its removal history (``history``: why a key left a tier, for
Explain).

Invariants: both are bounded twice, in entries and in accounted bytes, and dropping the
oldest entry is the only way they shrink. Neither is durable: a restart starts them empty.

May import: the root vocabulary (``kvtierd.contract``, ``kvtierd.errors``) and
``kvtierd.util``.
"""
