"""What the client and the daemon both speak: the one package ``kvtierd`` imports from
``kvtierd_client``.

- ``proto``: the generated ``kvtier.v1`` messages and service stubs;
- ``results``: ``LookupResult`` and ``StoreResult`` (values equal the wire enums), the
  eviction policies' names;
- ``lane_frames``: the fast lane's frame header and method numbers;
- ``peer_ticket``: the peer-ticket exchange on the ticket socket;
- ``address``: daemon addresses (default socket, ``unix:`` / TCP targets).

Invariant: nothing here does I/O at import, and nothing imports the rest of
``kvtierd_client`` or anything of ``kvtierd``.
"""
