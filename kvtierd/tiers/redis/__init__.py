"""The redis secondary tier: one value per block in Redis or Valkey.

Modules: :mod:`.settings` (every option, its default and its help),
:mod:`.configured` (one ``[[tiers]]`` entry: the link, the I/O threads, the
health timer), :mod:`.link` (standalone or Cluster: routing per node, redirects,
topology refresh, health), :mod:`.tier` (one pool's tier on the loop: jobs,
statistics, lifecycle), :mod:`.keybook` (what that tier knows about keys: held
keys, presence cache, removals, its own LRU), :mod:`.faultlog` (its fault
lines), :mod:`.prober` (presence probes: pipelined ``EXISTS``), :mod:`.fleetlru`
(``fleet_capacity``'s LRU in the server), :mod:`.blockio` (the I/O threads'
side: ``SET NX`` / ``GETRANGE`` / ``DEL``, verification).
"""
