"""A real kvtierd running as an unprivileged user (the shipped systemd setup runs it
as ``kvtierd``), for tests that root drives: ``start_daemon(command_prefix=
as_user_prefix(user), owner=(user.uid, user.gid))``.

The test interpreter may live where other users cannot reach it (pyenv under
``/root``, mode 0700). The prefix therefore runs the daemon in a private mount
namespace (``unshare --mount``) in which a small tmpfs covers the unreachable
ancestor and the interpreter's directory is bind-mounted back at its own path,
then drops to the user with ``setpriv`` (its supplementary groups only, no
capabilities). Nothing else changes: ``/dev/shm``, ``/tmp`` and every other path
are the host's, so other users' processes and the test see the daemon's files.
The namespace ends with the daemon. Only root can do this: ``require_nonroot_daemon``
skips with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys

import pytest
from users_harness import User

_SCRIPT = (
    'set -e; hidden="$1"; keep="$2"; small="$3"; size="$4"; shift 4; '
    'if [ -n "$hidden" ]; then '
    'spare=$(mktemp -d /tmp/kvt-ns-XXXXXX); mount --bind "$keep" "$spare"; '
    'mount -t tmpfs -o mode=0755,size=1m kvtierd-test "$hidden"; '
    'mkdir -p "$keep"; mount --bind "$spare" "$keep"; umount "$spare"; rmdir "$spare"; fi; '
    'if [ -n "$small" ]; then mount -t tmpfs -o "mode=1777,size=$size" kvtierd-test "$small"; fi; '
    'exec "$@"'
)


def require_nonroot_daemon() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: runs the daemon as a throw-away user")
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} to run the daemon as another user")


def _unreachable_ancestor(path: str) -> str:
    """The highest directory above ``path`` that others may not search ("" if none)."""
    parts = [part for part in path.split("/") if part]
    for i in range(1, len(parts)):
        directory = "/" + "/".join(parts[:i])
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return directory
    return ""


def as_user_prefix(user: User, small_tmpfs: tuple[str, int] | None = None) -> list[str]:
    """The command prefix that runs what follows it as ``user`` (see the module
    docstring). ``small_tmpfs`` (directory, bytes): a tmpfs of that size is mounted
    there for the daemon alone (sticky, as /dev/shm), to fill for real; the test
    reaches it through ``/proc/<daemon pid>/root``."""
    base = os.path.realpath(sys.base_prefix)
    hidden = _unreachable_ancestor(base)
    for needed in (os.path.realpath(sys.prefix), os.path.dirname(os.path.abspath(__file__))):
        if _unreachable_ancestor(needed) not in ("", hidden):
            pytest.skip(f"{needed} is not reachable by other users")
    return [
        "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _SCRIPT, "sh",
        hidden, base if hidden else "", *(map(str, small_tmpfs) if small_tmpfs else ("", "")),
        "setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", *_groups(user),
        "--inh-caps=-all", "--",
    ]  # fmt: skip


def _groups(user: User) -> list[str]:
    """setpriv's flag for ``user``'s supplementary groups (none: cleared)."""
    if not user.groups:
        return ["--clear-groups"]
    return ["--groups=" + ",".join(map(str, user.groups))]
