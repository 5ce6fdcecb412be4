"""The client's private transport: request encoding, the gRPC connection, the fast
lane, call credentials, keepalives and the completion queue.

Not a public API: import ``kvtierd_client.client`` / ``.aio`` / ``.session`` instead.
May import ``kvtierd_client.wire``, ``kvtierd_client.errors``, ``kvtierd_client.types``,
``kvtierd_client.tls`` and ``kvtierd_client.lease_beacon``; never the public facades
(``client``, ``aio``, ``session``) or the engine plug-ins.
"""
