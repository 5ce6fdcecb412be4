"""The Kubernetes manifests of deploy/k8s/ rendered into ``docker run`` arguments, so that
tests/deploy runs exactly the container settings the manifests declare (and they cannot
drift apart: change a manifest and the containers the tests start change with it).

What is rendered, per container of a pod template:

| manifest | docker run |
|---|---|
| ``securityContext.runAsUser`` / ``runAsGroup`` (container, else pod) | ``--user UID:GID`` |
| ``runAsNonRoot: true`` | refused here (ManifestError) when the uid is 0 or missing |
| pod ``supplementalGroups`` and ``fsGroup`` | ``--group-add`` each |
| ``readOnlyRootFilesystem: true`` | ``--read-only`` |
| ``capabilities.drop`` / ``add`` | ``--cap-drop`` / ``--cap-add`` |
| ``allowPrivilegeEscalation: false`` | ``--security-opt no-new-privileges`` |
| ``privileged: true``, ``hostIPC/PID/Network: true`` | refused (ManifestError) |
| an ``emptyDir`` with ``medium: Memory`` at ``/dev/shm`` | see below (shared /dev/shm) |
| another ``emptyDir`` | a named volume ``PREFIX-VOLUME`` shared by the pod's containers |
| ``hostPath`` | a bind mount of ``HOST_ROOT/<path>`` (created for ``DirectoryOrCreate``) |
| ``configMap`` | a read-only bind mount of a directory holding its ``data`` files |
| ``volumeMounts[].readOnly`` | ``:ro`` |
| ``env`` (``value`` only) | ``-e`` |
| ``command`` / ``args`` | ``--entrypoint`` + arguments, as Kubernetes overrides ENTRYPOINT/CMD |
| ``startupProbe.exec`` (+ ``readinessProbe``'s threshold) | ``--health-*`` (see below) |
| ``resources.limits.memory`` | ``--memory`` |

Shared /dev/shm: the first container rendered that mounts it (``Pod.ipc_owner``: render
the daemon first) gets ``--ipc=shareable --shm-size=sizeLimit``, the others
``--ipc=container:OWNER``: one /dev/shm for the pod, as its containers share the volume.

Healthcheck: ``--health-cmd`` = the startupProbe's command, ``--health-interval`` /
``--health-timeout`` its period and timeout, ``--health-start-period`` period x
failureThreshold, ``--health-retries`` the readinessProbe's failureThreshold.

Not rendered: ports (tests reach the container's IP), CPU requests and limits (the test
machine has fewer cores), probes other than exec, ``seccompProfile: RuntimeDefault`` (docker's
default profile is the runtime default).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BINARY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
DECIMAL_UNITS = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


class ManifestError(ValueError):
    """The manifest asks for something a rendered container must not get (or cannot)."""


def quantity_bytes(text: str | int) -> int:
    """A Kubernetes quantity (``64Mi``, ``20Gi``, ``1G``, ``512``) in bytes."""
    match = re.fullmatch(r"(\d+)([KMGT]i|[kMGT])?", str(text))
    if match is None:
        raise ManifestError(f"not a byte quantity: {text!r}")
    number, unit = int(match.group(1)), match.group(2) or ""
    return number * (BINARY_UNITS.get(unit) or DECIMAL_UNITS.get(unit) or 1)


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_template(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod template of the first workload (Deployment, DaemonSet, ...) in a manifest."""
    for document in documents:
        template = document.get("spec", {}).get("template")
        if template is not None:
            return template
    raise ManifestError("no workload with a pod template")


