"""Packs the GPU check for a device machine that cannot reach a package registry.

The lent GPU machines (the ``device`` tool: one H100 or H200, 16 cores) run a Python
3.12 image with torch (CUDA), numpy, xxhash, uvloop, prometheus-client and pytest,
and no registry. What the daemon and the client need beyond that travels as
wheels for that Python, pinned to the versions of this machine's venv (the gRPC
stubs generated here need grpcio and protobuf at least as new as the generator):

    python tools/gpu_pack.py            # wheels into .whl/, then prints the device call
    python tools/gpu_pack.py --dry-run  # also runs that call here, in a bare venv

The device call carries ``.whl`` and the generated stubs
(``client/kvtierd_client/_proto``, ignored by git) and runs
``tools/gpu_device_run.sh``, which installs the wheels into a private directory and
runs ``python -m benchmarks.gpu`` with the markdown written under ``$OUT``.

``--dry-run`` proves the list: it packs for this machine's Python, builds a venv
holding only what the device image has (torch from this project's CPU pin), and
runs the same script in it with ``--quick``: a dependency the list misses fails
there, not on the GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUBS = "client/kvtierd_client/_proto"
DEVICE_SCRIPT = "tools/gpu_device_run.sh"
# On the device image (the device tool's KINDS.md, read 2026-11-17): the daemon's and
# client's dependencies found there, and what the check itself uses from it.
DEVICE_HAS = ("torch", "numpy", "xxhash", "uvloop", "prometheus-client", "pytest")
# Carried as wheels, at this venv's versions.
CARRIED = (
    "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "redis", "hiredis",
    "blake3", "pyzmq", "msgpack",
)  # fmt: skip
DEVICE_PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
SIZE_LIMIT = 64 << 20  # what the device tool carries per call, working tree included
DRY_VENV = ".venv-gpu-dry"
DRY_WHEELS = ".whl-dry"
TORCH_PIN = "torch==2.13.0"  # the CPU wheel this project's registry serves


def runtime_dependencies(python_version: str) -> list[str]:
    """Names of pyproject's [project] dependencies that apply to ``python_version``."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    names = []
    for requirement in project["dependencies"]:
        name, _, marker = requirement.partition(";")
        if marker and not _marker_holds(marker, python_version):
            continue
        names.append(_canonical(re.split(r"[<>=!~\[ ]", name.strip(), maxsplit=1)[0]))
    return names


def uncovered(python_version: str = DEVICE_PYTHON) -> list[str]:
    """Runtime dependencies neither on the device image nor carried."""
    known = {_canonical(n) for n in (*DEVICE_HAS, *CARRIED)}
    return [name for name in runtime_dependencies(python_version) if name not in known]


def pins() -> list[str]:
    """``name==version`` of every carried package, as installed here."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]


def download(dest: str, python_version: str) -> None:
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "-d",
        dest,
    ]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, *pins()], check=True)


def device_call(dest: str, args: str) -> str:
    return (
        "device run:\n"
        f'  carry:   ["{dest}", "{STUBS}"]\n'
        f"  command: WHEELS={dest} bash {DEVICE_SCRIPT} {args}".rstrip()
    )


def tree_size(paths: list[str]) -> int:
    total = 0
    for path in paths:
        for root, _dirs, files in os.walk(os.path.join(REPO, path)):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def dry_run(python_version: str) -> int:
    """The device script in a venv that holds only the device image's packages."""
    download(os.path.join(REPO, DRY_WHEELS), python_version)
    venv = os.path.join(REPO, DRY_VENV)
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, ".installed")):
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
        others = [n for n in DEVICE_HAS if n != "torch"]
        subprocess.run([python, "-m", "pip", "install", "-q", TORCH_PIN, *others], check=True)
        open(os.path.join(venv, ".installed"), "w").close()
    out = os.path.join(REPO, "bench-results", "gpu-dry-run")
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PYTHON": python, "WHEELS": DRY_WHEELS, "OUT": out}
    env.pop("PYTHONPATH", None)
    print(
        f"dry run: bash {DEVICE_SCRIPT} --quick in {DRY_VENV} (torch, "
        f"{', '.join(DEVICE_HAS[1:])} only)",
        flush=True,
    )
    done = subprocess.run(["bash", DEVICE_SCRIPT, "--quick"], cwd=REPO, env=env, check=False)
    print(f"dry run: exit {done.returncode}; report in {out}/gpu.md", flush=True)
    return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/gpu_pack.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dest", default=".whl", help="wheel directory (default .whl, ignored by git)"
    )
    parser.add_argument(
        "--python-version",
        default=DEVICE_PYTHON,
        help=f"the device's Python (default {DEVICE_PYTHON})",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="also run the device script here, in a bare venv, with --quick",
    )
    parser.add_argument(
        "--args",
        default="",
        help="arguments for benchmarks.gpu in the printed call, e.g. "
        "'--sections fs --fs-compare 2,4,8'",
    )
    args = parser.parse_args()
    missing = uncovered(args.python_version)
    if missing:
        print(
            f"not on the device image and not carried: {', '.join(missing)}; add them to "
            "CARRIED in tools/gpu_pack.py",
            file=sys.stderr,
        )
        return 1
    if not os.path.isdir(os.path.join(REPO, STUBS)):
        print(f"{STUBS} is missing: run `make gen` first", file=sys.stderr)
        return 1
    download(os.path.join(REPO, args.dest), args.python_version)
    size = tree_size([args.dest, STUBS])
    print(f"{args.dest}: {', '.join(sorted(os.listdir(os.path.join(REPO, args.dest))))}")
    print(
        f"carried: {size / (1 << 20):.1f} MiB (+ the working tree; the device tool takes "
        f"{SIZE_LIMIT >> 20} MiB in all)"
    )
    print(device_call(args.dest, args.args))
    if args.dry_run:
        local = f"{sys.version_info.major}.{sys.version_info.minor}"
        return dry_run(local)
    return 0


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _marker_holds(marker: str, python_version: str) -> bool:
    """The one marker form pyproject uses: ``python_version < 'X.Y'`` (and >=)."""
    found = re.fullmatch(r"\s*python_version\s*(<|>=)\s*['\"](\d+)\.(\d+)['\"]\s*", marker)
    if found is None:
        raise ValueError(f"gpu_pack cannot evaluate the marker {marker!r}")
    wanted = (int(found[2]), int(found[3]))
    have = tuple(int(part) for part in python_version.split(".")[:2])
    return have < wanted if found[1] == "<" else have >= wanted


if __name__ == "__main__":
    raise SystemExit(main())
