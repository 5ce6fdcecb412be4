"""What the client and the daemon both speak: the one package ``kvtierd`` imports from
``kvtierd_client``.

- ``proto``: the generated ``kvtier.v1`` messages and service stubs;
- ``results``: ``LookupResult`` and ``StoreResult`` (values equal the wire enums), the
  eviction policies' names;
- ``lane_frames``: the fast lane's frame header and method numbers;
- ``peer_ticket``: the peer-ticket exchange on the ticket socket;
- ``address``: daemon addresses (default socket, ``unix:`` / TCP targets);
- ``descriptions``: ``BlockDescription``, a stored key's blocks as its engine hashes
  them (what KV-event routers need), and its bounds;
- ``trust``: whether a path or a peer can be the daemon's (the client's defence against
  a local user impersonating kvtierd).

Invariant: nothing here does I/O at import.

May import: the standard library, protobuf and grpc, and the generated stubs
(``kvtierd_client._proto``); nothing else of ``kvtierd_client`` and nothing of ``kvtierd``.
"""
