"""The deployment files under deploy/ (docker, k8s, prometheus, grafana), checked without
docker or a cluster: every metric a dashboard panel or an alert queries is one a live
daemon exposes (with the labels and label values used), the configs they ship load, and
the manifests keep their security properties."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import REPO, DaemonProcess, fs_tiers_config, start_daemon, wait_tier_jobs
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.config import Config, load_config
from kvtierd_client.client import Client

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvtierd-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKER_CONFIG = DEPLOY / "docker" / "kvtierd.toml"
HEALTH = DEPLOY / "docker" / "kvtierd-health"
SIDECAR = DEPLOY / "k8s" / "sidecar.yaml"
DAEMONSET = DEPLOY / "k8s" / "daemonset.yaml"
SOCKET = "unix:///run/kvtierd/kvtierd.sock"
BLOCK = 8192
# labels Prometheus itself attaches to every scraped series
TARGET_LABELS = {"instance", "job"}


# ------------------------------------------------------------------ helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _block_scalar(text: str, key_pattern: str) -> str:
    """The value of the first YAML key matching ``key_pattern`` (a ``|`` or ``>-`` block,
    or an inline scalar): enough YAML for these files without a YAML parser."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        match = re.match(rf"^(\s*)(?:- )?{key_pattern}\s*(.*)$", line)
        if match is None:
            continue
        indent, rest = len(match.group(1)), match.group(2).strip()
        if rest not in ("|", ">-", ">", "|-"):
            return rest
        body: list[str] = []
        for follow in lines[index + 1 :]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                break
            body.append(follow)
        block = [b.strip() for b in body] if rest.startswith(">") else body
        if rest.startswith(">"):
            return " ".join(b for b in block if b)
        width = min(len(b) - len(b.lstrip()) for b in body if b.strip())
        return "\n".join(b[width:] for b in body) + "\n"
    raise AssertionError(f"no key matching {key_pattern!r}")


def _alert_rules() -> list[tuple[str, str]]:
    """(alert name, expr) of every rule in alerts.yml."""
    text = ALERTS.read_text()
    chunks = re.split(r"(?m)^\s*- alert:\s*", text)[1:]
    rules = []
    for chunk in chunks:
        name = chunk.splitlines()[0].strip()
        rules.append((name, _block_scalar(chunk.split("\n", 1)[1], r"expr:")))
    return rules


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _dashboard_queries() -> list[str]:
    dashboard = _dashboard()
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"]]
    return queries


def _all_queries() -> list[str]:
    return _dashboard_queries() + [expr for _, expr in _alert_rules()]


# ------------------------------------------------------------------ the live daemon


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> Iterator[dict[str, dict[str, set[str]]]]:
    """{sample name: {label: values seen}} scraped from a daemon with an fs tier, after a
    store (cascaded to the tier), lookups, a flush and a promotion, so per-pool, per-tier
    and histogram series all exist."""
    root = tmp_path_factory.mktemp("fs")
    port = _free_port()
    daemon = start_daemon("--metrics-address", f"127.0.0.1:{port}", config=fs_tiers_config(root))
    try:
        pool = "deploy/metrics"
        keys = [f"d{i}".encode() for i in range(4)]
        with Client(daemon.address) as client:
            session = client.open_session(pool, block_bytes=BLOCK, num_blocks=8)
            session.prepare_store(keys)
            session.complete_store(keys)
            wait_tier_jobs(daemon.stub(), pool)
            session.lookup([*keys, b"absent"])
            client.flush_pool(pool)
            session.lookup(keys)  # promotions from the fs tier
            wait_tier_jobs(daemon.stub(), pool)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
        samples: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = samples[sample.name]
                for label, value in sample.labels.items():
                    labels[label].add(value)
        yield {name: dict(labels) for name, labels in samples.items()}
        _stop(daemon)
    finally:
        daemon.cleanup()


def _stop(daemon: DaemonProcess) -> None:
    assert daemon.stop() == 0, daemon.log()


def test_every_queried_metric_is_exposed(exposed):
    queried = {name for q in _all_queries() for name in re.findall(r"\bkvtierd_\w+", q)}
    assert len(queried) >= 25, sorted(queried)
    missing = sorted(queried - set(exposed))
    assert not missing, f"queried but not exposed by the daemon: {missing}"
    # histograms are queried through their buckets
    assert "kvtierd_rpc_duration_seconds_bucket" in queried
    assert "kvtierd_tier_job_duration_seconds_bucket" in queried


