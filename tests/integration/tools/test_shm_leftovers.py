"""The end-of-session check that a test run left nothing in /dev/shm
(``tests/shm_leftovers.py``), and the removal of what a killed vLLM server's process
group leaves there (``benchmarks/devshm.py``, ``benchmarks/vllm_http.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

from daemon_harness import REPO, eventually
from shm_leftovers import ShmLeftovers, shm_tempdir

from benchmarks import devshm
from benchmarks.vllm_http import group_members, stop_server_group

SHM = Path(devshm.SHM)


def run_pytest(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """A pytest session of its own over one test ``body``, with the check."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "shm_leftovers", "-p", "no:cacheprovider",
         str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip


def test_a_run_that_leaves_a_file_in_dev_shm_fails_naming_it(tmp_path):
    name = f"kvtierd-leak-{uuid.uuid4().hex[:8]}"
    try:
        result = run_pytest(
            tmp_path,
            f"""
            def test_leaves_one():
                open("/dev/shm/{name}", "w").close()
        """,
        )
        assert result.returncode == 1, result.stdout + result.stderr
        assert "1 passed" in result.stdout
        assert "files left in /dev/shm" in result.stdout
        assert (
            "this test run left 1 entry in /dev/shm that was not there at its start: "
            f"/dev/shm/{name}; find the test or harness that made them"
        ) in result.stdout.replace("\n", " ")
    finally:
        (SHM / name).unlink(missing_ok=True)


def test_a_run_that_removes_what_it_made_passes(tmp_path):
    result = run_pytest(
        tmp_path,
        """
        import os
        from shm_leftovers import shm_tempdir

        def test_cleans_up():
            os.rmdir(shm_tempdir())
    """,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "files left" not in result.stdout


def test_what_counts_as_this_runs(tmp_path):
    """In a directory (here one of tmp_path, as /dev/shm): what was there before, a
    directory of another live run and an entry a live process holds are not this
    run's; this run's tagged directory, one of a run that has ended and an entry
    nobody holds are."""
    (tmp_path / "before").touch()
    check = ShmLeftovers(str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    names = {
        "mine": f"kvtierd-test-{os.getpid()}-abcd1234",
        "live": "kvtierd-test-1-abcd1234",  # pid 1 lives as long as the machine
        "ended": f"kvtierd-test-{int(ended.stdout)}-abcd1234",
        "loose": "psm_0123abcd",
        "held": "sem.mp-held",
    }
    for name in names.values():
        (tmp_path / name).touch()
    with open(tmp_path / names["held"]):  # held by this live process
        found = check.found()
    assert found == sorted(names[k] for k in ("mine", "ended", "loose"))


def test_shm_tempdir_is_named_after_this_process():
    made = shm_tempdir("kvtierd-test-")
    try:
        assert os.path.basename(made).startswith(f"kvtierd-test-{os.getpid()}-")
        assert ShmLeftovers(devshm.SHM).found() == []  # made before: not new
    finally:
        os.rmdir(made)


def test_only_unheld_multiprocessing_segments_are_removed():
    before = devshm.entries()
    kept = shared_memory.SharedMemory(create=True, size=4096)  # mapped here: held
    dropped = shared_memory.SharedMemory(create=True, size=4096)
    dropped.close()  # unmapped, not unlinked: a killed process's leftover
    try:
        assert devshm.remove_unheld_multiprocessing(before) == [dropped.name]
        assert not (SHM / dropped.name).exists() and (SHM / kept.name).exists()
    finally:
        resource_tracker.unregister(f"/{dropped.name}", "shared_memory")  # gone already
        kept.close()
        kept.unlink()


# A server's group as vLLM's OpenAI server makes one: a leader whose child holds a
# multiprocessing segment and semaphore (its resource tracker, a third process, would
# unlink them once the child exits) and a kvtierd lease beacon, and outlives the
# leader's SIGTERM.
GROUP = """
import multiprocessing, signal, sys, time
from multiprocessing import shared_memory

def child(ready):
    from kvtierd_client.lease_beacon import LeaseBeacon

    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    lock = multiprocessing.Lock()
    beacon = LeaseBeacon()  # a session's lease proof, as vLLM's scheduler publishes
    ready.set()
    signal.pause()

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    ctx.Process(target=child, args=(ready,)).start()
    ready.wait(60)
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the child is left running
    signal.pause()
"""


def test_a_killed_server_group_leaves_no_shared_memory(tmp_path):
    script = tmp_path / "group.py"
    script.write_text(GROUP)
    before = devshm.entries()
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        made = sorted(n for n in devshm.entries() - before if n.startswith(("psm_", "sem.mp-")))
        assert {n[:4] for n in made} == {"psm_", "sem."}, made  # Event, Process: more sems
        # the grace is a window in which the child must *not* exit: it never would
        removed = stop_server_group(proc, before, grace=1.0)
        assert group_members(proc.pid) == []
        # the segment and the child's lock were the killed tracker's to unlink
        assert set(removed) <= set(made) and {n[:4] for n in removed} == {"psm_", "sem."}
        assert not [n for n in devshm.entries() - before if n.startswith("kvtierd-lease-")]
        assert not [n for n in devshm.entries() - before if n.startswith(("psm_", "sem.mp-"))]
    finally:  # after a failure: the group killed, what it held removed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        eventually(lambda: not group_members(proc.pid), 30, "the killed group gone")
        devshm.remove_unheld_multiprocessing(before)
