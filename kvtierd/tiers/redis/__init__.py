"""The redis secondary tier: one value per block in Redis or Valkey.

Modules: :mod:`.settings` (every option, its default and its help),
:mod:`.configured` (one ``[[tiers]]`` entry: the client, the I/O threads),
:mod:`.tier` (one pool's tier: presence cache, jobs, verification).
"""
