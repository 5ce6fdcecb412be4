"""The redis secondary tier: one value per block in Redis or Valkey.

Modules:

- ``settings``: every option, its default and its help;
- ``configured``: one ``[[tiers]]`` entry (the link, the I/O threads, the health timer);
- ``link``: standalone or Cluster: routing per node, redirects, topology refresh, health;
  ``access``: how the tier reaches its server (TLS, what a refusal means);
  ``deadline``: a deadline per Redis call over redis-py's per-``recv`` timeout;
- ``health``: the server's health summed over its masters' ``INFO`` answers;
  ``nodefaults``: which nodes failed lately, and the log lines about them;
- ``tier``: one pool's tier on the loop (jobs, statistics, lifecycle);
- ``keybook``: what that tier knows about keys (held keys, presence cache, removals, its
  own LRU); ``faultlog``: its fault lines, rate limited;
- ``prober``: presence probes (pipelined ``EXISTS``, one in flight per node);
- ``fleetlru``: ``fleet_capacity``'s LRU in the server, shared by every daemon;
- ``blockio``: the I/O threads' side (``SET NX`` / ``GETRANGE`` / ``DEL``, verification).

Invariants: the event loop never waits on Redis (every call runs on the tier's I/O
threads, each with a deadline); a value is served only if it verifies for the key and
pool it was read under (else it is deleted and counted, never copied out); a server that
cannot be reached answers MISS and is logged once, and never stops the daemon.

May import: ``kvtierd.tiers`` (the contract, failures, integrity, options, the block
format and the I/O threads), ``kvtierd.primary`` (its rows), ``kvtierd.security``, the
root vocabulary and ``kvtierd.util``; never ``kvtierd.tiers.fs``.
"""
