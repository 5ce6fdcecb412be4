"""The KV-event publisher: the daemon's blocks announced to KV-aware routers (llm-d,
NVIDIA Dynamo) in vLLM's wire format, over ZeroMQ (docs/design/kv-events.md).

- ``wireformat``: vLLM's messages and events, as bytes and maps (pure);
- ``descriptions``: each published key's engine hashes and tokens and the tiers
  holding it, bounded in bytes;
- ``translator``: a pool's block events turned into router events per medium (on
  the publisher's thread, which owns the description table);
- ``publisher``: the thread that owns the PUB and ROUTER sockets, numbers the
  messages and keeps the replay window;
- ``service``: the daemon's side: which pools are published, what the request
  path hands over (one append a call), the snapshot that outlives a restart.

Invariant: a block is announced only with its engine's own description (never a
placeholder), and every announced block is withdrawn (``BlockRemoved``) when the
last tier of its medium drops it or its description must go: a router may miss
a block, never keep one that is gone.

May import: ``kvtierd.config``, the root vocabulary (``kvtierd.contract``,
``kvtierd.errors``), ``kvtierd.util``, and zmq and msgpack.
"""
