"""A container runtime for tests/deploy (``make test-deploy``): Debian's docker, a locally
made base image and the repository's own image built from deploy/docker/Dockerfile.

What it does, in order (each step reuses what is already there):

1. The client is Debian's ``/usr/bin/docker`` (20.10: BuildKit built in, enabled with
   ``DOCKER_BUILDKIT=1``); a newer ``docker`` earlier on PATH may lack buildx.
2. A docker daemon: the one ``$DOCKER_HOST`` or ``/var/run/docker.sock`` names when it answers,
   else our own ``dockerd`` on :data:`OWN_SOCKET` with its data root in :data:`CACHE`
   (``dockerd`` running as root, in the background, logging to ``CACHE/dockerd.log``).
   :meth:`Docker.close` stops it only if this process started it. Where no daemon answers and
   none can be started, :class:`RuntimeUnavailable` says why (the tests skip with that text).
3. The base image :data:`BASE_IMAGE`: no image registry is reachable from the CI machines, so
   ``FROM python:3.11-slim`` cannot be pulled. It is made once with ``debootstrap
   --variant=minbase bookworm`` from the machine's configured Debian mirror (python3, venv,
   pip, ca-certificates; this machine's CA certificates copied in, since HTTPS to the package
   registries may go through an intercepting proxy; PEP 668's EXTERNALLY-MANAGED marker
   removed) and imported; later runs reuse it (it lives in the daemon's data root).
4. The repository's image :data:`IMAGE`, built every run from the working tree with
   ``--build-arg PYTHON_IMAGE=`` the base. The machine's pip settings reach the build's
   ``pip install`` as a BuildKit secret (``pip.conf``, see :func:`build_pip_config`) and its
   proxy variables as docker's predefined proxy build args: nothing of this machine is written
   into the Dockerfile or the image.

Every command has a timeout; output of the long ones goes to log files under :data:`CACHE`.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
CACHE = Path(
    os.environ.get("KVTIERD_DEPLOY_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvtierd-deploy"
)
# our own dockerd: socket, exec root and pid file on /run (tmpfs), data root in CACHE
OWN_RUN = Path("/run/kvtierd-deploy")
OWN_SOCKET = OWN_RUN / "docker.sock"
BASE_IMAGE = os.environ.get("KVTIERD_DEPLOY_BASE_IMAGE") or "local/python:3.11-bookworm"
IMAGE = "kvtierd:test-deploy"
DEBIAN_SUITE = "bookworm"  # its python3 is 3.11, the Dockerfile's default base
DEFAULT_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates")
# pip settings that say where packages come from and how to reach it (see build_pip_config)
PIP_KEYS = ("index-url", "extra-index-url", "trusted-host", "default-timeout", "timeout", "retries")
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
# the CA bundle of Debian's ca-certificates, inside the image
IMAGE_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class RuntimeUnavailable(Exception):
    """No container runtime answers here and none can be started (the message says why)."""


class ContainerStepFailed(Exception):
    """A runtime step that should have worked failed (the message carries its output)."""


@dataclass
class Docker:
    """A docker client bound to one daemon. ``started`` is the dockerd this process started
    (stopped by :meth:`close`), None when the daemon was already running."""

    binary: str
    host: str
    started: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "1"}

    def run(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 120,
        input_bytes: bytes | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``docker ARGS``; raises ContainerStepFailed with its output if ``check`` and it fails."""
        proc = subprocess.run(
            [self.binary, *args],
            env=self.env(),
            capture_output=True,
            timeout=timeout,
            input=input_bytes,
        )
        result = subprocess.CompletedProcess(
            proc.args,
            proc.returncode,
            proc.stdout.decode(errors="replace"),
            proc.stderr.decode(errors="replace"),
        )
        if check and result.returncode != 0:
            raise ContainerStepFailed(
                f"docker {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
            )
        return result

    def has_image(self, name: str) -> bool:
        return self.run("image", "inspect", name, check=False).returncode == 0

    def close(self) -> None:
        """Stops the dockerd this process started (SIGTERM, then SIGKILL after 60 s)."""
        if self.started is None:
            return
        process, self.started = self.started, None
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def docker_client() -> str:
    """Debian's docker client when installed (its BuildKit needs no buildx), else PATH's."""
    if os.access("/usr/bin/docker", os.X_OK):
        return "/usr/bin/docker"
    found = shutil.which("docker")
    if found is None:
        raise RuntimeUnavailable(
            "no docker client: install Debian's docker.io "
            "(`make test-deploy` does, as root with apt)"
        )
    return found