def test_queried_labels_and_values_exist(exposed):
    every_label = {label for labels in exposed.values() for label in labels} | TARGET_LABELS
    checked: list[str] = []
    for query in _all_queries():
        for name, matchers in re.findall(r"\b(kvtierd_\w+)\s*\{([^}]*)\}", query):
            for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
                if label in TARGET_LABELS:
                    continue
                assert label in exposed[name], f"{name} has no label {label!r}: {query}"
                checked.append(f"{name}{{{label}}}")
                if op == "=" and "$" not in value:
                    seen = exposed[name][label]
                    assert value in seen, f"{name}{{{label}={value!r}}} never exposed: {seen}"
                if op == "=~" and "$" not in value:
                    for alternative in value.split("|"):
                        assert alternative in exposed[name][label], (name, label, alternative)
        for group in re.findall(r"\bby\s*\(([^)]*)\)", query):
            for label in (g.strip() for g in group.split(",")):
                assert label in every_label | {"le"}, f"by ({label}) is no label: {query}"
                checked.append(f"by ({label})")
    # the dashboard and alerts select by pool, tier, method and code: none may slip by
    # unread because the patterns above stopped matching the files
    assert {"by (pool)", "by (tier)"} <= set(checked), sorted(set(checked))
    assert len(checked) >= 20, sorted(set(checked))


