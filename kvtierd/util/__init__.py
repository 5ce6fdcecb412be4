"""Small helpers every layer may use: size and duration parsing (``units``), rate-limited
log lines (``ratelimit``), file types in words (``filekind``) and the first act of every
worker process the daemon starts (``workerproc``).

Invariant: nothing here knows about pools, blocks, tiers or the wire. These modules import
only the standard library and each other; every other package of the daemon may import
them.
"""
