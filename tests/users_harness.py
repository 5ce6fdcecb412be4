"""Throw-away Unix users and groups for the security tests, and running client
calls as one of them.

Creating users needs root (``useradd``); ``require_root`` skips a test with the
reason otherwise. Every user and group made here is removed at teardown, even
when the test fails.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, start_daemon

PEER_CLIENT = Path(__file__).resolve().parent / "peer_client.py"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int  # its own primary group
    groups: tuple[int, ...] = ()  # supplementary groups its processes run with


@dataclass(frozen=True)
class Group:
    name: str
    gid: int


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates throw-away users with useradd")
    for tool in ("useradd", "userdel", "groupadd", "groupdel"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} to create throw-away users")


@dataclass
class ThrowawayAccounts:
    """Makes users and groups named ``kvt<random>``; ``remove_all`` deletes them."""

    users: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)

    def group(self) -> Group:
        name = f"kvtg{secrets.token_hex(3)}"
        _run("groupadd", "--system", name)
        self.groups.append(name)
        return Group(name, grp.getgrnam(name).gr_gid)

    def user(self, *groups: Group) -> User:
        name = f"kvtu{secrets.token_hex(3)}"
        _run(
            "useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
            "--user-group", name,
        )  # fmt: skip
        self.users.append(name)
        self.groups.append(name)  # its own group (userdel usually removes it too)
        entry = pwd.getpwnam(name)
        return User(name, entry.pw_uid, entry.pw_gid, tuple(g.gid for g in groups))

    def remove_all(self) -> None:
        for name in self.users:
            subprocess.run(["userdel", name], capture_output=True, check=False)
        for name in self.groups:
            subprocess.run(["groupdel", name], capture_output=True, check=False)


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed: {done.stderr.strip()}")


def run_as(user: User, address: str, calls: list[list[object]]) -> list[dict[str, object]]:
    """Runs ``calls`` (see ``peer_client.py``) in a new process with
    ``user``'s uid, gid and groups; one ``{"ok": ...}`` or ``{"error": CODE,
    "details": ...}`` per call."""
    spec = {
        "uid": user.uid, "gid": user.gid, "groups": [user.gid, *user.groups],
        "address": address, "calls": calls,
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(PEER_CLIENT), json.dumps(spec)],
        capture_output=True, text=True, timeout=120, cwd="/", check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"peer client failed ({done.returncode}):\n{done.stderr}")
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] == user.uid, report
    return report["results"]


def principals_toml(*tables: dict[str, object]) -> str:
    text = ""
    for table in tables:
        text += "[[security.principals]]\n"
        for key, value in table.items():
            rendered = repr(value).replace("'", '"') if not isinstance(value, str) else f'"{value}"'
            text += f"{key} = {rendered}\n"
    return text


def start_shared(config: str, group: Group, *args: str) -> DaemonProcess:
    """A daemon whose socket the members of ``group`` may reach (the harness's
    work directory is root's 0700: opened to traversal)."""
    daemon = start_daemon("--socket-group", group.name, *args, config=config)
    os.chmod(daemon.workdir, 0o711)
    return daemon
