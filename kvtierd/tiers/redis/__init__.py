"""The redis secondary tier: one value per block in Redis or Valkey.

Modules: :mod:`.settings` (every option, its default and its help),
:mod:`.configured` (one ``[[tiers]]`` entry: the link, the I/O threads, the
health timer), :mod:`.link` (standalone or Cluster: routing per node, redirects,
topology refresh, health), :mod:`.tier` (one pool's tier on the loop: presence
cache, probes, jobs), :mod:`.blockio` (its I/O threads' side: SET / GET /
EXISTS / DEL, verification).
"""
