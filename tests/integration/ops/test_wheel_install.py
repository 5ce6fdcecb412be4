"""kvtierd installed like any Python package: sdist -> wheel -> a fresh venv, no make.

Scenario: the checkout's files (what a clean clone has, as ``git ls-files`` lists
them) are copied away; the sdist is built from the copy and the wheel from the
sdist, offline, with this venv's setuptools and grpcio-tools
(``--no-build-isolation``). The wheel goes into a venv made by ``python -m venv``
with ``--no-deps``; its runtime dependencies (and only those: no torch, no
kvtierd) are linked in from this venv, so every ``kvtierd*`` module the fresh
python imports comes from the wheel. The fresh venv's ``kvtierd`` console script
serves a Unix socket, its python does OpenSession / PrepareStore / CompleteStore /
Lookup HIT with ``kvtierd_client``, and its ``kvtierctl status`` shows the pool.

Without the build hook the wheel has no ``kvtierd_client/_proto`` and the client
and the daemon fail with "gRPC stubs are missing".
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path, PurePosixPath

import pytest
from daemon_harness import REPO, DaemonProcess, fs_tiers_config, wait_serving, write_config
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from shm_leftovers import shm_tempdir

STUBS = "kvtierd_client/_proto/kvtier/v1/"
STUB_FILES = {STUBS + name for name in ("kvtier_pb2.py", "kvtier_pb2_grpc.py", "kvtier_pb2.pyi")}
BUILD_TIMEOUT = 120.0  # seconds; a build takes a few here

# Run by the fresh venv's python: the round trip, and where every module came from.
CLIENT_SCRIPT = """
import importlib.util, json, sys, time
import kvtierd, kvtierd.ops.cli, kvtierd.ops.daemon, kvtierd_client
from kvtierd_client._proto.kvtier.v1 import kvtier_pb2
from kvtierd_client.client import Client

def fs_index_ready(client):
    return all(tier.ready for tier in client.get_stats("wheel").pools[0].tiers[1:])

with Client(sys.argv[1]) as client:
    session = client.open_session("wheel", block_bytes=4096, num_blocks=4, layout="wheel")
    # the pool's fs index is rebuilt in the background: until then a missing key is RETRY
    deadline = time.monotonic() + 20
    while not fs_index_ready(client):
        if time.monotonic() > deadline:
            sys.exit("the fs tier's index was not rebuilt within 20 s")
        time.sleep(0.01)
    stored = session.prepare_store([b"k1", b"k2"])
    session.complete_store([b"k1", b"k2"])
    lookup = session.lookup([b"k1", b"k2", b"k3"])
    session.close()
print(json.dumps({
    "files": {m.__name__: m.__file__ for m in (kvtierd, kvtierd_client, kvtier_pb2)},
    "keys_to_store": [key.decode() for key in stored.keys_to_store],
    "lookup": [result.name for result in lookup],
    "torch_imported": "torch" in sys.modules,
    "torch_installed": importlib.util.find_spec("torch") is not None,
}))
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that points a python or pip elsewhere."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "PIP_")) and key != "VIRTUAL_ENV"
    }
    return {
        **env,
        "PYTHONNOUSERSITE": "1",
        "PIP_CONFIG_FILE": os.devnull,  # no index or find-links of this machine
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        **extra,
    }


def run(*args: str | Path, cwd: Path, timeout: float = BUILD_TIMEOUT) -> str:
    """Runs a command; its stdout, or AssertionError with its output."""
    result = subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stderr}"
    return result.stdout


# --- build ------------------------------------------------------------------------------