def config_maps(documents: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """``{ConfigMap name: data}`` of a manifest."""
    return {
        d["metadata"]["name"]: dict(d.get("data", {}))
        for d in documents
        if d.get("kind") == "ConfigMap"
    }


@dataclass
class Pod:
    """A pod template prepared for docker: where its volumes live on the host. ``prefix``
    names the docker objects (containers ``PREFIX-NAME``, volumes ``PREFIX-VOLUME``)."""

    spec: dict[str, Any]
    prefix: str
    host_root: Path
    config_dirs: dict[str, Path] = field(default_factory=dict)
    ipc_owner: str = ""  # the container that owns the shared /dev/shm

    @property
    def containers(self) -> dict[str, dict[str, Any]]:
        """Every container by name: init containers (native sidecars included) and the rest."""
        every = [*self.spec.get("initContainers", []), *self.spec.get("containers", [])]
        return {c["name"]: c for c in every}

    def container_name(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def volume_name(self, volume: str) -> str:
        return f"{self.prefix}-{volume}"

    def named_volumes(self) -> list[str]:
        """The docker volumes this pod's emptyDirs (other than the shared /dev/shm) become."""
        return [
            self.volume_name(v["name"])
            for v in self.spec.get("volumes", [])
            if "emptyDir" in v and not self._is_shm(v["name"])
        ]

    def host_path(self, path: str) -> Path:
        return self.host_root / path.lstrip("/")

    def _volume(self, name: str) -> dict[str, Any]:
        for volume in self.spec.get("volumes", []):
            if volume["name"] == name:
                return volume
        raise ManifestError(f"volumeMount of an undeclared volume {name!r}")

    def _is_shm(self, volume_name: str) -> bool:
        volume = self._volume(volume_name)
        if volume.get("emptyDir", {}).get("medium") != "Memory":
            return False
        return any(
            m["name"] == volume_name and m["mountPath"] == "/dev/shm"
            for c in self.containers.values()
            for m in c.get("volumeMounts", [])
        )

    def check_pod_security(self) -> None:
        for key in ("hostIPC", "hostPID", "hostNetwork"):
            if self.spec.get(key):
                raise ManifestError(f"{key}: true is not rendered (nor wanted)")

    def run_args(
        self,
        name: str,
        image: str,
        *,
        command: list[str] | None = None,
        args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        user: str | None = None,
    ) -> list[str]:
        """``docker run`` options + image + arguments of container ``name`` (``command`` /
        ``args`` / ``extra_env`` replace or extend the manifest's, e.g. for the engine's
        placeholder image; ``user`` "UID:GID" stands for the image's USER where the
        manifest sets no runAsUser)."""
        self.check_pod_security()
        container = self.containers[name]
        pod_security = self.spec.get("securityContext", {})
        security = {**pod_security, **container.get("securityContext", {})}
        out = ["--name", self.container_name(name)]
        if user is not None and "runAsUser" not in security:
            uid, _, gid = user.partition(":")
            security = {**security, "runAsUser": int(uid), "runAsGroup": int(gid or uid)}
        out += self._identity(name, security, pod_security)
        out += self._hardening(name, security)
        out += self._mounts(name, container)
        memory = container.get("resources", {}).get("limits", {}).get("memory")
        if memory is not None:
            out += [f"--memory={quantity_bytes(memory)}"]
        out += self._health(container)
        for variable in container.get("env", []):
            if "value" in variable:
                out += ["-e", f"{variable['name']}={variable['value']}"]
        for key, value in (extra_env or {}).items():
            out += ["-e", f"{key}={value}"]
        entry = container.get("command") if command is None else command
        arguments = container.get("args", []) if args is None else args
        if entry:
            out += ["--entrypoint", entry[0], image, *entry[1:], *arguments]
        else:
            out += [image, *arguments]
        return out

    def _identity(
        self, name: str, security: dict[str, Any], pod_security: dict[str, Any]
    ) -> list[str]:
        uid, gid = security.get("runAsUser"), security.get("runAsGroup")
        if security.get("runAsNonRoot") and (uid is None or int(uid) == 0):
            raise ManifestError(f"{name}: runAsNonRoot without a non-zero runAsUser")
        out = []
        if uid is not None:
            out += ["--user", f"{uid}:{gid if gid is not None else uid}"]
        groups = [*pod_security.get("supplementalGroups", [])]
        if "fsGroup" in pod_security:
            groups.append(pod_security["fsGroup"])
        for group in dict.fromkeys(groups):
            out += ["--group-add", str(group)]
        return out

    def _hardening(self, name: str, security: dict[str, Any]) -> list[str]:
        if security.get("privileged"):
            raise ManifestError(f"{name}: privileged containers are not rendered")
        out = []
        if security.get("readOnlyRootFilesystem"):
            out.append("--read-only")
        if security.get("allowPrivilegeEscalation") is False:
            out += ["--security-opt", "no-new-privileges"]
        capabilities = security.get("capabilities", {})
        for cap in capabilities.get("drop", []):
            out.append(f"--cap-drop={cap}")
        for cap in capabilities.get("add", []):
            out.append(f"--cap-add={cap}")
        return out

    def _mounts(self, name: str, container: dict[str, Any]) -> list[str]:
        out = []
        for mount in container.get("volumeMounts", []):
            volume = self._volume(mount["name"])
            read_only = ":ro" if mount.get("readOnly") else ""
            target = mount["mountPath"]
            if self._is_shm(mount["name"]):
                if not self.ipc_owner:
                    self.ipc_owner = name
                if self.ipc_owner == name:
                    size = volume["emptyDir"].get("sizeLimit")
                    out.append("--ipc=shareable")
                    if size is not None:
                        out.append(f"--shm-size={quantity_bytes(size)}")
                else:
                    out.append(f"--ipc=container:{self.container_name(self.ipc_owner)}")
            elif "emptyDir" in volume:
                out += ["-v", f"{self.volume_name(mount['name'])}:{target}{read_only}"]
            elif "hostPath" in volume:
                host = self.host_path(volume["hostPath"]["path"])
                kind = volume["hostPath"].get("type", "")
                if kind == "DirectoryOrCreate":
                    host.mkdir(parents=True, exist_ok=True)
                elif not host.is_dir():
                    raise ManifestError(f"hostPath {host} ({kind or 'no type'}) does not exist")
                out += ["-v", f"{host}:{target}{read_only}"]
            elif "configMap" in volume:
                directory = self.config_dirs[volume["configMap"]["name"]]
                out += ["-v", f"{directory}:{target}{read_only}"]
            else:
                raise ManifestError(f"volume {mount['name']!r}: kind not rendered: {volume}")
        return out

    @staticmethod
    def _health(container: dict[str, Any]) -> list[str]:
        startup = container.get("startupProbe")
        if startup is None or "exec" not in startup:
            return []
        readiness = container.get("readinessProbe", {})
        period = int(startup.get("periodSeconds", 10))
        return [
            f"--health-cmd={shlex.join(startup['exec']['command'])}",
            f"--health-interval={period}s",
            f"--health-timeout={int(startup.get('timeoutSeconds', 1))}s",
            f"--health-start-period={period * int(startup.get('failureThreshold', 3))}s",
            f"--health-retries={int(readiness.get('failureThreshold', 3))}",
        ]


def prepare_pod(manifest: Path, prefix: str, host_root: Path) -> Pod:
    """The manifest's pod template, its ConfigMaps written under ``host_root/configmaps``."""
    documents = load_documents(manifest)
    pod = Pod(pod_template(documents)["spec"], prefix, host_root)
    for map_name, data in config_maps(documents).items():
        directory = host_root / "configmaps" / map_name
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o755)
        for file_name, text in data.items():
            (directory / file_name).write_text(text)
            (directory / file_name).chmod(0o644)
        pod.config_dirs[map_name] = directory
    return pod
