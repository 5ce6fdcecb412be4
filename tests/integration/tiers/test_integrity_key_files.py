"""A tier's integrity key file that cannot be trusted stops the daemon at start: exit
code 2 and one line naming the option (``tiers[N].integrity_key_file`` or
``...integrity_verify_key_file``) and what to fix, never a traceback, for both tier
types that take keys. A daemon with a good key file logs the key's id (what every
daemon of a fleet should show alike).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_harness import refused_start, start_daemon
from nonroot import as_user_prefix, require_nonroot_daemon
from users_harness import ThrowawayAccounts

from kvtierd.tiers.integrity import KEY_BYTES, key_id_of

TIERS = {
    "fs": "[[tiers]]\ntype = 'fs'\nroot = '{root}'\n",
    "redis": "[[tiers]]\ntype = 'redis'\nurls = ['redis://127.0.0.1:1']\n",
}


def _config(tmp_path: Path, tier: str, **keys: Path) -> Path:
    root = tmp_path / "fs"
    root.mkdir(exist_ok=True)
    text = TIERS[tier].format(root=root)
    text += "".join(f"{option} = '{path}'\n" for option, path in keys.items())
    path = tmp_path / "kvtierd.toml"
    path.write_text(text)
    path.chmod(0o644)
    return path


def _key(path: Path, data: bytes | None = None, mode: int = 0o600) -> Path:
    path.write_bytes(os.urandom(KEY_BYTES) if data is None else data)
    path.chmod(mode)
    return path


BAD_KEY_FILES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("world-readable", lambda d: _key(d / "k", mode=0o644),
     "is open to others (mode 0644): chmod 600 {path}"),
    ("group-readable", lambda d: _key(d / "k", mode=0o640), "is open to others (mode 0640)"),
    ("too short", lambda d: _key(d / "k", os.urandom(16)),
     "holds 16 bytes, expected exactly 32 random bytes (make one with: head -c 32 /dev/urandom"),
    ("too long", lambda d: _key(d / "k", os.urandom(64)), "holds 64 bytes, expected exactly 32"),
    ("hex text", lambda d: _key(d / "k", os.urandom(32).hex().encode()),
     "holds 64 bytes, expected exactly 32"),
    ("missing", lambda d: d / "absent", "cannot read key file {path}: No such file or directory"),
    ("a directory", lambda d: d, "is not a regular file"),
]  # fmt: skip


@pytest.mark.parametrize("tier", sorted(TIERS))
@pytest.mark.parametrize(
    ("make", "words"), [case[1:] for case in BAD_KEY_FILES], ids=[case[0] for case in BAD_KEY_FILES]
)
def test_a_key_file_that_cannot_be_trusted_stops_the_start_naming_the_option(
    tmp_path: Path, tier: str, make: Callable[[Path], Path], words: str
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    path = make(keys)
    line = refused_start(_config(tmp_path, tier, integrity_key_file=path), tmp_path)
    assert f"tiers[0].integrity_key_file: key file {path}" in line or (
        f"tiers[0].integrity_key_file: cannot read key file {path}" in line
    ), line
    assert words.format(path=path) in line, line


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_loose_verify_key_is_refused_as_its_own_option(tmp_path: Path, tier: str) -> None:
    sealing, old = _key(tmp_path / "new.key"), _key(tmp_path / "old.key", mode=0o604)
    config = _config(tmp_path, tier, integrity_key_file=sealing, integrity_verify_key_file=old)
    line = refused_start(config, tmp_path)
    assert f"tiers[0].integrity_verify_key_file: key file {old} is open to others" in line, line


def test_a_key_file_the_daemons_user_cannot_read_stops_the_start(
    tmp_path: Path, accounts: ThrowawayAccounts
) -> None:
    """The daemon as an unprivileged user (as shipped), the key file root's own 0600:
    unreadable for it, said in one line naming the option."""
    require_nonroot_daemon()
    user = accounts.user()
    work = Path(tempfile.mkdtemp(prefix="kvt-keys-", dir="/tmp"))  # pytest's tmp is root's 0700
    try:
        key = _key(work / "root-only.key")
        config = _config(work, "redis", integrity_key_file=key)
        os.chown(work, user.uid, user.gid)  # its socket goes there
        line = refused_start(config, work, as_user_prefix(user))
    finally:
        shutil.rmtree(work)
    assert f"tiers[0].integrity_key_file: cannot read key file {key}: Permission denied" in line


def test_a_good_key_file_starts_the_tier_and_logs_its_key_id(tmp_path: Path) -> None:
    sealing, old = _key(tmp_path / "new.key"), _key(tmp_path / "old.key", mode=0o400)
    config = _config(tmp_path, "fs", integrity_key_file=sealing, integrity_verify_key_file=old)
    daemon = start_daemon("--memory-budget", "64MiB", config=config.read_text())
    try:
        new_id, old_id = key_id_of(sealing.read_bytes()).hex(), key_id_of(old.read_bytes()).hex()
        assert f"values sealed with integrity key {new_id}, verifying {old_id} too" in daemon.log()
        assert sealing.read_bytes().hex() not in daemon.log()
    finally:
        daemon.stop()
        daemon.cleanup()