def copy_checkout(dest: Path) -> Path:
    """Copies the files a clone of this checkout has (tracked, plus new files git
    does not ignore: no venv, no generated stubs) to ``dest``."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout of kvtierd and git")
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO)
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the work tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name, follow_symlinks=False)
    return dest


def check_build_requirements() -> None:
    """The build runs without isolation: this venv must hold what a real build
    would install from ``[build-system].requires`` (the grpcio-tools pin above all)."""
    for requirement in map(Requirement, build_requirements()):
        version = importlib.metadata.version(requirement.name)
        assert requirement.specifier.contains(version), (
            f"{requirement.name} {version} here does not meet the build requirement "
            f"{requirement}: align the dev extra in pyproject.toml, then `make install`"
        )


def build_wheel(workdir: Path) -> Path:
    """sdist from a copy of the checkout, then the wheel from that sdist (offline)."""
    check_build_requirements()
    source = copy_checkout(workdir / "source")
    assert not (source / STUBS).exists(), "the copy must not carry generated stubs"
    dist = workdir / "dist"
    build_sdist = "import setuptools.build_meta as b, sys; print(b.build_sdist(sys.argv[1]))"
    sdist = dist / run(sys.executable, "-c", build_sdist, dist, cwd=source).splitlines()[-1]
    wheels = workdir / "wheels"
    run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--no-index", "--no-cache-dir", "-w", wheels, sdist, cwd=workdir,
    )  # fmt: skip
    (wheel,) = wheels.glob("kvtierd-*.whl")
    return wheel


# --- fresh venv -------------------------------------------------------------------------


def runtime_closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The distributions of this venv that ``requirements`` need, transitively
    (markers evaluated without extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in found:
            found[name] = importlib.metadata.distribution(requirement.name)
            pending.extend(Requirement(text) for text in found[name].requires or ())
    return list(found.values())


def link_distributions(dists: list[importlib.metadata.Distribution], into: Path) -> None:
    """Symlinks the top-level entries (packages, modules, .dist-info) of ``dists``."""
    into.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        tops = {PurePosixPath(str(path)).parts[0] for path in dist.files or ()}
        for top in sorted(tops - {"..", "__pycache__"}):
            target = Path(str(dist.locate_file(top)))
            if target.exists() and not (into / top).exists():
                (into / top).symlink_to(target)


def fresh_venv(root: Path, requirements: list[str]) -> Path:
    """``python -m venv root`` whose only extra path is a directory of links to the
    distributions of this venv that ``requirements`` need; returns its python."""
    run(sys.executable, "-m", "venv", "--without-pip", root, cwd=root.parent)
    link_distributions(runtime_closure(requirements), root / "deps")
    site = sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)})
    Path(site, "deps.pth").write_text(f"{root / 'deps'}\n")
    return root / "bin" / "python"


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist") or []


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvt-wheel-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def wheel(workdir: Path) -> Path:
    return build_wheel(workdir)


@pytest.fixture(scope="module")
def venv(wheel: Path, workdir: Path) -> Path:
    """A fresh venv with the wheel (no extras) installed; returns its root."""
    python = fresh_venv(workdir / "venv", wheel_requirements(wheel))
    run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "--no-cache-dir", wheel, cwd=workdir,
    )  # fmt: skip
    return workdir / "venv"


# --- tests ------------------------------------------------------------------------------


def test_wheel_holds_the_stubs_and_the_floors_their_generated_code_needs(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        grpc_code = archive.read(STUBS + "kvtier_pb2_grpc.py").decode()
        messages = archive.read(STUBS + "kvtier_pb2.py").decode()
    assert names >= STUB_FILES, sorted(names)
    assert "from kvtierd_client._proto.kvtier.v1 import kvtier_pb2" in grpc_code
    assert not {name for name in names if name.startswith(("proto/", "tools/", "setup"))}
    # the generated code refuses to load on an older grpcio / protobuf runtime
    grpc_made_by = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_code)
    protobuf_made_by = re.search(r"# Protobuf Python Version: ([\d.]+)", messages)
    assert grpc_made_by and protobuf_made_by
    requires = [Requirement(text) for text in wheel_requirements(wheel)]
    floors = {req.name: str(req.specifier) for req in requires if req.marker is None}
    assert floors["grpcio"] == f">={grpc_made_by[1]}"
    assert floors["protobuf"] == f">={protobuf_made_by[1]}"
    torch_extras = {str(req.marker) for req in requires if req.name == "torch"}
    assert 'extra == "client"' in torch_extras and "torch" not in floors


def test_fresh_venv_runs_kvtierd_kvtierctl_and_the_client(venv, tmp_path):
    """The console scripts run the fresh venv's python, which finds no kvtierd
    but the wheel's; no torch is installed there."""
    python, kvtierd, kvtierctl = (
        venv / "bin" / name for name in ("python", "kvtierd", "kvtierctl")
    )
    for script in (kvtierd, kvtierctl):
        assert script.read_text().splitlines()[0] == f"#!{python}"
    (tmp_path / "fs").mkdir()
    daemon = start_wheel_daemon(kvtierd, tmp_path / "fs")
    try:
        out = run(python, "-c", CLIENT_SCRIPT, daemon.address, cwd=tmp_path, timeout=30)
        answer = json.loads(out.splitlines()[-1])
        status = run(kvtierctl, "--address", daemon.address, "status", cwd=tmp_path, timeout=30)
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()
    site = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    assert all(path.startswith(site + os.sep) for path in answer["files"].values()), answer
    assert answer["keys_to_store"] == ["k1", "k2"]
    assert answer["lookup"] == ["HIT", "HIT", "MISS"]
    assert answer["torch_installed"] is False  # no `client` extra: the daemon and client ran
    assert answer["torch_imported"] is False
    assert "pool wheel: 4 blocks x 4.0 KiB, lru" in status, status


def test_gen_stubs_needs_grpcio_tools_only(wheel, workdir):
    """`make gen`'s generator runs with grpcio-tools and its dependencies alone
    (no kvtierd, no torch) and writes what the wheel ships."""
    (pin,) = (text for text in build_requirements() if text.startswith("grpcio-tools"))
    python = fresh_venv(workdir / "gen-venv", [pin])
    out = workdir / "gen-out"
    run(python, REPO / "tools" / "gen_stubs.py", "--out", out, cwd=workdir)
    with zipfile.ZipFile(wheel) as archive:
        for name in STUB_FILES:
            generated = (out / name.removeprefix("kvtierd_client/_proto/")).read_bytes()
            assert generated == archive.read(name), name


def build_requirements() -> list[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]


def start_wheel_daemon(kvtierd: Path, fs_root: Path) -> DaemonProcess:
    """The fresh venv's console script on a fresh socket, with an fs tier; SERVING."""
    workdir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")  # short: sun_path is 108 bytes
    shm_dir = shm_tempdir()
    socket_path = os.path.join(workdir, "kvtierd.sock")
    log_path = os.path.join(workdir, "daemon.log")
    args = [
        "--config", write_config(workdir, fs_tiers_config(fs_root)),
        "--listen", "unix://" + socket_path,
        "--shm-dir", shm_dir,
        "--memory-budget", "64MiB",
        "--metrics-address", "",
    ]  # fmt: skip
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [str(kvtierd), *args], stdout=log_file, stderr=subprocess.STDOUT,
            env=clean_env(PYTHONUNBUFFERED="1"), cwd=workdir,
        )  # fmt: skip
    daemon = DaemonProcess(proc, socket_path, shm_dir, log_path, workdir)
    try:
        wait_serving(daemon)
    except BaseException:
        daemon.cleanup()
        raise
    return daemon
