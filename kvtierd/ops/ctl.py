"""``kvtierctl``: the operator's command line (also reachable as ``kvtierd <command>``).

Exit codes: 0 success (fsck: every block verified), 1 a problem was found or
the daemon answered with an error (one readable line on stderr), 2 bad usage,
141 stdout's reader closed the pipe (``| head``; nothing on stderr).

Every line it writes for a person goes through :func:`show` (table cells through
:func:`printable` first, so columns line up): what the server sent (pool, tier and
policy names, versions, explanations, error details) reaches the terminal with its
control characters escaped, never as escape sequences the terminal would act on.
``--json`` is escaped by JSON itself (``json.dumps`` writes ``\\u001b``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from kvtierd import __version__

if TYPE_CHECKING:
    from kvtierd_client.client import Client

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_PIPE = 128 + 13  # stdout's reader went away (SIGPIPE's status in the shell)


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun`` in agreement: "1 pool", "0 pools", "2 block files"
    (``noun`` is the singular; every noun kvtierctl counts takes an s)."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def printable(text: str) -> str:
    """``text`` with every character that is not printable (``str.isprintable``: C0
    and C1 controls, DEL, line breaks, bidi overrides and other format characters)
    written as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``). Printable text is
    left as it is, so escaping twice is escaping once."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def show(*lines: str, file: TextIO | None = None, flush: bool = False) -> None:
    """Writes each of ``lines`` (to stdout, or ``file``) with its non-printable
    characters escaped (:func:`printable`): the one way kvtierctl writes text that
    may hold what a server sent."""
    stream = sys.stdout if file is None else file
    for line in lines:
        stream.write(printable(line) + "\n")
    if flush:
        stream.flush()


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
    from kvtierd.tiers.fs.fsck import fsck

    root = args.root
    if not os.path.isdir(root):
        show(f"kvtierctl fsck: {root} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    progress = Progress(f"fsck {root}") if not args.quiet else None
    report = fsck(root, remove=args.remove, progress=progress.update if progress else None)
    if progress:
        progress.finish()
    for path, reason in report.bad:
        show(f"BAD {path}: {reason}")  # a planted file's name is anyone's text
    action = f", {report.removed} removed" if args.remove else ""
    show(
        f"{counted(report.files_checked, 'block file')} in {counted(report.pools, 'pool')} "
        "checked: "
        f"{len(report.bad)} bad{action}, {report.temp_files} temp files"
    )
    return EXIT_OK if report.clean else EXIT_PROBLEM


# ----------------------------------------------------------------- daemon commands


def daemon_address(args: argparse.Namespace) -> tuple[str, str]:
    """The address kvtierctl talks to and where it came from: ``--address``, else
    ``$KVTIERD_ADDRESS``, else the default socket (``kvtierd_client.wire.address``)."""
    from kvtierd_client.wire.address import ADDRESS_ENV, default_socket_path

    if args.address:
        return args.address, "--address"
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV], f"${ADDRESS_ENV}"
    return "unix://" + default_socket_path(), "the default socket"


