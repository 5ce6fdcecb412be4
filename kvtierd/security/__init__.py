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
  (owner, no write for others without the sticky bit, no planted symlink).
"""
