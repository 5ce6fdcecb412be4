"""Throw-away local users for security tests (issue #18): a real second uid on
this host, created with ``useradd`` and removed with ``userdel`` in teardown.

Only root can create users; elsewhere the fixture skips with the reason. Code
runs as the user in a child process (``run_python``) that ``setpriv`` switches to
the user before it execs the code (never ``subprocess``'s ``user=``, which
forks this gRPC-using process: spawn_harness), so the test process itself never
changes identity.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from spawn_harness import as_user

SYSTEM_PYTHON = "/usr/bin/python3"  # any user may run it (unlike a venv under /root)


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int

    def run_python(
        self, code: str, *args: str, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``python3 -c code args...`` (the system's interpreter, standard
        library only: the test venv lives under root's home) as this user, with
        no supplementary groups."""
        return subprocess.run(
            as_user([SYSTEM_PYTHON, "-c", code, *args], self.uid, self.gid),
            capture_output=True, text=True, timeout=timeout, cwd="/",
        )  # fmt: skip


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: creates a throw-away user with useradd"
    if any(shutil.which(tool) is None for tool in ("useradd", "userdel", "setpriv")):
        return "needs useradd, userdel and setpriv"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"needs {SYSTEM_PYTHON} to run code as the throw-away user"
    return None


@pytest.fixture
def other_user() -> Iterator[LocalUser]:
    """A fresh local user (no home directory, no login), removed afterwards."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    name = f"kvt{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)  # fmt: skip
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield LocalUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)
