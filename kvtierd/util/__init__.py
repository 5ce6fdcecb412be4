"""Small helpers every layer may use: units, rate-limited logs, files and their locks,
worker processes, loop futures, fair shares, the C heap, sockets and their owners.

- ``units``: size and duration parsing; ``ratelimit``: rate-limited log lines;
- ``filekind``: file types in words; ``flocks``: who holds a file's ``flock``
  (``/proc/locks``);
- ``workerproc``: the first act of every worker process the daemon starts;
- ``loopfuture``: futures other threads complete on the loop; ``offloop``: a blocking
  call run on a daemon thread of its own, awaited on the loop;
- ``fairshare``: fair shares of a bounded pool of places between named holders;
- ``heap``: the C heap's hold on memory the daemon freed (glibc malloc);
- ``sockets``: listening Unix sockets put in place atomically, all or none, and removed
  only while they are still one's own;
- ``tcpowner``: the uid owning the peer's end of a local TCP connection (one exact
  ``NETLINK_SOCK_DIAG`` query).

Invariant: nothing here knows about pools, blocks, tiers or the wire.

May import: the standard library and each other only; every other package of the daemon
may import them.
"""
