"""Running the daemon: lifecycle, command lines and what operators watch.

- ``daemon``: start, serve, ordered shutdown; ``cli``: ``kvtierd``;
- ``takeover``: a new daemon taking over the sockets of the one it replaces, without a
  refused connection (``kvtierd --takeover``);
- ``ctl``: ``kvtierctl`` (a client of the daemon, through ``kvtierd_client``);
- ``metrics``: the Prometheus collector; ``metrics_endpoint``: its HTTP endpoint,
  served by an exporter process (``metrics_exporter``) under the caps and per-user
  rate limits of ``metrics_http``;
- ``shmdir``: ``memory.shm_dir`` made (private) when missing, and checked at start;
- ``sdnotify``: systemd's notify protocol.

Invariants: a start the operator must fix (a bad value, a busy socket) ends with one line
naming what to fix and exit code 2, never a traceback; shutdown runs in one order (health
NOT_SERVING first, the socket files removed last); a takeover never signals a process of
another uid.

May import every other package of the daemon; nothing imports it (``kvtierd.__main__``
excepted). ``ctl`` alone imports the client's public modules (it is a client).
"""
