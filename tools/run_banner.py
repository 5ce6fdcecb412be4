"""What ``make run`` prints before it starts the daemon in the foreground: where it
will serve, how to reach it with kvtierctl (in the venv, not on PATH), and what
it writes outside the checkout (as root: /run/kvtierd and /var/lib/kvtierd).

Everything comes from the configuration the daemon itself will load (defaults
and ``KVTIERD_*`` variables; ``make run`` gives no flags), so the banner cannot
name another socket than the one served. Usage: ``python tools/run_banner.py BIN``
where BIN is the venv's bin directory as the Makefile names it (``.venv/bin``).
"""

from __future__ import annotations

import os
import sys

from kvtierd.config import Config, ConfigError, load_config
from kvtierd_client.wire.address import default_address


def banner(config: Config, bin_dir: str, root: bool) -> list[str]:
    """The lines to print for ``config`` (see the module docstring)."""
    ctl = os.path.join(bin_dir, "kvtierctl")
    unix = [a[len("unix://") :] for a in config.server.listen if a.startswith("unix://")]
    lines = [f"kvtierd will serve on {', '.join(config.server.listen)} (Ctrl-C stops it)"]
    served = config.server.listen[0]
    # kvtierctl's own default: $KVTIERD_ADDRESS, else the default socket
    address = "" if default_address() == served else f" --address {served}"
    lines.append(
        f"reach it with: {ctl}{address} status   (kvtierctl is in the venv, not on PATH: "
        f"'. {os.path.join(bin_dir, 'activate')}' puts it there)"
    )
    writes = [f"{os.path.dirname(path)} (socket)" for path in unix]
    writes += [
        f"{tier.settings.root} ({tier.type} tier {tier.name})"
        for tier in config.tiers
        if hasattr(tier.settings, "root")
    ]
    kept = ", kept at stop for a warm restart" if config.memory.warm_restart else ""
    writes.append(f"{config.memory.shm_dir} (region files{kept})")
    who = "as root, it writes" if root else "it writes"
    lines.append(f"{who}: " + ", ".join(writes))
    return lines


def main(argv: list[str]) -> int:
    bin_dir = argv[1] if len(argv) > 1 else ".venv/bin"
    try:
        config = load_config()
    except ConfigError:
        return 0  # the daemon, started next, says what is wrong
    print("\n".join(banner(config, bin_dir, os.geteuid() == 0)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