def test_health_script_answers_for_the_daemon(tmp_path: Path):
    daemon = start_daemon()
    try:
        run = [sys.executable, str(HEALTH)]
        ok = subprocess.run([*run, daemon.address], capture_output=True, text=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
        env_ok = subprocess.run(
            run, capture_output=True, text=True, timeout=30,
            env={**os.environ, "KVTIERD_ADDRESS": daemon.address},
        )  # fmt: skip
        assert env_ok.returncode == 0, env_ok.stderr
        _stop(daemon)
    finally:
        daemon.cleanup()
    dead = subprocess.run(
        [*run, str(tmp_path / "none.sock"), "--timeout", "1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert dead.returncode == 1
    assert "UNAVAILABLE" in dead.stderr


# ------------------------------------------------------------------ grafana


def test_dashboard_is_importable_and_has_the_panels():
    dashboard = _dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"pool", "tier"} <= set(variables)
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    for variable in variables.values():
        assert variable["datasource"]["uid"] == "${DS_PROMETHEUS}"
    titles = {p["title"]: p for p in panels}
    for wanted in (
        "Hit rate per tier",
        "Blocks used vs capacity per tier",
        "Bytes/s stored per tier",
        "Bytes/s loaded per tier",
        "RPC latency p50 / p99 per method",
        "Tier job duration p50 / p99",
        "Checksum failures",
        "Promotion failures",
        "Dropped writes (backpressure)",
        "RPC errors by code",
        "Sessions open",
        "Shared memory used vs budget",
        "Remote nodes reachable / known",
        "Remote round trip and probe failures",
        "Remote server memory",
    ):
        assert wanted in titles, wanted
    latency = " ".join(t["expr"] for t in titles["RPC latency p50 / p99 per method"]["targets"])
    assert "histogram_quantile(0.5," in latency
    assert "histogram_quantile(0.99," in latency
    assert "kvtierd_rpc_duration_seconds_bucket" in latency
    per_tier = " ".join(t["expr"] for t in titles["Hit rate per tier"]["targets"])
    assert 'pool=~"$pool"' in per_tier
    assert 'tier=~"$tier"' in per_tier


# ------------------------------------------------------------------ prometheus


def test_prometheus_scrape_config_and_alerts():
    scrape = SCRAPE.read_text()
    assert "job_name: kvtierd" in scrape
    assert '"127.0.0.1:9464"' in scrape
    assert "alerts.yml" in scrape
    assert "kubernetes_sd_configs" in scrape
    rules = dict(_alert_rules())
    for wanted in (
        "KvtierdDown",
        "KvtierdChecksumFailures",
        "KvtierdDroppedWrites",
        "KvtierdPromotionFailures",
        "KvtierdHitRateCollapse",
        "KvtierdEventLoopStalls",
        "KvtierdQuarantinedRows",
    ):
        assert wanted in rules, wanted
    assert 'up{job="kvtierd"}' in rules["KvtierdDown"]
    assert "kvtierd_checksum_failures_total" in rules["KvtierdChecksumFailures"]
    assert "kvtierd_dropped_writes_total" in rules["KvtierdDroppedWrites"]
    assert 'outcome="failed"' in rules["KvtierdPromotionFailures"]
    assert "kvtierd_lookups_total" in rules["KvtierdHitRateCollapse"]
    assert "kvtierd_event_loop_lag_seconds_bucket" in rules["KvtierdEventLoopStalls"]
    assert "kvtierd_quarantined_blocks" in rules["KvtierdQuarantinedRows"]
    assert len(rules) == ALERTS.read_text().count("- alert:")


# ------------------------------------------------------------------ docker


def test_docker_config_loads():
    config = load_config(str(DOCKER_CONFIG), env={})
    assert config.server.listen == (SOCKET,)
    assert config.memory.shm_dir == "/dev/shm/kvtierd"  # private, made by the daemon
    assert config.server.metrics_address == "0.0.0.0:9464"
    assert [t.settings.root for t in config.tiers] == ["/var/lib/kvtierd/fs"]
    assert config.tiers[0].settings.create_root


def test_dockerfile():
    text = DOCKERFILE.read_text()
    assert re.search(r"(?m)^FROM \$\{PYTHON_IMAGE\} AS build$", text)
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert 'ENTRYPOINT ["kvtierd"]' in text
    assert "COPY --chmod=0644 deploy/docker/kvtierd.toml /etc/kvtierd/kvtierd.toml" in text
    assert 'VOLUME ["/run/kvtierd", "/var/lib/kvtierd"]' in text
    assert re.search(r"(?m)^HEALTHCHECK .*\n\s+CMD \[\"kvtierd-health\"", text)
    user = re.search(r"(?m)^USER (\S+)$", text)
    assert user is not None and not user.group(1).startswith(("0", "root"))
    assert "ARG KVTIERD_UID=10001" in text
    # the image installs no extras (torch lives in `client` / `dev`) ...
    assert re.search(r"pip install \.;", text)
    assert "[dev]" not in text and "[client]" not in text
    # ... and gets the stubs from the build hook (setup.py + tools/gen_stubs.py, as every
    # wheel does), not from a protoc run of its own
    for copied in ("setup.py", "MANIFEST.in", "tools/gen_stubs.py", "proto/"):
        assert re.search(rf"(?m)^COPY .*{re.escape(copied)}", text), copied
    assert "grpc_tools.protoc" not in text
    # a machine's pip settings come as a build secret, none are written into the file
    assert "RUN --mount=type=secret,id=pip.conf,required=false" in text
    assert not re.search(r"(?i)index-url|PIP_INDEX|https?_proxy|trusted-host", text)
    assert not re.search(r"pip install .*grpcio-tools", text)
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert "client/kvtierd_client/_proto" in ignored
    assert ".venv*" in ignored and ".git" in ignored


# ------------------------------------------------------------------ kubernetes


@pytest.mark.parametrize("manifest", [SIDECAR, DAEMONSET], ids=lambda p: p.name)
def test_k8s_manifest_security(manifest: Path):
    text = manifest.read_text()
    assert "apiVersion: apps/v1" in text
    assert not re.search(r"(?m)^\s*privileged:\s*true", text)
    assert not re.search(r"(?m)^\s*host(IPC|PID|Network):\s*true", text)
    assert re.search(r"(?m)^\s*hostIPC:\s*false", text)
    # every container (kvtierd, the engine, init containers) states privileged: false
    containers = len(re.findall(r"(?m)^\s+- name: [\w-]+\n\s+image:", text))
    assert containers >= 2
    assert len(re.findall(r"(?m)^\s*privileged:\s*false", text)) == containers
    assert len(re.findall(r'(?m)^\s*drop: \["ALL"\]', text)) == containers
    assert len(re.findall(r"(?m)^\s*allowPrivilegeEscalation:\s*false", text)) == containers
    assert "readOnlyRootFilesystem: true" in text
    assert 'command: ["kvtierd-health"' in text
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in text
    assert 'prometheus.io/scrape: "true"' in text
    assert 'prometheus.io/port: "9464"' in text
    # the embedded configuration loads and serves the shared socket
    config = load_config_text(_block_scalar(text, r"kvtierd\.toml:"))
    assert config.server.listen == (SOCKET,)
    assert config.server.metrics_address == "0.0.0.0:9464"


def test_sidecar_shares_shm_and_socket():
    text = SIDECAR.read_text()
    assert re.search(r"(?m)^\s*medium: Memory\n\s*sizeLimit: \d+Gi", text)
    assert len(re.findall(r"(?m)^\s*mountPath: /dev/shm$", text)) == 2
    assert len(re.findall(r"(?m)^\s*mountPath: /run/kvtierd$", text)) == 3
    # an emptyDir is 0777: the socket's directory is made kvtierd's before it starts
    # (kvtierd serves only in a directory no other user may write)
    initial = re.findall(r"(?m)^        - name: (\S+)$", text.split("initContainers:", 1)[1])
    assert initial[:2] == ["prepare-dirs", "kvtierd"], initial
    assert 'args: ["chown 10001:10001 /run/kvtierd && chmod 2750 /run/kvtierd"]' in text
    assert "runAsNonRoot: true" in text
    assert "fsGroup: 10001" in text
    assert "image: vllm/vllm-openai:latest" in text
    transfer = json.loads(_folded_item(text.split("- --kv-transfer-config", 1)[1]))
    extra = transfer["kv_connector_extra_config"]
    assert transfer["kv_connector"] == "OffloadingConnector"
    assert extra["spec_name"] == "KvtierdOffloadingSpec"
    assert extra["spec_module_path"] == "kvtierd_client.vllm"
    assert extra["kvtierd_address"] == SOCKET
    # the plug-in knows every other key (its settings module needs vLLM to import: read it)
    plugin = (REPO / "client" / "kvtierd_client" / "vllm" / "settings.py").read_text()
    for key in set(extra) - {"spec_name", "spec_module_path"}:
        assert f'"{key}"' in plugin, key
    for resources in ("requests:", "limits:"):
        assert text.count(resources) >= 2
    config = load_config_text(_block_scalar(text, r"kvtierd\.toml:"))
    assert config.memory.shm_dir == "/dev/shm/kvtierd"  # private, made by the daemon


def test_daemonset_uses_host_paths():
    text = DAEMONSET.read_text()
    assert "kind: DaemonSet" in text
    assert re.search(r"(?m)^\s*hostPath:\n\s*path: /run/kvtierd\n", text)
    assert re.search(r"(?m)^\s*hostPath:\n\s*path: /dev/shm/kvtierd\n", text)
    assert re.search(r"(?m)^\s*hostPath:\n\s*path: /var/lib/kvtierd\n", text)
    config = load_config_text(_block_scalar(text, r"kvtierd\.toml:"))
    assert config.memory.shm_dir == "/dev/shm/kvtierd"
    assert config.tiers[0].settings.root == "/var/lib/kvtierd/fs"
    # the note tells engine pods how to mount the same paths
    assert "supplementalGroups: [10001]" in text
    assert "{name: kvtierd-shm, mountPath: /dev/shm/kvtierd}" in text


def load_config_text(toml_text: str) -> Config:
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as handle:
        handle.write(toml_text)
        handle.flush()
        return load_config(handle.name, env={})


def _folded_item(after: str) -> str:
    """The ``>-`` folded list item that follows a flag in an args list."""
    lines = after.splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.strip() == "- >-")
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line.strip())
    return " ".join(b for b in body if b)


