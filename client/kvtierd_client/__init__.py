"""kvtierd_client: the Python client of kvtierd.

Import what you need from the submodules; this package stays light so the
scheduler side never imports torch:

* ``kvtierd_client.client`` — ``Client`` (sync) over the gRPC manager RPCs, and
  ``Session`` (``kvtierd_client.session``);
* ``kvtierd_client.aio`` — ``AsyncClient`` (asyncio);
* ``kvtierd_client.tls`` — ``TlsOptions`` for TLS and mTLS over TCP;
* ``kvtierd_client.errors`` — one exception class per gRPC status code;
* ``kvtierd_client.types`` — ``LookupResult``, ``StoreResult`` (defined in
  ``kvtierd_client.wire.results``; the daemon's contract uses the same ``LookupResult``);
* ``kvtierd_client.region`` — attach a pool's shared-memory region;
* ``kvtierd_client.copy_engine`` — move blocks between KV tensors and region rows;
* ``kvtierd_client.lease_beacon`` — a session's lease proof, published in shared memory
  for the processes that copy its rows; ``kvtierd_client.lease_fence`` — the copiers'
  check of it (copy a job's rows only while their session is proven alive);
* ``kvtierd_client.vllm`` — the vLLM plug-in; ``kvtierd_client.sglang`` — the SGLang
  storage backend (each needs its engine installed; nothing else imports them);
  ``kvtierd_client.engine_events`` — what both plug-ins read back from their engine's
  own KV events to describe their stores for KV-event routers (needs ``zmq``, which
  both engines install);
* ``kvtierd_client.wire`` — what the client and the daemon both speak (messages,
  results, frames, addresses, who can be the daemon): the one package the daemon imports;
* ``kvtierd_client.proto`` — the raw stubs' old import path, kept as a deprecated alias
  of ``kvtierd_client.wire.proto`` (the public one).

Private: ``kvtierd_client._rpc`` (the transport: encoding, the connection, the fast lane,
keepalives), ``kvtierd_client._shm`` (the shared-memory and CUDA helpers of the region
and the copy engine), ``kvtierd_client._extra_config`` (the reader of the engines' extra
config that both plug-ins share) and ``kvtierd_client._proto`` (the protobuf stubs,
generated at build time and imported through ``kvtierd_client.wire.proto`` only).

Invariants: every call of ``client``, ``aio`` and ``session`` raises a
``kvtierd_client.errors.KvtierError`` subclass, never a ``grpc.RpcError``; nothing but the
engine plug-ins needs an engine installed.

May import: nothing of ``kvtierd`` (the daemon). Within the client, each module only the
layers below its own (``pyproject.toml``'s "the client's layers" contract: the plug-ins,
then what they build on, the facades, the private ``_rpc`` and ``_shm``, ``wire``, the
stubs); ``wire`` imports nothing else of the client, ``_rpc`` and ``_shm`` never the
public facades or the engine plug-ins, and the two plug-ins never each other.
"""

__version__ = "0.1.0"
