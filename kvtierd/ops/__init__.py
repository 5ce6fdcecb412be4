"""Running the daemon: lifecycle, command lines and what operators watch.

- ``daemon``: start, serve, ordered shutdown; ``cli``: ``kvtierd``;
- ``ctl``: ``kvtierctl`` (a client of the daemon, through ``kvtierd_client``);
- ``metrics``: the Prometheus collector; ``metrics_endpoint``: its HTTP endpoint,
  served by an exporter process (``metrics_exporter``) under the caps and per-user
  rate limits of ``metrics_http``;
- ``shmdir``: ``memory.shm_dir`` made (private) when missing, and checked at start;
- ``sdnotify``: systemd's notify protocol.

May import every other package of the daemon; nothing imports it (``kvtierd.__main__``
excepted).
"""
