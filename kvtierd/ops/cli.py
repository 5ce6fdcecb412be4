"""Command line: ``kvtierd [--config FILE] [flags]`` runs the daemon;
``kvtierd fsck ROOT`` runs the operator command of the same name (``kvtierctl``).

Flags are generated from ``config.OPTIONS`` so each option is declared once.
This is the only module that exits the process; exit code 2 means the
configuration is invalid or the daemon cannot start for a reason its operator
can fix (a socket or port in use, a directory it may not create): one line on
stderr naming the key, never a traceback. Exit code 1 is a failure of the daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from kvtierd import __version__
from kvtierd.config import OPTIONS, Config, ConfigError, Option, load_config, unknown_environment
from kvtierd.config.values import boolean
from kvtierd.errors import StartupError
from kvtierd.tiers import registry

EXIT_CONFIG = 2
EXIT_RUNTIME = 1
CTL_COMMANDS = ("fsck",)  # operator commands also reachable as `kvtierd <command>`


HELP_WIDTH = 79


def build_parser() -> argparse.ArgumentParser:
    """Flags from ``OPTIONS``, each help line with its default as it would be
    written (computed now: the default socket depends on the user), its key and
    its environment variable; the epilog lists the tier types' options."""
    parser = argparse.ArgumentParser(
        prog="kvtierd",
        description=textwrap.fill(
            "KV-cache tiering daemon: a shared-memory primary tier plus secondary tiers, "
            "served over gRPC.",
            HELP_WIDTH,
        ),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's lists stay lists
    )
    parser.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    for option in OPTIONS:
        if option.flag is None:
            continue
        # a boolean flag alone means true (``--takeover``); ``--fast-lane false`` still works
        alone: dict[str, Any] = {"nargs": "?", "const": "true"} if option.parse is boolean else {}
        parser.add_argument(
            option.flag,
            dest=option.dotted,
            metavar=option.key.upper(),
            action="append" if option.repeatable else "store",
            default=None,
            help=_flag_help(option),
            **alone,
        )
    return parser


def _flag_help(option: Option) -> str:
    repeat = "; repeat the flag for several" if option.repeatable else ""
    env = f"env {option.env}" + (" as A,B" if option.repeatable else "")
    default = option.default_text().replace("%", "%%")  # argparse %-formats help
    return f"{option.help}{repeat} (default: {default}) [{option.dotted}, {env}]"


def _epilog() -> str:
    paragraphs = (
        "Every key can also be set with KVTIERD_<SECTION>_<KEY> in the environment "
        "(e.g. KVTIERD_MEMORY_BUDGET=8GiB). Precedence: flag > environment > file > "
        "default. Sizes are binary: a number of bytes or a number with KiB, MiB, GiB, TiB, "
        "PiB or EiB (GB, G and Gi are refused); durations take ms, s, m or h ('10s'); a "
        "duration without a unit is refused, except 0.",
        "Operator commands: kvtierd fsck ROOT (see kvtierctl --help).",
        "Secondary tiers are [[tiers]] tables of the --config file (type, name, then the "
        "type's options):",
    )
    text = "\n\n".join(textwrap.fill(p, HELP_WIDTH) for p in paragraphs)
    return f"{text}\n{registry.help_text(HELP_WIDTH)}"


def value_flags() -> frozenset[str]:
    """The flags that take a value (not the booleans, whose value is optional)."""
    flags = {option.flag for option in OPTIONS if option.flag and option.parse is not boolean}
    return frozenset({"--config", *flags})


# a value argparse would take for a flag ("-5s"): no flag starts with '-' and a digit
_NEGATIVE_VALUE = re.compile(r"^-\.?[0-9]")


def join_negative_values(argv: Sequence[str], flags: frozenset[str]) -> list[str]:
    """``--lease -5s`` as ``--lease=-5s``: argparse reads a token that starts with
    '-' and is not a plain number as a flag ("expected one argument"), so the
    option's reader never got to say a duration cannot be negative."""
    joined: list[str] = []
    for token in argv:
        if joined and joined[-1] in flags and _NEGATIVE_VALUE.match(token):
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def parse_config(argv: Sequence[str] | None = None) -> Config:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(join_negative_values(argv, value_flags()))
    overrides = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    return load_config(args.config, overrides=overrides)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in CTL_COMMANDS:  # kvtierd fsck ROOT == kvtierctl fsck ROOT
        from kvtierd.ops import ctl

        return ctl.main(argv, prog="kvtierd")
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"kvtierd: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(config.log.level)
    for warning in unknown_environment():
        logging.getLogger(__name__).warning("%s", warning)
    from kvtierd.ops.daemon import logged, serve  # heavy imports after argument checks

    try:
        _run(serve(config))
    except ConfigError as exc:
        print(f"kvtierd: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except StartupError as exc:  # the operator's to fix (a busy socket or port...)
        print(f"kvtierd: cannot start: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as exc:
        # a failed shutdown step was logged with its traceback where it failed
        logging.getLogger(__name__).error("kvtierd failed: %s", exc, exc_info=not logged(exc))
        print(f"kvtierd: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return 0


def _run(coro: object) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(coro)  # type: ignore[arg-type]
        return
    uvloop.run(coro)  # type: ignore[arg-type]