# ------------------------------------------------------------------ rendered for docker


def test_manifests_render_to_the_settings_tests_deploy_runs(tmp_path: Path):
    """tests/deploy runs the containers tests/k8s_render.py renders from these manifests;
    here, without docker, what the rendering gives: the settings the docs promise."""
    from k8s_render import prepare_pod

    sidecar = prepare_pod(SIDECAR, "p", tmp_path / "sidecar")
    daemon = sidecar.run_args("kvtierd", "IMAGE")
    for wanted in ("--read-only", "--cap-drop=ALL", "--ipc=shareable", "no-new-privileges"):
        assert wanted in daemon, daemon
    assert daemon[daemon.index("--user") + 1] == "10001:10001"
    assert "--shm-size=21474836480" in daemon  # the dshm emptyDir's sizeLimit: 20Gi
    assert "--cap-add" not in " ".join(daemon)
    assert f"{tmp_path}/sidecar/configmaps/kvtierd-config:/etc/kvtierd:ro" in daemon
    assert "--health-cmd=kvtierd-health --timeout 3" in daemon
    engine = sidecar.run_args("engine", "IMAGE", command=["sleep", "infinity"], args=[])
    assert engine[engine.index("--user") + 1] == "1000:1000"
    assert engine[engine.index("--group-add") + 1] == "10001"  # fsGroup
    assert "--ipc=container:p-kvtierd" in engine and "--cap-drop=ALL" in engine
    assert "p-kvtierd-run:/run/kvtierd" in engine  # the socket emptyDir, shared

    daemonset = prepare_pod(DAEMONSET, "d", tmp_path / "daemonset")
    init = daemonset.run_args("prepare-dirs", "IMAGE")
    assert init[init.index("--user") + 1] == "0:0"
    assert [a for a in init if a.startswith("--cap-")] == [
        "--cap-drop=ALL", "--cap-add=CHOWN", "--cap-add=FOWNER",
    ]  # fmt: skip
    node = daemonset.run_args("kvtierd", "IMAGE")
    assert "--read-only" in node and "--cap-drop=ALL" in node
    assert f"{tmp_path}/daemonset/dev/shm/kvtierd:/dev/shm/kvtierd" in node
    assert "--ipc=shareable" not in node  # regions on the node's tmpfs, no IPC sharing


