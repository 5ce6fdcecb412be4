"""A local user impersonating the daemon through its socket directory (docs/security.md,
"Who can be the daemon"): real users, a real attacker daemon, the real client library
run as the victim.

The attacker serves a real kvtierd of their own at a name the victim's engine uses (a
directory in /tmp the guides once named, or the default ``/tmp/kvtierd-<uid>``), with a
block planted at a key the victim will look up. Before the defence the victim's engine
mapped the attacker's region file, stored its prompt there and loaded the planted bytes
as a HIT. Now nothing is sent to the attacker's daemon, nothing is mapped, and the
victim's own daemon refuses to serve in a directory the attacker may write.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, ctl, start_daemon
from nonroot import as_user_prefix, require_nonroot_daemon
from shm_leftovers import shm_tempdir
from users_harness import Group, ThrowawayAccounts, User

from kvtierd_client.client import Client
from kvtierd_client.errors import UntrustedAddress

VICTIM_ENGINE = Path(__file__).resolve().parents[2] / "victim_engine.py"
POOL = "vllm/llama"
BLOCK = 4096
PLANTED = b"planted-prefix"
ATTACKER_BYTE = 0xEE


def _attacker_dir(attacker: User, path: str, mode: int) -> str:
    """``mkdir -m MODE path`` as the attacker would (owned by them)."""
    os.mkdir(path)
    os.chown(path, attacker.uid, attacker.gid)
    os.chmod(path, mode)
    return path


def _two_users(accounts: ThrowawayAccounts) -> tuple[User, User, Group]:
    """An attacker and a victim who share a group, as every user of a host shares
    ``users``: the attacker's daemon gives its sockets and regions to that group, so
    the victim's engine can reach them (as it could a fake daemon's 0666 socket)."""
    shared = accounts.group()
    return accounts.user(shared), accounts.user(shared), shared


def _attacker_daemon(attacker: User, socket_path: str, group: Group) -> DaemonProcess:
    """A real kvtierd run by the attacker, also serving at ``socket_path`` for the
    members of ``group``, with a block of the attacker's bytes planted at ``PLANTED``."""
    require_nonroot_daemon()
    shm_dir = shm_tempdir()
    os.chown(shm_dir, attacker.uid, attacker.gid)
    daemon = start_daemon(
        "--listen", "unix://" + socket_path, "--socket-group", group.name,
        shm_dir=shm_dir, command_prefix=as_user_prefix(attacker),
        owner=(attacker.uid, attacker.gid),
    )  # fmt: skip
    # the region descriptor and lane sockets live beside the first listen path, the
    # harness's work directory: the attacker opens it to the victim
    os.chmod(daemon.workdir, 0o711)
    try:
        _plant(daemon, attacker)
    except BaseException:
        daemon.cleanup()
        raise
    return daemon


def _plant(daemon: DaemonProcess, attacker: User) -> None:
    from kvtierd_client.region import attach_announced

    with (
        Client(daemon.address, daemon_user=attacker.uid) as client,
        client.open_session(POOL, block_bytes=BLOCK) as session,
    ):
        region = attach_announced(
            session.region, session_id=session.session_id, daemon_uid=session.daemon_uid
        )
        grant = session.prepare_store([PLANTED])
        assert grant is not None
        region.numpy()[grant.block_ids] = ATTACKER_BYTE
        session.complete_store(grant.keys_to_store)
        region.close()


def _victim_engine(victim: User, address: str, **env: str) -> dict[str, object]:
    spec = {
        "uid": victim.uid, "gid": victim.gid, "groups": list(victim.groups),
        "address": address, "pool": POOL,
        "block_bytes": BLOCK, "own_key": "victim-prompt", "planted_key": PLANTED.decode(),
        "env": {"KVTIERD_ADDRESS": "", "XDG_RUNTIME_DIR": "", **env},
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(VICTIM_ENGINE), json.dumps(spec)],
        capture_output=True, text=True, timeout=120, cwd="/", check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] == victim.uid
    return report


def _victim_key_reached(daemon: DaemonProcess, attacker: User) -> bool:
    """Whether the victim's prompt block reached the attacker's daemon."""
    with (
        Client(daemon.address, daemon_user=attacker.uid) as client,
        client.open_session(POOL, block_bytes=BLOCK) as session,
    ):
        return session.lookup([b"victim-prompt"])[0].name != "MISS"


def _assert_refused_untouched(report: dict[str, object], attacker: User) -> None:
    assert report.get("error") == "UntrustedAddress", report
    assert report["mapped"] is False and "loaded" not in report, report
    assert f"uid {attacker.uid}" in str(report["details"]), report
    assert "KVTIERD_DAEMON_USER" in str(report["details"]), report


def test_an_engine_never_talks_to_a_daemon_another_user_serves_in_a_shared_tmp_directory(
    accounts,
):
    """The guide's fixed /tmp directory, made first by the attacker, served by the
    attacker's daemon: the victim's engine refuses before OpenSession (nothing mapped,
    its prompt never stored there, the planted bytes never loaded)."""
    attacker, victim, shared = _two_users(accounts)
    directory = _attacker_dir(attacker, f"/tmp/kvtierd-vllm-{secrets.token_hex(3)}", 0o755)
    socket_path = os.path.join(directory, "kvtierd.sock")
    impostor = _attacker_daemon(attacker, socket_path, shared)
    try:
        report = _victim_engine(victim, "unix://" + socket_path)
        _assert_refused_untouched(report, attacker)
        assert directory in str(report["details"])
        assert not _victim_key_reached(impostor, attacker)
    finally:
        impostor.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


