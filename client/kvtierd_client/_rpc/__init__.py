"""The client's private transport: request encoding, the gRPC connection, the fast
lane, call credentials, keepalives and the completion queue.

- ``codec``: requests built and responses decoded for every manager RPC;
- ``connection``: one channel to one daemon, shared by the sync and the asyncio client;
- ``credentials``: what each call carries to prove who it is (a bearer token over TCP,
  the peer ticket over a Unix socket);
- ``trusted_daemon``: whether what answers at a Unix socket is the daemon's (the rules
  of ``kvtierd_client.wire.trust``);
- ``session_state``: what a session knows about itself (identity, open/closed/gone, its
  lease proof);
- ``keepalive``: the keepalive of a session's lease, sync and asyncio alike;
- ``completion_queue``: a sync session's queued completions; ``flusher``: the deadline
  that sends them when no call carries them;
- ``fastlane``: the client end of a session's fast lane.

Invariants: a daemon's refusal or a transport failure reaches the caller as a
``kvtierd_client.errors`` exception, never a ``grpc.RpcError``; over a Unix socket, a
session's region, lane and descriptor sockets are used only if the daemon's uid (found
from a socket path placed by a trusted user) serves or owns them.

Not a public API: import ``kvtierd_client.client`` / ``.aio`` / ``.session`` instead.
May import ``kvtierd_client.wire``, ``kvtierd_client.errors``, ``kvtierd_client.types``,
``kvtierd_client.tls`` and ``kvtierd_client.lease_beacon``; never the public facades
(``client``, ``aio``, ``session``) or the engine plug-ins.
"""
