"""Generates the ``kvtier.v1`` gRPC stubs of ``kvtierd_client`` from ``proto/``.

One generator for every way the stubs are made: the setuptools build hook
(``setup.py``: wheels, sdist -> wheel, editable installs) and ``make gen``
(``python tools/gen_stubs.py``). It needs grpcio-tools and nothing else of
kvtierd (no torch, no dev venv).

Invariants of the output directory (the ``kvtierd_client._proto`` package):

* the proto package stays ``kvtier.v1``, so the names on the wire do not change;
  the Python modules live under ``kvtierd_client._proto.kvtier.v1``: the one
  import protoc writes as ``from kvtier.v1 import ...`` is rewritten, and no
  generated file may import ``kvtier`` at top level afterwards;
* every package directory has an ``__init__.py``;
* the directory is replaced whole (generated beside it, then renamed), so no
  module of an older proto survives and a failed run leaves the old one intact.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"
STUB_DIR = REPO / "client" / "kvtierd_client" / "_proto"
STUB_PACKAGE = "kvtierd_client._proto"

# protoc's grpc plugin imports the messages module by its proto package path
_PROTO_IMPORT = re.compile(r"^from kvtier\.v1 import ", re.MULTILINE)
_LEFT_OVER_IMPORT = re.compile(r"^(from|import) kvtier\b", re.MULTILINE)


class StubGenerationError(RuntimeError):
    """protoc failed, or its output is not what the import rewrite expects."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every ``.proto`` under ``proto_root``, sorted (deterministic output)."""
    files = sorted(proto_root.rglob("*.proto"))
    if not files:
        raise StubGenerationError(f"no .proto file under {proto_root}")
    return files


def generate(out_dir: Path = STUB_DIR, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Writes the stubs of every proto under ``proto_root`` into ``out_dir``
    (replacing it whole); returns the files written, under ``out_dir``.

    Raises ``StubGenerationError`` if protoc fails or its output cannot be
    rewritten; ``ModuleNotFoundError`` without grpcio-tools.
    """
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()  # as the umask says (an editable install reads it in place)
    try:
        _run_protoc(proto_root.resolve(), proto_files(proto_root), staging)
        _rewrite_imports(staging)
        _add_package_markers(staging)
        _replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return sorted(path for path in out_dir.rglob("*") if path.is_file())


def _run_protoc(proto_root: Path, protos: list[Path], out: Path) -> None:
    from grpc_tools import protoc  # build requirement only; the runtime never imports it

    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *(str(path.resolve()) for path in protos),
    ]
    status = protoc.main(args)
    if status != 0:
        raise StubGenerationError(f"protoc exited with {status} (its message is above)")


def _rewrite_imports(out: Path) -> None:
    """Moves protoc's ``from kvtier.v1 import`` under ``STUB_PACKAGE``."""
    rewritten = 0
    for path in sorted(out.rglob("*_pb2_grpc.py")):
        text, count = _PROTO_IMPORT.subn(f"from {STUB_PACKAGE}.kvtier.v1 import ", path.read_text())
        path.write_text(text)
        rewritten += count
    if rewritten == 0:
        raise StubGenerationError("no `from kvtier.v1 import` in protoc's grpc output to rewrite")
    for path in sorted(out.rglob("*.py*")):
        if _LEFT_OVER_IMPORT.search(path.read_text()):
            raise StubGenerationError(f"{path.name} still imports `kvtier` at top level")


def _add_package_markers(out: Path) -> None:
    for directory in [out, *(path for path in out.rglob("*") if path.is_dir())]:
        (directory / "__init__.py").touch()


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Renames ``staging`` to ``out_dir``; the old ``out_dir`` is removed first."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=STUB_DIR, help=f"output directory (default {STUB_DIR})"
    )
    args = parser.parse_args(argv)
    try:
        written = generate(args.out)
    except StubGenerationError as exc:
        print(f"gen_stubs: {exc}", file=sys.stderr)
        return 1
    print(f"gen_stubs: {len(written)} files in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
