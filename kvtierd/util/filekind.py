"""The type of a file in words, for messages about files found where another
kind was expected (a FIFO planted at a region path, a directory where a block
file or a socket belongs)."""

from __future__ import annotations

import os
import stat

REGULAR = "regular file"
DIRECTORY = "directory"

_KINDS = (
    (stat.S_ISREG, REGULAR),
    (stat.S_ISDIR, DIRECTORY),
    (stat.S_ISLNK, "symlink"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def kind_of(mode: int) -> str:
    """The file type of ``st_mode`` in words ("FIFO", "symlink", "directory", ...)."""
    return next((name for test, name in _KINDS if test(mode)), f"file of type {mode:o}")


def describe(path: str, mode: int) -> str:
    """``a FIFO``, ``a regular file``, ``a symlink to '/x'``... (``path``: to read a
    link's target; never followed)."""
    kind = kind_of(mode)
    article = "an" if kind[0] in "aeiou" else "a"
    if stat.S_ISLNK(mode):
        try:
            return f"a symlink to {os.readlink(path)!r}"
        except OSError:
            pass
    return f"{article} {kind}"
