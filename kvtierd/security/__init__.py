"""Who may call the daemon, and what they may reach (README, "Security").

- ``principals``: the configured principals and their pool patterns;
- ``tokens``: the bearer tokens file ("TOKEN" or "TOKEN PRINCIPAL" lines);
- ``identity``: Unix peer credentials and the ``Caller`` of an RPC;
- ``authorizer``: identity -> principal, immutable, rebuilt on reload;
- ``tickets``: peer tickets, how a Unix-socket peer's uid reaches its gRPC calls;
- ``gate``: callers without an identity refused before their request is read;
- ``access``: the access errors and pool checks; ``quotas``: per-principal memory;
- ``audit``: the audit log; ``state``: the daemon's security state, per-call identification.
"""
