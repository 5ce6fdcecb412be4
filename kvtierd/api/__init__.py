"""The daemon's API: the gRPC service and the fast lane, and what guards them.

- ``handlers``: the request handlers of both transports (validate, call the pool,
  answer); ``keycalls``: the manager calls on a session's keys, shared by the single
  RPCs and Batch;
- ``grpc_service``: the KVTier gRPC servicer, a thin adapter over the handlers;
- ``server``: the gRPC servers and their Unix and TCP listeners;
- ``fastlane``: a session's hot calls as framed protobuf on a Unix socket (its socket,
  tokens and bounds; ``laneconn``: one connection, its frames and in-order answers;
  ``lanebuffers``: the bytes the lane holds between reads, bounded per owner and in all);
- ``guards``, ``validation``: unparsable requests and field checks (INVALID_ARGUMENT,
  nothing changed);
- ``messages``: the daemon's values (a pool's spec, an event, statistics) as
  ``kvtier.v1`` messages; ``wire``: the daemon's enums as the wire's;
- ``watch``: WatchEvents stream bounds; ``grpclog``: grpc's own log lines, rate limited.

Invariants: every RPC validates every field before touching state; a rejected call
changes nothing; a client mistake is never logged with a traceback.

May import: ``kvtierd.core`` and everything below it, and ``kvtierd_client.wire``.
Never ``kvtierd.ops``.
"""