def _answers(binary: str, host: str) -> bool:
    try:
        proc = subprocess.run(
            [binary, "info", "--format", "{{.ServerVersion}}"],
            env={**os.environ, "DOCKER_HOST": host},
            capture_output=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def connect(start_timeout: float = 90) -> Docker:
    """A :class:`Docker` bound to a daemon that answers: an existing one, else our own."""
    binary = docker_client()
    candidates = [os.environ.get("DOCKER_HOST", ""), "unix:///var/run/docker.sock"]
    candidates.append(f"unix://{OWN_SOCKET}")  # one a previous run left behind
    for host in filter(None, candidates):
        if host.startswith("unix://") and not os.path.exists(host[len("unix://") :]):
            continue
        if _answers(binary, host):
            return Docker(binary, host)
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise RuntimeUnavailable("no docker daemon answers and there is no dockerd to start")
    if os.geteuid() != 0:
        raise RuntimeUnavailable("no docker daemon answers and starting dockerd needs root")
    CACHE.mkdir(parents=True, exist_ok=True)
    OWN_RUN.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = CACHE / "dockerd.log"
    host = f"unix://{OWN_SOCKET}"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [
                dockerd,
                f"--host={host}",
                f"--data-root={CACHE / 'docker'}",
                f"--exec-root={OWN_RUN / 'exec'}",
                f"--pidfile={OWN_RUN / 'dockerd.pid'}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    docker = Docker(binary, host, started=process, log_path=log_path)
    started = time.monotonic()
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            docker.started = None
            raise RuntimeUnavailable(
                f"dockerd exited {process.returncode} at start:\n{_tail(log_path)}"
            )
        if _answers(binary, host):
            docker.timings["dockerd_start_s"] = time.monotonic() - started
            return docker
        time.sleep(0.5)
    docker.close()
    raise RuntimeUnavailable(
        f"dockerd did not answer within {start_timeout:.0f} s:\n{_tail(log_path)}"
    )


def _tail(path: Path, size: int = 3000) -> str:
    try:
        return path.read_bytes()[-size:].decode(errors="replace")
    except OSError as exc:
        return f"({path}: {exc})"


# ------------------------------------------------------------------ the base image


def debian_mirror(sources: Sequence[str] | None = None) -> str:
    """The machine's Debian mirror for :data:`DEBIAN_SUITE` (deb822 ``.sources`` files or
    one-line ``sources.list`` entries); deb.debian.org when none is configured."""
    if sources is None:
        sources = sorted(
            glob.glob("/etc/apt/sources.list") + glob.glob("/etc/apt/sources.list.d/*")
        )
    for path in sources:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(re.findall(r"(?m)^(\w[\w-]*):\s*(.+)$", stanza))
            suites = fields.get("Suites", "").split()
            if DEBIAN_SUITE in suites and "main" in fields.get("Components", "").split():
                return fields["URIs"].split()[0]
        for line in text.splitlines():
            match = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line.strip())
            if match and match.group(2) == DEBIAN_SUITE and "main" in match.group(3).split():
                return match.group(1)
    return DEFAULT_MIRROR


def ensure_base_image(docker: Docker, name: str = BASE_IMAGE) -> bool:
    """Makes :data:`BASE_IMAGE` unless the daemon has it; True when it was made now."""
    if docker.has_image(name):
        return False
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise ContainerStepFailed(
            f"the base image {name} is missing and making it needs root and debootstrap "
            "(`make test-deploy` installs it with apt)"
        )
    started = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
    root = work / "root"
    log_path = CACHE / "debootstrap.log"
    try:
        with open(log_path, "wb") as log:
            subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    DEBIAN_SUITE,
                    str(root),
                    debian_mirror(),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=1200,
            )
        _trust_machine_cas(root)
        for marker in glob.glob(str(root / "usr/lib/python3*/EXTERNALLY-MANAGED")):
            os.unlink(marker)
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in glob.glob(str(root / leftover / "*")):
                if os.path.isfile(entry) and not os.path.islink(entry):
                    os.unlink(entry)
        tar = subprocess.run(
            ["tar", "-C", str(root), "--numeric-owner", "-c", "."],
            capture_output=True,
            check=True,
            timeout=600,
        )
        docker.run(
            "import",
            "--change",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change",
            'CMD ["python3"]',
            "-",
            name,
            input_bytes=tar.stdout,
            timeout=600,
        )
    except subprocess.CalledProcessError as exc:
        raise ContainerStepFailed(
            f"making the base image failed ({exc}):\n{_tail(log_path)}"
        ) from exc
    finally:
        _remove_rootfs(work)
    docker.timings["base_image_s"] = time.monotonic() - started
    return True