def _client(args: argparse.Namespace) -> Client:
    """A client for the global flags; a bad address or TLS file is a usage error."""
    from kvtierd_client.client import Client
    from kvtierd_client.tls import TlsOptions

    try:
        tls = None
        if args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
            tls = TlsOptions.from_files(
                ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key,
                server_name=args.tls_server_name,
            )  # fmt: skip
        address, _ = daemon_address(args)
        client = Client(
            address, timeout=args.timeout, token=args.token, tls=tls, daemon_user=args.daemon_user
        )
    except (OSError, ValueError) as exc:
        show(f"kvtierctl: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    try:
        client.verify_daemon()  # a socket another user could have put there: not a word to it
    except BaseException:
        client.close()
        raise
    return client


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h{minutes:02d}m" if days else f"{hours}h{minutes:02d}m{secs:02d}s"


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.get_stats()
    address, source = daemon_address(args)
    origin = "" if source == "--address" else f" ({source})"
    show(
        f"kvtierd {stats.version} at {address}{origin}: up "
        f"{_duration(stats.uptime_seconds)}, {counted(stats.sessions, 'session')}, "
        f"{counted(len(stats.pools), 'pool')}, "
        f"memory {_human_bytes(stats.memory_used_bytes)} of "
        f"{_human_bytes(stats.memory_budget_bytes)}"
    )
    for pool in stats.pools:
        show(
            f"pool {pool.name}: {counted(pool.num_blocks, 'block')} x "
            f"{_human_bytes(pool.block_bytes)}, {pool.eviction_policy}, "
            f"{counted(pool.sessions, 'session')}, layout {pool.layout!r}"
        )
        for tier in pool.tiers:
            ready = "" if tier.tier == "primary" or tier.ready else " (index rebuilding)"
            show(
                f"  {tier.tier:<10} {tier.used_blocks}/{tier.capacity_blocks} blocks, "
                f"{_human_bytes(tier.used_bytes)} of {_human_bytes(tier.capacity_bytes)}{ready}"
            )
    return EXIT_OK


def _hit_percent(t: Any) -> str:
    answered = t.hits + t.misses
    return f"{100 * t.hits / answered:.1f}" if answered else "-"


# One column per GetStats field shown, nothing summed: the table, --json and the
# metrics endpoint tell the same numbers (docs/operations/kvtierctl.md).
STATS_COLUMNS: tuple[tuple[str, Callable[[Any, Any], str]], ...] = (
    ("pool", lambda p, t: p.name),
    ("tier", lambda p, t: t.tier),
    ("used", lambda p, t: str(t.used_blocks)),
    ("capacity", lambda p, t: str(t.capacity_blocks)),
    ("hits", lambda p, t: str(t.hits)),
    ("pending", lambda p, t: str(t.hits_pending) if t.tier == "primary" else "-"),
    ("misses", lambda p, t: str(t.misses)),
    ("retries", lambda p, t: str(t.retries)),
    ("hit%", lambda p, t: _hit_percent(t)),
    ("in", lambda p, t: _human_bytes(t.bytes_in)),
    ("out", lambda p, t: _human_bytes(t.bytes_out)),
    ("evictions", lambda p, t: str(t.evictions)),
    ("failures", lambda p, t: str(t.failures)),
    ("checksum", lambda p, t: str(t.checksum_failures)),
    ("integrity", lambda p, t: str(t.integrity_failures) if t.tier != "primary" else "-"),
    ("dropped", lambda p, t: str(t.dropped_blocks)),
    # the primary's warm-restart journal: how long its oldest completion not yet in
    # it has waited (a block completed longer ago survives a crash; PoolStats 13)
    ("lag", lambda p, t: _journal_lag(p) if t.tier == "primary" else "-"),
    # a shared fs root: files other daemons wrote that this one found, keys looked for on disk
    ("foreign", lambda p, t: str(t.foreign_files_found) if t.tier != "primary" else "-"),
    ("rechecks", lambda p, t: str(t.shared_rechecks) if t.tier != "primary" else "-"),
)


def _journal_lag(p: Any) -> str:
    return f"{p.journal_lag_seconds:.3f}s" if p.journal_bytes else "-"


# A remote (redis) tier's server, one row per pool and remote tier, under the table
# (GetStats TierStats 29-34, the metrics' kvtierd_remote_*).
REMOTE_COLUMNS: tuple[tuple[str, Callable[[Any, Any], str]], ...] = (
    ("pool", lambda p, t: p.name),
    ("remote tier", lambda p, t: t.tier),
    ("nodes up", lambda p, t: f"{t.nodes_reachable}/{t.nodes_known}"),
    ("round trip", lambda p, t: f"{t.round_trip_us} us" if t.round_trip_us else "-"),
    ("server used", lambda p, t: _human_bytes(t.server_used_bytes)),
    ("server capacity", lambda p, t: _server_capacity(t)),
    ("probe failures", lambda p, t: str(t.probe_failures)),
)


# Admission to the secondary tiers, one row per pool and tier whose admission is not
# "always" or that rejected blocks (GetStats TierStats 43-49, the metrics' kvtierd_tier_admitted_*,
# kvtierd_tier_rejected_*): what was written, what was not and why, and what a hit cost.
ADMISSION_COLUMNS: tuple[tuple[str, Callable[[Any, Any], str]], ...] = (
    ("pool", lambda p, t: p.name),
    ("tier", lambda p, t: t.tier),
    ("admission", lambda p, t: t.admission or "always"),
    ("admitted", lambda p, t: str(t.admitted_blocks)),
    ("not reused", lambda p, t: str(t.rejected_not_reused_blocks)),
    ("infrequent", lambda p, t: str(t.rejected_infrequent_blocks)),
    ("budget", lambda p, t: str(t.rejected_budget_blocks)),
    ("written/hit", lambda p, t: _written_per_hit(t)),
    ("sketch", lambda p, t: _sketch(t)),
)


def _rejected(t: Any) -> int:
    return int(
        t.rejected_not_reused_blocks + t.rejected_infrequent_blocks + t.rejected_budget_blocks
    )


def _sketch(t: Any) -> str:
    return _human_bytes(t.admission_sketch_bytes) if t.admission_sketch_bytes else "-"


def _written_per_hit(t: Any) -> str:
    """Bytes written into the tier per block it served (promoted): its write cost."""
    return _human_bytes(t.bytes_in // t.hits) if t.hits else "-"


def _admits_selectively(t: Any) -> bool:
    return t.tier != "primary" and (t.admission not in ("", "always") or _rejected(t) > 0)


def _server_capacity(t: Any) -> str:
    if t.server_capacity_bytes:
        return _human_bytes(t.server_capacity_bytes)
    return "unbounded" if t.nodes_reachable else "-"


def _is_remote(t: Any) -> bool:
    from kvtierd_client.wire.proto import pb2

    return bool(t.medium == pb2.MEDIUM_REMOTE)


def remote_line(t: Any) -> str:
    """One line about a remote tier's server (``kvtierctl explain``)."""
    if not t.nodes_known:
        return "server not reached yet"
    return (
        f"{t.nodes_reachable}/{t.nodes_known} nodes up, round trip "
        f"{t.round_trip_us} us, server {_human_bytes(t.server_used_bytes)} used of "
        f"{_server_capacity(t)}, {t.probe_failures} probe failures"
    )


WATCH_MIN_SECONDS = 0.1
WATCH_MAX_SECONDS = 86400.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen (VT100 / xterm)


def watch_seconds(text: str) -> float:
    """argparse type of ``stats --watch``: a refresh interval in seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not WATCH_MIN_SECONDS <= seconds <= WATCH_MAX_SECONDS:  # also NaN
        raise argparse.ArgumentTypeError(
            f"{text} is out of range; give {WATCH_MIN_SECONDS:g} to {WATCH_MAX_SECONDS:g} seconds"
        )
    return seconds


def stats_table(stats: Any) -> list[str]:
    """The lines of the ``kvtierctl stats`` table of a GetStats answer, then (when a
    pool has a remote tier) the table of the remote servers, then (when a tier admits
    selectively, or rejected blocks) the table of admission."""
    lines = _table(STATS_COLUMNS, [(p, t) for p in stats.pools for t in p.tiers])
    remote = [(p, t) for p in stats.pools for t in p.tiers if _is_remote(t)]
    if remote:
        lines += ["", *_table(REMOTE_COLUMNS, remote)]
    selective = [(p, t) for p in stats.pools for t in p.tiers if _admits_selectively(t)]
    if selective:
        lines += ["", *_table(ADMISSION_COLUMNS, selective)]
    return lines


def _table(
    columns: tuple[tuple[str, Callable[[Any, Any], str]], ...], tiers: list[tuple[Any, Any]]
) -> list[str]:
    rows = [[c[0] for c in columns]]
    rows += [[printable(c[1](p, t)) for c in columns] for p, t in tiers]  # widths as shown
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                  for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]  # fmt: skip


def cmd_stats(args: argparse.Namespace) -> int:
    if args.watch is not None:
        return watch_stats(args)
    with _client(args) as client:
        stats = client.get_stats(args.pool or "")
    if args.json:
        print(json.dumps(message_json(stats), indent=2))  # escaped by JSON (ensure_ascii)
        return EXIT_OK
    show(*stats_table(stats))
    return EXIT_OK


def message_json(message: Any) -> dict[str, Any]:
    """``message`` as JSON values for ``--json``: every field, zeros included (``jq
    .hits`` is 0, not null), under its proto name, and 64-bit integers as JSON
    numbers (protobuf's JSON mapping writes them as strings; Python's json reads
    big numbers exactly)."""
    from google.protobuf.json_format import MessageToDict

    data = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers_64(message.DESCRIPTOR, data)


def _numbers_64(descriptor: Any, data: dict[str, Any]) -> dict[str, Any]:
    from google.protobuf.descriptor import FieldDescriptor

    wide = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        repeated = isinstance(value, list)
        items = value if repeated else [value]
        if field.cpp_type in wide:
            items = [int(item) for item in items]
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            items = [_numbers_64(field.message_type, item) for item in items]
        data[field.name] = items if repeated else items[0]
    return data


def watch_stats(args: argparse.Namespace) -> int:
    """Redraws the stats table every ``args.watch`` seconds (the screen is cleared
    first on a terminal) until Ctrl-C, which exits 0 without a word.

    Ctrl-C (SIGINT) only sets a flag, read between two redraws: a KeyboardInterrupt
    raised inside a gRPC call in flight could leave the channel's lock taken, and
    closing the channel then hung (seen on a loaded machine)."""
    clear = CLEAR_SCREEN if sys.stdout.isatty() else ""
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: stop.set())
    try:
        with _client(args) as client:
            next_at = time.monotonic()
            while not stop.is_set():
                stats = client.get_stats(args.pool or "")
                if stop.is_set():
                    break
                header = (
                    f"kvtierd stats every {args.watch:g}s, {time.strftime('%H:%M:%S')} "
                    "(Ctrl-C exits)"
                )
                frame = "".join(printable(line) + "\n" for line in (header, *stats_table(stats)))
                sys.stdout.write(clear + frame)  # one write: a reader never sees half a frame
                sys.stdout.flush()
                next_at = max(next_at + args.watch, time.monotonic())
                stop.wait(max(0.0, next_at - time.monotonic()))
    finally:
        signal.signal(signal.SIGINT, previous)
    return EXIT_OK


def cmd_watch(args: argparse.Namespace) -> int:
    seen = 0
    with _client(args) as client:
        stream = client.watch_events(args.pool, args.after_seq, timeout=None)
        try:
            for event in stream:
                show(_event_line(event), flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    break
        except KeyboardInterrupt:
            pass
        finally:
            stream.cancel()
    return EXIT_OK


def _event_line(event: Any) -> str:
    from kvtierd_client.wire.proto import pb2

    what = "removed" if event.removed else "stored"
    medium = pb2.Medium.Name(event.medium).removeprefix("MEDIUM_").lower()
    keys = " ".join(key.hex() for key in event.keys[:4])
    more = f" (+{len(event.keys) - 4} more)" if len(event.keys) > 4 else ""
    tier = event.tier or "primary"
    return f"{event.seq} {what} {medium}/{tier} {len(event.keys)} keys: {keys}{more}"


def cmd_flush(args: argparse.Namespace) -> int:
    with _client(args) as client:
        evicted = client.flush_pool(args.pool)
    show(f"pool {args.pool}: {counted(evicted, 'block')} evicted from the primary tier "
          "(pinned and in-flight blocks stay; secondary tiers keep their copies)")  # fmt: skip
    return EXIT_OK


def _parse_key(args: argparse.Namespace) -> bytes:
    if args.hex:
        try:
            return bytes.fromhex(args.key)
        except ValueError:
            raise SystemExit(f"kvtierctl explain: {args.key!r} is not hex") from None
    key: str = args.key
    return key.encode()


def lookup_state(value: int) -> str:
    """The name of a lookup state a server sent: one this kvtierctl knows by name
    (HIT), else the wire's name with its number (a newer daemon's state, or the
    unset 0: ``LOOKUP_RESULT_UNSPECIFIED (0)``), else the number alone."""
    from kvtierd_client.wire.proto import pb2
    from kvtierd_client.wire.results import LookupResult

    try:
        return LookupResult(value).name
    except ValueError:
        pass
    try:
        return f"{pb2.LookupResult.Name(value)} ({value})"
    except ValueError:
        return f"unknown state {value}"


def cmd_explain(args: argparse.Namespace) -> int:
    key = _parse_key(args)
    with _client(args) as client:
        report = client.explain(args.pool, key)
        pools = client.get_stats(args.pool).pools
    remote = {t.tier: t for p in pools for t in p.tiers if _is_remote(t)}
    show(f"key {key.hex()} in pool {args.pool}: {report.summary}")
    show(f"  primary: {lookup_state(report.primary)} (ref count {report.ref_count})")
    for tier in report.tiers:
        state = ("present" if tier.present else "absent") if tier.known else "index rebuilding"
        server = f" ({remote_line(remote[tier.tier])})" if tier.tier in remote else ""
        show(f"  {tier.tier}: {state}{server}")
    for record in report.history:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.unix_time))
        show(f"  {when} {record.tier}: {record.what}")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": cmd_status,
    "stats": cmd_stats,
    "watch": cmd_watch,
    "flush": cmd_flush,
    "evict": cmd_flush,
    "explain": cmd_explain,
    "fsck": cmd_fsck,
}


def build_parser(prog: str = "kvtierctl") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Operate a kvtierd daemon.")
    parser.add_argument("--version", action="version", version=f"{prog} {__version__}")
    parser.add_argument(
        "--address",
        default=None,
        help="daemon address, unix:///path, HOST:PORT or tls://HOST:PORT (default: "
        f"{_default_address_text()})",
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for each answer (default 10)"
    )
    parser.add_argument(
        "--token", default=None, help="bearer token for TCP addresses (default: none)"
    )
    parser.add_argument(
        "--daemon-user", metavar="USER", default=None,
        help="user names or uids (comma-separated) trusted to run the daemon behind a Unix "
        "socket, besides root and you; also $KVTIERD_DAEMON_USER (default: none)",
    )  # fmt: skip
    _add_tls_flags(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("status", help="daemon, pools, tiers and usage in a few lines")
    stats = commands.add_parser("stats", help="per pool and tier counters as a table")
    stats.add_argument("--pool", help="only this pool (default: every pool)")
    shown = stats.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="the full GetStats answer as JSON")
    shown.add_argument(
        "--watch",
        type=watch_seconds,
        metavar="SECONDS",
        help="redraw the table every SECONDS (0.1 to 86400; the screen is cleared on a "
        "terminal) until Ctrl-C",
    )
    watch = commands.add_parser("watch", help="stream a pool's events (Ctrl-C stops)")
    watch.add_argument("pool", metavar="POOL", help="pool name")
    watch.add_argument(
        "--after-seq", type=int, default=-1, help="replay events after this seq (-1: only new)"
    )
    watch.add_argument("--count", type=int, default=0, help="stop after this many events")
    for name in ("flush", "evict"):
        flush = commands.add_parser(
            name, help="evict every ready, unpinned block of a pool from the primary tier"
        )
        flush.add_argument("pool", metavar="POOL", help="pool name")
    explain = commands.add_parser("explain", help="why a key is (not) served")
    explain.add_argument("pool", metavar="POOL", help="pool name")
    explain.add_argument("key", metavar="KEY", help="the key (text; hex with --hex)")
    explain.add_argument("--hex", action="store_true", help="KEY is hexadecimal")
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


def _default_address_text() -> str:
    from kvtierd_client.wire.address import ADDRESS_ENV, default_socket_path

    socket_address = f"unix://{default_socket_path()}"
    if os.environ.get(ADDRESS_ENV):
        text = f"${ADDRESS_ENV}, now {os.environ[ADDRESS_ENV]}; unset: {socket_address}"
    else:
        text = f"${ADDRESS_ENV} when set, else {socket_address}"
    return text.replace("%", "%%")  # argparse %-formats help


def _add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """TLS for a TCP address; any of these turns it on (as a tls://HOST:PORT address)."""
    tls = parser.add_argument_group("TLS (TCP addresses)")
    tls.add_argument(
        "--tls", action="store_true", help="connect with TLS, checking the daemon's certificate "
        "against the system's CAs (default for tls://HOST:PORT addresses)",
    )  # fmt: skip
    tls.add_argument(
        "--tls-ca", metavar="FILE", help="PEM CA certificates for the daemon's certificate"
    )
    tls.add_argument(
        "--tls-cert", metavar="FILE", help="PEM client certificate (mTLS; with --tls-key)"
    )
    tls.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    tls.add_argument(
        "--tls-server-name", metavar="NAME",
        help="name expected in the daemon's certificate (default: the address's host)",
    )  # fmt: skip


def main(argv: Sequence[str] | None = None, prog: str = "kvtierctl") -> int:
    from kvtierd_client.errors import KvtierError

    args = build_parser(prog).parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KvtierError as exc:  # one readable line; the status code name says what kind
        show(f"{prog} {args.command}: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    except BrokenPipeError:
        return reader_went_away()


def reader_went_away() -> int:
    """stdout's reader closed the pipe (``kvtierctl stats --json | head``): stop
    without a word, as a program SIGPIPE ends does; what is still buffered goes to
    /dev/null (the interpreter's last flush would raise again). Exit status 141,
    the shell's for a program SIGPIPE killed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_PIPE


def entry_point() -> None:
    raise SystemExit(main())
