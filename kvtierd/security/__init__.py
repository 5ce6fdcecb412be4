"""Who may call the daemon, over what, and what they may reach (docs/security.md).

- ``principals``: the configured principals and their pool patterns;
- ``tokens``: the bearer tokens file ("TOKEN" or "TOKEN PRINCIPAL" lines);
- ``tls``: the TLS (and mTLS) credentials of TCP listeners, swappable at run time;
- ``identity``: Unix peer credentials, the names of a verified client
  certificate, and the ``Caller`` of an RPC;
- ``authorizer``: identity -> principal, immutable, rebuilt on reload;
- ``tickets``: peer tickets, how a Unix-socket peer's uid reaches its gRPC calls;
- ``gate``: callers without an identity refused before their request is read;
- ``access``: the access errors and pool checks; ``quotas``: per-principal memory;
- ``audit``: the audit log; ``state``: the daemon's security state, per-call identification;
- ``reload``: SIGHUP re-reads the credential files (tokens, certificates, keys)
  and swaps what was built from them; a bad file keeps the old credentials;
- ``trusted_dirs``: ``memory.shm_dir`` and tier roots must be the daemon's own
  (owner, no write for others without the sticky bit, no planted symlink);
  ``own_dirs``: those directories (and a listen socket's) made when missing, one level,
  no link followed, their mode exact;
- ``region_access``: region file descriptors handed (``SCM_RIGHTS``) to authorized
  peers only;
- ``config``: the ``[security]`` section of the configuration (its keys, its frozen
  section, its checks).

Invariants: a caller is identified before its request is read and authorized on every
call (no identity, no call); a refusal is audited, rate limited, and changes nothing;
what other users could plant (a file, a link, a directory) is checked without being
followed; a bad credential file on reload keeps the credentials in force.

May import: ``kvtierd.records``, ``kvtierd.prefix``, the root vocabulary and
``kvtierd.util`` (the layers below it), and ``kvtierd_client.wire`` (the peer-ticket
exchange, the trust rules); never the tiers, the primary tier, the pools or the API.
"""
