"""An engine's view of kvtierd, run as another user: what the real client library does
with an address (tests/integration/security/test_impersonation.py).

Started as root: imports the client and numpy, drops to the uid and gid it is given
(the interpreter lives where that user may not read), then, as an engine would,
opens a session at the address, maps the announced region, stores its own prompt's
block and looks up the block an attacker planted, loading it when it is a HIT. It
prints one JSON object: what it mapped (the daemon's uid, which owns the mapped
file), what it stored, the planted key's lookup result and the bytes it loaded; or
the error that stopped it, with ``mapped`` False when nothing was mapped.

Usage: python victim_engine.py '{"uid": 1001, "gid": 1001, "address": "unix:///...",
"env": {"KVTIERD_ADDRESS": ""}, "pool": "p", "block_bytes": 4096,
"own_key": "prompt", "planted_key": "planted"}'
"""

from __future__ import annotations

import json
import os
import sys

import numpy  # noqa: F401 - imported while root: the user may not read the venv

from kvtierd_client.client import Client
from kvtierd_client.errors import KvtierError
from kvtierd_client.region import attach_announced
from kvtierd_client.wire.trust import UntrustedDaemon

OWN_BYTE = 0x5A


def main() -> int:
    spec = json.loads(sys.argv[1])
    for name, value in spec.get("env", {}).items():
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    os.setgroups(spec.get("groups", []))
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    report: dict[str, object] = {"uid": os.getuid(), "mapped": False}
    try:
        engine_step(spec, report)
    except (KvtierError, UntrustedDaemon, OSError) as err:
        report["error"] = type(err).__name__
        report["details"] = getattr(err, "details", "") or str(err)
    print(json.dumps(report))
    return 0


def engine_step(spec: dict[str, object], report: dict[str, object]) -> None:
    address = spec.get("address") or None
    with Client(address, timeout=10) as client:  # type: ignore[arg-type]
        session = client.open_session(str(spec["pool"]), block_bytes=int(spec["block_bytes"]))  # type: ignore[call-overload]
        region = attach_announced(
            session.region, session_id=session.session_id, daemon_uid=session.daemon_uid
        )
        report["mapped"] = True
        report["daemon_uid"] = session.daemon_uid  # the mapped file's owner: attach checks it
        rows = region.numpy()
        own = str(spec["own_key"]).encode()
        grant = session.prepare_store([own])
        if grant is not None and grant.block_ids:
            rows[grant.block_ids] = OWN_BYTE
            session.complete_store(grant.keys_to_store)
            report["stored"] = True
        planted = str(spec["planted_key"]).encode()
        (result,) = session.lookup([planted])
        report["planted_lookup"] = result.name
        if result.name == "HIT":
            (row,) = session.prepare_load([planted])
            report["loaded"] = bytes(rows[row][:8]).hex()
            session.complete_load([planted])
        region.close()
        session.close()


if __name__ == "__main__":
    raise SystemExit(main())