def _trust_machine_cas(root: Path) -> None:
    """Copies this machine's local CA certificates into the root and rebuilds its bundle."""
    local = Path("/usr/local/share/ca-certificates")
    target = root / "usr/local/share/ca-certificates"
    target.mkdir(parents=True, exist_ok=True)
    if local.is_dir():
        for cert in local.glob("*.crt"):
            if cert.is_file():
                shutil.copyfile(cert, target / cert.name)
    subprocess.run(
        ["chroot", str(root), "update-ca-certificates"],
        capture_output=True,
        check=True,
        timeout=120,
    )


def _remove_rootfs(work: Path) -> None:
    """Removes a debootstrap tree, unmounting first whatever a failed run left mounted in
    it (/proc, /sys): removing through a live mount would reach the host's files."""
    with open("/proc/mounts") as mounts:
        inside = [line.split()[1] for line in mounts if line.split()[1].startswith(str(work) + "/")]
    for mount_point in sorted(inside, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount_point], capture_output=True, timeout=60)
    shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ the repository's image


def build_pip_config(listing: str, env: dict[str, str]) -> str:
    """A pip.conf for the image build from this machine's pip settings: ``listing`` is
    ``pip config list`` output (``scope.key='value'`` lines, environment ones included),
    ``env`` the environment (``PIP_*`` variables win). Kept: where packages come from and how
    to reach it (:data:`PIP_KEYS`); index URLs only over http(s) (this machine's
    ``file://`` indexes and find-links directories do not exist in the build); a ``cert``
    becomes the image's own CA bundle (the base image trusts this machine's CAs)."""
    settings: dict[str, str] = {}
    for line in listing.splitlines():
        match = re.match(r"^[^.]*\.([\w-]+)='(.*)'$", line.strip())
        if match:
            settings[match.group(1)] = match.group(2)
    for key in (*PIP_KEYS, "cert"):
        value = env.get("PIP_" + key.upper().replace("-", "_"))
        if value:
            settings[key] = value
    lines = ["[global]"]
    for key in PIP_KEYS:
        value = settings.get(key, "")
        if key in ("index-url", "extra-index-url"):
            value = " ".join(u for u in value.split() if u.startswith(("http://", "https://")))
        if value:
            lines.append(f"{key} = {value}")
    if settings.get("cert"):
        lines.append(f"cert = {IMAGE_CA_BUNDLE}")
    return "\n".join(lines) + "\n"


def machine_pip_config() -> str:
    """:func:`build_pip_config` of the pip that this machine's ``python3`` runs."""
    python = shutil.which("python3") or sys.executable
    listing = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    return build_pip_config(listing, dict(os.environ))


def build_image(docker: Docker, name: str = IMAGE, base: str = BASE_IMAGE) -> None:
    """Builds deploy/docker/Dockerfile from the working tree on ``base`` (log in CACHE)."""
    started = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", prefix="pip-", suffix=".conf", dir=CACHE) as conf:
        conf.write(machine_pip_config())
        conf.flush()
        args = ["build", "-f", str(DOCKERFILE), "--build-arg", f"PYTHON_IMAGE={base}"]
        args += ["--secret", f"id=pip.conf,src={conf.name}", "-t", name]
        for var in PROXY_VARS:
            if os.environ.get(var):
                args += ["--build-arg", f"{var}={os.environ[var]}"]
        result = docker.run(*args, str(REPO), check=False, timeout=1200)
    (CACHE / "build.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise ContainerStepFailed(
            f"docker build exited {result.returncode} (full log: {CACHE / 'build.log'}):\n"
            f"{result.stderr[-6000:]}"
        )
    docker.timings["build_s"] = time.monotonic() - started


def image_size(docker: Docker, name: str = IMAGE) -> int:
    return int(docker.run("image", "inspect", "--format", "{{.Size}}", name).stdout.strip())


def filesystem_type(path: Path) -> str:
    """``stat -f`` type name of the filesystem holding ``path`` (``tmpfs``, ``ext2/ext3``)."""
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()