def test_an_engine_with_the_default_address_refuses_a_default_directory_another_user_made(
    accounts,
):
    """``/tmp/kvtierd-<victim uid>`` made by the attacker (no $XDG_RUNTIME_DIR): the
    victim's engine with the default address refuses it."""
    attacker, victim, shared = _two_users(accounts)
    directory = _attacker_dir(attacker, f"/tmp/kvtierd-{victim.uid}", 0o755)
    impostor = _attacker_daemon(attacker, os.path.join(directory, "kvtierd.sock"), shared)
    try:
        report = _victim_engine(victim, "")
        _assert_refused_untouched(report, attacker)
        assert not _victim_key_reached(impostor, attacker)
    finally:
        impostor.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


def test_trusting_the_daemons_user_by_name_reaches_its_daemon_in_a_sticky_directory(
    accounts,
):
    """The same layout is fine once the victim says who runs its daemon
    (``$KVTIERD_DAEMON_USER``): the engine maps that daemon's region and loads what
    is there, which is the point: trust is the operator's statement, not a guess."""
    daemon_user, engine_user, shared = _two_users(accounts)
    directory = _attacker_dir(daemon_user, f"/tmp/kvtierd-shared-{secrets.token_hex(3)}", 0o755)
    socket_path = os.path.join(directory, "kvtierd.sock")
    daemon = _attacker_daemon(daemon_user, socket_path, shared)
    try:
        report = _victim_engine(
            engine_user, "unix://" + socket_path, KVTIERD_DAEMON_USER=daemon_user.name
        )
        assert "error" not in report, report
        assert report["mapped"] and report["daemon_uid"] == daemon_user.uid
        assert report["planted_lookup"] == "HIT"
        assert report["loaded"] == bytes([ATTACKER_BYTE] * 8).hex()
    finally:
        daemon.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


def test_the_daemon_refuses_a_socket_directory_another_user_may_write(accounts):
    """``mkdir -m 0777`` by the attacker before the victim's daemon starts with that
    listen path: the start is refused (exit code 2) with one line naming the
    directory, its owner and what to do; no socket is made there."""
    attacker = accounts.user()
    directory = _attacker_dir(attacker, f"/tmp/kvtierd-vllm-{secrets.token_hex(3)}", 0o777)
    daemon = start_daemon("--listen", f"unix://{directory}/kvtierd.sock", wait=False)
    try:
        assert daemon.proc.wait(timeout=60) == 2, daemon.log()
        log = daemon.log()
        assert f"cannot listen in {directory}" in log, log
        assert f"uid {attacker.uid}" in log and "server.listen" in log, log
        assert "Traceback" not in log
        assert os.listdir(directory) == []
    finally:
        daemon.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


def test_the_daemon_refuses_a_socket_another_user_left_in_a_sticky_directory(accounts):
    """In a sticky directory the daemon serves only its own socket: one another user
    bound at the listen path first is neither removed nor served over (exit code 2)."""
    attacker = accounts.user()
    directory = tempfile.mkdtemp(prefix="kvt-sticky-", dir="/tmp")
    os.chmod(directory, 0o1777)
    planted = os.path.join(directory, "kvtierd.sock")
    code = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.close()"
    subprocess.run(
        ["setpriv", f"--reuid={attacker.uid}", f"--regid={attacker.gid}", "--clear-groups",
         "/usr/bin/python3", "-c", code, planted],
        check=True, timeout=30,
    )  # fmt: skip
    daemon = start_daemon("--listen", "unix://" + planted, wait=False)
    try:
        assert daemon.proc.wait(timeout=60) == 2, daemon.log()
        assert f"is a socket of {attacker.name} (uid {attacker.uid})" in daemon.log()
        assert os.stat(planted).st_uid == attacker.uid
    finally:
        daemon.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


def test_kvtierctl_refuses_an_impostor_at_its_address(accounts):
    """kvtierctl checks its address as the client library does: an impostor's socket
    gets no call (exit code 1, one line naming why)."""
    attacker, _, shared = _two_users(accounts)
    directory = _attacker_dir(attacker, f"/tmp/kvtierd-ctl-{secrets.token_hex(3)}", 0o755)
    socket_path = os.path.join(directory, "kvtierd.sock")
    impostor = _attacker_daemon(attacker, socket_path, shared)
    try:
        done = ctl("unix://" + socket_path, "status")
        assert done.returncode == 1, done
        assert "PERMISSION_DENIED" in done.stderr and directory in done.stderr, done.stderr
        assert done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    finally:
        impostor.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


def test_an_untrusted_address_is_refused_before_a_call_reaches_it(tmp_path):
    """The refusal is the client's own: ``UntrustedAddress`` (a ``PermissionDenied``)
    from ``open_session``, raised before any byte is written to the socket."""
    if os.geteuid() != 0:
        pytest.skip("needs root: chowns a directory to another uid")
    directory = tempfile.mkdtemp(prefix="kvt-untrusted-", dir="/tmp")
    try:
        os.chown(directory, 65534, 65534)  # nobody's, in sticky /tmp
        import socket

        path = os.path.join(directory, "kvtierd.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        os.chown(path, 65534, 65534)
        listener.listen(1)
        listener.settimeout(0.2)
        with Client("unix://" + path) as client, pytest.raises(UntrustedAddress) as caught:
            client.open_session(POOL, block_bytes=BLOCK)
        assert "uid 65534" in caught.value.details
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
        listener.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
