"""The test suites leave nothing in ``/dev/shm``: the check every session ends with
(this module's hooks, which ``tests/conftest.py`` takes, so ``tests/vllm``,
``tests/sglang`` and ``tests/deploy`` end with it too; ``-p shm_leftovers`` adds it to
another run), and the directories tests make there.

A session fails when ``/dev/shm`` holds an entry at its end that was not there at
its start and that is this run's: a shm directory of a daemon (``kvtierd-test-*``,
a default ``kvtierd`` / ``kvtierd-<uid>``), a region, Python multiprocessing's
``psm_*`` segments and ``sem.mp-*`` semaphores (vLLM's, when its server's process
group is killed: ~830 MB after ``make test-vllm``), anything else.

Other test runs may share the machine (and ``/dev/shm``): a directory made with
:func:`shm_tempdir` carries the pid of the process that made it, and one of another
live process is that run's, not this one's; any other new entry counts as this
run's unless a live process still holds it (maps or opens it, or something under
it), as a running test of another run does.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

import pytest

from benchmarks import devshm

# <prefix><pid>-<mkdtemp's 8 characters>
_TAGGED = re.compile(r"-(?P<pid>[0-9]+)-[a-z0-9_]{8}$")


def shm_tempdir(prefix: str = "kvtierd-test-") -> str:
    """A new directory in ``/dev/shm`` (0700) named after ``prefix`` and this
    process's pid, which tells the end-of-session check whose it is."""
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=devshm.SHM)


class ShmLeftovers:
    """``/dev/shm`` at a session's start, and what this run added to it since."""

    def __init__(self, directory: str = devshm.SHM) -> None:
        self.directory = directory
        self.before = devshm.entries(directory)

    def found(self) -> list[str]:
        """The entries this run left (sorted); [] when there are none."""
        new = sorted(devshm.entries(self.directory) - self.before)
        mine = [name for name in new if not _another_live_run(name)]
        tagged = {name for name in mine if _tag(name) == os.getpid()}
        untagged = [os.path.join(self.directory, name) for name in mine if name not in tagged]
        holding = devshm.held(untagged)
        return sorted(tagged | {os.path.basename(p) for p in untagged if p not in holding})

    def report(self, names: list[str]) -> str:
        listed = ", ".join(f"{self.directory}/{name}" for name in names)
        return (
            f"this test run left {len(names)} {'entry' if len(names) == 1 else 'entries'} in "
            f"{self.directory} that {'was' if len(names) == 1 else 'were'} not there at its "
            f"start: {listed}; find the test or harness that made them and remove them there "
            "(tests/shm_leftovers.py)"
        )


def _tag(name: str) -> int | None:
    match = _TAGGED.search(name)
    return int(match["pid"]) if match else None


def _another_live_run(name: str) -> bool:
    pid = _tag(name)
    return pid is not None and pid != os.getpid() and os.path.exists(f"/proc/{pid}")


_SHM = pytest.StashKey[ShmLeftovers]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_SHM] = ShmLeftovers()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run (exit status 1, a section naming every entry) when it left
    something in /dev/shm."""
    leftovers = session.stash.get(_SHM, None)
    left = leftovers.found() if leftovers is not None else []
    if not left:
        return
    assert leftovers is not None
    message = leftovers.report(left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "files left in /dev/shm", red=True)
        reporter.write_line(message)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
