"""kvtierd: a standalone KV-cache tiering daemon for LLM inference engines.

Its packages and root modules, as layers from the top (docs/design/layout.md):

- ``ops``: the daemon's lifecycle, its command lines (``kvtierd``, ``kvtierctl``) and what
  operators watch (metrics, systemd notifications);
- ``api``: the gRPC service and the fast lane: validation, status codes, listeners;
- ``core``: pools and sessions, the state every request works on;
- ``kvevents``: the KV-event publisher routers (llm-d, Dynamo) read, in vLLM's format;
- ``config``: the one frozen configuration tree, read and checked once at start;
- ``tiering``: one pool's cascades to its secondary tiers and promotions back;
- ``tiers``: the secondary tiers (fs, redis, in memory) and their contract;
- ``primary``: a pool's shared-memory region and the block table over its rows;
- ``security``: who may call, over what, and what they may reach;
- ``records``: a pool's bounded event log and removal history;
- ``prefix``: where a prefix chain of lookup answers stops being usable;
- ``contract`` (the vocabulary every layer shares: keys, results, the block table's
  values) beside ``errors`` (the daemon's exceptions, each with its gRPC status);
- ``util``: small helpers of every layer (units, rate-limited logs, sockets...).

``__main__`` runs ``python -m kvtierd`` as the ``kvtierd`` command.

Invariants: a request walks strictly downward through the layers; no two sibling modules
or packages import each other in a circle (type-only imports counted). The daemon takes
nothing from the client but ``kvtierd_client.wire`` (``kvtierd.ops.ctl``, itself a client,
excepted).

May import: each entry only the entries below it in the list above (``contract`` and
``errors`` not each other; ``util`` the standard library only). ``pyproject.toml``'s
``[tool.importlinter]`` contracts say the same and ``make lint`` checks them.
"""

__version__ = "0.1.0"
