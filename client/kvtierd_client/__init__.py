"""kvtierd_client: the Python client of kvtierd.

Import what you need from the submodules; this package stays light so the
scheduler side never imports torch:

* ``kvtierd_client.client`` — ``Client`` (sync) over the gRPC manager RPCs, and
  ``Session`` (``kvtierd_client.session``);
* ``kvtierd_client.aio`` — ``AsyncClient`` (asyncio);
* ``kvtierd_client.tls`` — ``TlsOptions`` for TLS and mTLS over TCP;
* ``kvtierd_client.wire.results`` — ``LookupResult``, ``StoreResult`` (the daemon's
  contract uses the same ``LookupResult``);
* ``kvtierd_client.region`` — attach a pool's shared-memory region;
* ``kvtierd_client.copy_engine`` — move blocks between KV tensors and region rows.
"""

__version__ = "0.1.0"
