"""The KV-event publisher: the daemon's blocks announced to KV-aware routers (llm-d,
NVIDIA Dynamo) in vLLM's wire format, over ZeroMQ (docs/design/kv-events.md).

- ``wireformat``: vLLM's messages and events, as bytes and maps (pure);
- ``descriptions``: each published key's engine hashes and tokens and the tiers
  holding it, bounded in bytes;
- ``translator``: a pool's block events turned into router events per medium (in
  the worker, on the publisher's thread, which owns the description table);
- ``publisher``: the thread that owns the PUB and ROUTER sockets, numbers the
  messages and keeps the replay window;
- ``worker``: ``python -m kvtierd.kvevents.worker``, the publisher's own process
  (its own interpreter: the daemon's request path only writes a frame to it);
- ``snapshots``: the published pools' descriptions saved at stop, read when a
  pool opens again;
- ``service``: the daemon's side: which pools are published, the worker started
  (again, if it dies), one frame a call handed over, the re-announce of a pool.

Invariant: a block is announced only with its engine's own description (never a
placeholder), and every announced block is withdrawn (``BlockRemoved``) when the
last tier of its medium drops it or its description must go: a router may miss
a block, never keep one that is gone.

May import: ``kvtierd.config``, the root vocabulary (``kvtierd.contract``,
``kvtierd.errors``), ``kvtierd.util``, and zmq and msgpack.
"""
