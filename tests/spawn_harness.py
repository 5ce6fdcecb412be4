"""Children of the test process, started without ``fork()``.

Once this process has used gRPC (any test that opened a client), gRPC's event
engine has threads and ``pthread_atfork`` handlers. A real ``fork()`` runs the
child handler, which restarts the engine's threads and a fresh epoll poller in
the child; ``subprocess`` then closes the child's descriptors (``close_fds``)
before ``exec``, the restarted poller's ``epoll_wait`` fails with EBADF and gRPC
aborts the child: SIGABRT, no output, one ``Epoll1Poller ... encountered
epoll_wait error: Bad file descriptor`` line on its stderr, a few times in a
hundred and more often on a busy machine.

``subprocess`` forks for real whenever it is given ``preexec_fn``, ``user``,
``group`` or ``extra_groups``; otherwise it uses ``vfork``/``posix_spawn``, which
run no fork handlers. So tests never pass those: the child changes itself with
the argv prefixes below and then execs the command.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_LIMIT_AND_EXEC = (
    "import os, resource, sys; limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_AS, (limit, limit)); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def with_address_space(argv: Sequence[str], limit_bytes: int) -> list[str]:
    """``argv`` run with RLIMIT_AS set to ``limit_bytes`` (instead of a
    ``preexec_fn``): an interpreter sets the limit on itself, then execs
    ``argv`` (``argv[0]`` a path), which keeps it."""
    return [sys.executable, "-c", _LIMIT_AND_EXEC, str(limit_bytes), *argv]


def as_user(argv: Sequence[str], uid: int, gid: int) -> list[str]:
    """``argv`` run as ``uid``:``gid`` with no supplementary groups (instead of
    ``subprocess``'s ``user=``, ``group=``, ``extra_groups=[]``), through ``setpriv``."""
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]
