"""``kvtierctl``: the operator's command line (also reachable as ``kvtierd <command>``).

Exit codes: 0 success (fsck: every block verified), 1 a problem was found or
the daemon answered with an error (one readable line on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2


class Progress:
    """A one-line progress display on a terminal, a log line every few seconds otherwise."""

    def __init__(self, what: str, stream: TextIO = sys.stderr, every: float = 2.0) -> None:
        self._what = what
        self._stream = stream
        self._tty = stream.isatty()
        self._every = 0.1 if self._tty else every
        self._last = 0.0
        self._start = time.monotonic()

    def update(self, count: int, detail: str = "") -> None:
        now = time.monotonic()
        if now - self._last < self._every:
            return
        self._last = now
        rate = count / max(now - self._start, 1e-9)
        line = f"{self._what}: {count} done ({rate:,.0f}/s) {detail}"
        if self._tty:
            width = 100
            self._stream.write("\r" + line[:width].ljust(width))
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def finish(self) -> None:
        if self._tty and self._last:
            self._stream.write("\n")
            self._stream.flush()


def cmd_fsck(args: argparse.Namespace) -> int:
    from kvtierd.tiers.fs import fsck

    root = args.root
    if not os.path.isdir(root):
        print(f"kvtierctl fsck: {root} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    progress = Progress(f"fsck {root}") if not args.quiet else None
    report = fsck(root, remove=args.remove, progress=progress.update if progress else None)
    if progress:
        progress.finish()
    for path, reason in report.bad:
        print(f"BAD {path}: {reason}")
    action = f", {report.removed} removed" if args.remove else ""
    print(
        f"{report.files_checked} block files in {report.pools} pools checked: "
        f"{len(report.bad)} bad{action}, {report.temp_files} temp files"
    )
    return EXIT_OK if report.clean else EXIT_PROBLEM


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"fsck": cmd_fsck}


def build_parser(prog: str = "kvtierctl") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Operate a kvtierd daemon.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fsck = commands.add_parser(
        "fsck",
        help="verify every block file of an fs tier root",
        description="Verifies every block file under ROOT completely (header, pool, key, "
        "length, payload checksum). Safe while a daemon uses the root. Exit code 1 if any "
        "file is bad.",
    )
    fsck.add_argument("root", metavar="ROOT", help="the fs tier's root directory")
    fsck.add_argument(
        "--remove",
        action="store_true",
        help="remove the bad files (a daemon treats them as misses)",
    )
    fsck.add_argument("--quiet", "-q", action="store_true", help="no progress display")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "kvtierctl") -> int:
    args = build_parser(prog).parse_args(argv)
    return COMMANDS[args.command](args)


def entry_point() -> None:
    raise SystemExit(main())