def _render_every_container(pod: Any) -> None:
    for name in pod.containers:
        pod.run_args(name, "IMAGE")


def test_rendering_refuses_what_no_manifest_may_ask(tmp_path: Path):
    """A privileged container, a host namespace or runAsNonRoot as uid 0 is not turned
    into docker arguments: the rendering fails, naming it."""
    from k8s_render import ManifestError, prepare_pod

    text = SIDECAR.read_text()
    for change, complaint in (
        (("privileged: false", "privileged: true"), "privileged"),
        (("hostIPC: false", "hostIPC: true"), "hostIPC"),
        (("runAsUser: 10001", "runAsUser: 0"), "runAsNonRoot"),
    ):
        manifest = tmp_path / f"{complaint}.yaml"
        manifest.write_text(text.replace(*change, 1))
        pod = prepare_pod(manifest, "p", tmp_path / complaint)
        with pytest.raises(ManifestError, match=complaint):  # whichever container it hit
            _render_every_container(pod)


DEPLOYMENT = REPO / "docs" / "guides" / "deployment.md"


def _section(title: str) -> str:
    """One ``## title`` section of the deployment guide."""
    return DEPLOYMENT.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_docs_docker_run_lines_are_the_ones_tests_deploy_runs():
    """tests/deploy/test_containers.py::test_readme_layout runs the deployment guide's two
    `docker run` lines (with a smaller shm and budget, and names of its own): the options it
    relies on are the guide's."""
    block = _section("Containers").split("```sh", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    daemon_line, engine_line = [line for line in block.splitlines() if "docker run" in line]
    for option in ("--init", "--ipc=shareable", "--shm-size=", "KVTIERD_MEMORY_BUDGET=",
                   "-v kvtierd-run:/run/kvtierd", "-v kvtierd-state:/var/lib/kvtierd"):  # fmt: skip
        assert option in daemon_line, option
    for option in ("--ipc=container:kvtierd", "--group-add 10001", "-v kvtierd-run:/run/kvtierd"):
        assert option in engine_line, option
    test = (REPO / "tests" / "deploy" / "test_containers.py").read_text()
    for option in ('"--init"', '"--ipc=shareable"', '"--group-add", KVTIERD_GROUP',
                   'f"--ipc=container:{daemon}"'):  # fmt: skip
        assert option in test, option


def test_docs_host_shm_lines_are_the_ones_tests_deploy_runs():
    """tests/deploy/test_containers.py::test_readme_host_shm_layout runs the deployment
    guide's second `docker run` pair (the regions on the host's /dev/shm, kept across
    `docker restart`): the options it relies on are the guide's."""
    restarts = _section("Restarts and the CPU tier")
    block = restarts.split("```sh", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    assert "install -d -m 2750 -o 10001 -g 10001 /dev/shm/kvtierd" in block
    daemon_line, engine_line = [line for line in block.splitlines() if "docker run" in line]
    for option in ("--init", "-e KVTIERD_MEMORY_SHM_DIR=/dev/shm/kvtierd",
                   "-v /dev/shm/kvtierd:/dev/shm/kvtierd", "-v kvtierd-run:/run/kvtierd",
                   "-v kvtierd-state:/var/lib/kvtierd"):  # fmt: skip
        assert option in daemon_line, option
    assert "--ipc" not in daemon_line + engine_line  # the files are shared, not the namespace
    for option in ("--group-add 10001", "-v /dev/shm/kvtierd:/dev/shm/kvtierd",
                   "-v kvtierd-run:/run/kvtierd"):  # fmt: skip
        assert option in engine_line, option
    test = (REPO / "tests" / "deploy" / "test_containers.py").read_text()
    for option in ('"KVTIERD_MEMORY_SHM_DIR=/dev/shm/kvtierd"', 'f"{shm}:/dev/shm/kvtierd"',
                   "shm.chmod(0o2750)", '"restart"'):  # fmt: skip
        assert option in test, option
