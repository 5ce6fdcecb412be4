"""Which directories the daemon agrees to write in (``security.trusted_dirs``)
and the modes it tightens (``tiers.fs.permissions``): real directories, real
owners (chown needs root; those tests skip otherwise)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvtierd.security.trusted_dirs import UntrustedPath, require_own_entry, require_trusted_dir
from kvtierd.tiers.fs import permissions

FOREIGN_UID = 64321  # no such user needed: chown takes any number
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def test_own_private_directory_is_trusted(tmp_path: Path):
    require_trusted_dir(str(tmp_path))


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_writable_by_others_without_sticky_bit_is_refused(tmp_path: Path, mode: int):
    tmp_path.chmod(mode)
    with pytest.raises(UntrustedPath, match="writable by other users") as refused:
        require_trusted_dir(str(tmp_path))
    assert str(tmp_path) in str(refused.value) and "chmod go-w" in str(refused.value)


def test_writable_by_others_with_sticky_bit_is_trusted(tmp_path: Path):
    tmp_path.chmod(0o1777)
    require_trusted_dir(str(tmp_path))


@needs_root
def test_a_directory_above_owned_by_another_user_is_refused(tmp_path: Path):
    inner = tmp_path / "a" / "root"
    inner.mkdir(parents=True)
    os.chown(tmp_path / "a", FOREIGN_UID, -1)  # could rename "root" away and plant another
    with pytest.raises(UntrustedPath, match="owned by another user") as refused:
        require_trusted_dir(str(inner))
    assert f"uid {FOREIGN_UID}" in str(refused.value) and str(tmp_path / "a") in str(refused.value)


def test_a_symlinked_path_is_judged_where_it_leads(tmp_path: Path):
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    require_trusted_dir(str(link))  # the operator's own symlink: fine
    target.chmod(0o777)
    with pytest.raises(UntrustedPath, match="writable by other users"):
        require_trusted_dir(str(link))


def test_an_entry_the_daemon_creates_may_not_be_a_symlink(tmp_path: Path):
    link = tmp_path / "pool"
    link.symlink_to(tmp_path)
    with pytest.raises(UntrustedPath, match="symlink"):
        require_own_entry(str(link), os.lstat(link))


def test_check_root_tightens_its_pool_directories_and_refuses_a_symlink(tmp_path: Path):
    pool_dir = tmp_path / "pool-0123456789abcdef"
    pool_dir.mkdir()
    pool_dir.chmod(0o757)
    assert permissions.check_root(str(tmp_path)) == 1
    assert stat.S_IMODE(pool_dir.stat().st_mode) == 0o750
    (tmp_path / "planted").symlink_to(pool_dir)
    with pytest.raises(UntrustedPath, match="symlink"):
        permissions.check_root(str(tmp_path))


@needs_root
def test_check_root_refuses_a_pool_directory_of_another_user(tmp_path: Path):
    pool_dir = tmp_path / "pool-0123456789abcdef"
    pool_dir.mkdir()
    os.chown(pool_dir, FOREIGN_UID, -1)
    with pytest.raises(UntrustedPath, match="created by another user"):
        permissions.check_root(str(tmp_path))
