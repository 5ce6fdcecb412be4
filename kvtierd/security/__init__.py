"""Who may call the daemon, and over what.

- ``tls``: the TLS (and mTLS) credentials of TCP listeners, swappable at run time;
- ``identity``: the name a verified client certificate gives its caller;
- ``reload``: SIGHUP re-reads the credential files (tokens, certificates, keys)
  and swaps what was built from them; a bad file keeps the old credentials;
- ``trusted_dirs``: ``memory.shm_dir`` and tier roots must be the daemon's own
  (owner, no write for others without the sticky bit, no planted symlink).
"""
