"""The children tests start from their own process are never fork()ed (spawn_harness).

gRPC's fork handler kills a fork()ed child only now and then (a race with the
child's ``close_fds``). These tests make that certain instead: a fresh interpreter
registers a fork handler that aborts every fork()ed child, then runs the code
under test there. A child started with ``preexec_fn`` or ``user=`` dies of it;
one started through spawn_harness (``vfork``/``posix_spawn``: no fork handlers)
runs. Real children, real ``kvtierctl``, real ``setpriv``.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]

_ABORT_FORKED_CHILDREN = """\
import ctypes, sys
sys.path.insert(0, sys.argv[1])
libc = ctypes.CDLL(None)
libc.__register_atfork.argtypes = [ctypes.c_void_p] * 4
# the child handler of every later fork(): abort, as gRPC's poller may in such a child
assert libc.__register_atfork(None, None, ctypes.cast(libc.abort, ctypes.c_void_p), None) == 0
"""


def where_forked_children_die(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter (tests/ on its path) in which every
    fork()ed child aborts before it can exec."""
    if not hasattr(ctypes.CDLL(None), "__register_atfork"):
        pytest.skip("needs glibc's __register_atfork to add a fork handler")
    return subprocess.run(
        [sys.executable, "-c", _ABORT_FORKED_CHILDREN + textwrap.dedent(code), str(TESTS),
         *args],
        capture_output=True, text=True, timeout=120, cwd=TESTS.parent,
    )  # fmt: skip


def test_a_child_started_with_preexec_fn_or_user_dies_there():
    """The setup bites: what the harness must never do is killed."""
    done = where_forked_children_die("""
        import os, subprocess
        forked = subprocess.run(["/bin/true"], preexec_fn=lambda: None)
        as_root = subprocess.run(["/bin/true"], user=os.getuid())
        spawned = subprocess.run(["/bin/true"])
        print(forked.returncode, as_root.returncode, spawned.returncode)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(-signal.SIGABRT), str(-signal.SIGABRT), "0"]


def test_the_fsck_tests_run_kvtierctl_without_forking(tmp_path):
    """The fsck tests (one under an address-space limit) pass where a fork()ed
    kvtierctl would die: the flake where one ``fsck --remove`` printed nothing."""
    done = where_forked_children_die("""
        import sys, pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--basetemp", sys.argv[2],
                              "tests/integration/tiers/fs/test_fs_hostile_files.py",
                              "-k", "fsck"]))
    """, str(tmp_path / "inner"))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout[-3000:]


def test_code_runs_as_another_user_without_forking(other_user):
    """``LocalUser.run_python`` and ``as_user`` change identity in the child
    (setpriv), not through a fork()ed ``subprocess`` child."""
    done = where_forked_children_die("""
        import subprocess, sys
        from local_users import LocalUser
        from spawn_harness import as_user
        uid, gid = int(sys.argv[2]), int(sys.argv[3])
        ran = LocalUser("them", uid, gid).run_python(
            "import os; print(os.getuid(), os.getgid(), os.getgroups())")
        held = subprocess.run(as_user(["/usr/bin/id", "-u"], uid, gid),
                              capture_output=True, text=True)
        print(ran.returncode, ran.stdout.strip(), repr(ran.stderr), held.stdout.strip())
    """, str(other_user.uid), str(other_user.gid))  # fmt: skip
    assert done.returncode == 0, done.stderr
    uid, gid = str(other_user.uid), str(other_user.gid)
    assert done.stdout.split() == ["0", uid, gid, "[]", "''", uid], done.stdout
