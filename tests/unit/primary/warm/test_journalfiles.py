"""The warm-restart journal's files in a directory others may write
(kvtierd.primary.warm.journalfiles), on real files: only this uid's files are removed, what
another user left at the journal's name is described (never followed, never
touched), and temporary files get a new name each time. Files "of another user"
are made by chown (root); tests/integration/primary/warm/test_planted_journal_attacks.py plants
them as a real other user against a real non-root daemon."""

from __future__ import annotations

import os
import stat

import pytest

from kvtierd.primary.warm.journalfiles import open_temporary, planted, remove_journal

NOBODY = 65534


@pytest.fixture
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: makes files owned by another uid")


def make(path, owner: int | None = None) -> str:
    with open(path, "wb") as file:
        file.write(b"x")
    if owner is not None:
        os.chown(path, owner, owner)
    return str(path)


def test_temporary_files_get_a_new_private_name_each_time(tmp_path):
    journal = str(tmp_path / "p.journal")
    make(journal + ".tmp")  # a fixed name taken: irrelevant
    first_fd, first = open_temporary(journal)
    second_fd, second = open_temporary(journal)
    try:
        assert first != second and first.startswith(journal + ".tmp-")
        assert stat.S_IMODE(os.fstat(first_fd).st_mode) == 0o600
    finally:
        os.close(first_fd)
        os.close(second_fd)


def test_remove_journal_removes_this_uids_files_only(tmp_path, as_root):
    journal = str(tmp_path / "p.journal")
    make(journal)
    own = [make(journal + ".tmp"), make(journal + ".tmp-0123456789abcdef")]
    theirs = make(journal + ".tmp-fedcba9876543210", owner=NOBODY)
    unrelated = make(tmp_path / "q.journal.tmp-0000000000000000")
    assert remove_journal(journal) is None
    assert not os.path.exists(journal) and not any(os.path.exists(p) for p in own)
    assert os.path.exists(theirs) and os.path.exists(unrelated)


def test_a_journal_name_taken_by_another_user_is_described_and_left_alone(tmp_path, as_root):
    journal = str(tmp_path / "p.journal")
    assert planted(journal) is None  # nothing there
    make(journal, owner=NOBODY)
    found = remove_journal(journal)
    assert found is not None and f"uid {NOBODY}" in found and "a regular file" in found
    assert "remove it, or give memory.shm_dir a directory only kvtierd can write" in found
    assert os.stat(journal).st_uid == NOBODY
    os.unlink(journal)
    os.symlink("/etc/shadow", journal)
    found = planted(journal)
    assert found is not None and "a symlink to '/etc/shadow'" in found
    assert os.path.islink(journal)
