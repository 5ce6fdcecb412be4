"""Small helpers every layer may use: size and duration parsing (``units``), rate-limited
log lines (``ratelimit``), file types in words (``filekind``), the first act of every
worker process the daemon starts (``workerproc``) and futures other threads complete on
the loop (``loopfuture``).

Invariant: nothing here knows about pools, blocks, tiers or the wire. These modules import
only the standard library and each other; every other package of the daemon may import
them.
"""
