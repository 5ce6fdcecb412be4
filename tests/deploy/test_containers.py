"""The container path run for real (``make test-deploy``): the image built from
deploy/docker/Dockerfile, started as the README's "Deploying" shows and as the Kubernetes
manifests declare (their settings rendered into ``docker run`` by tests/k8s_render.py), with
an engine-like container as another user that shares the daemon's /dev/shm and socket and
stores and loads blocks bit-exact through the region.

Each test prints (``-s``) the numbers BENCHMARKS.md reports: image size, container start to
healthy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml
from container_harness import IMAGE, image_size
from k8s_render import Pod, prepare_pod
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent.parent
SIDECAR = REPO / "deploy" / "k8s" / "sidecar.yaml"
DAEMONSET = REPO / "deploy" / "k8s" / "daemonset.yaml"
PROBE_DIR = Path(__file__).resolve().parent
KVTIERD_GROUP = "10001"
ENGINE_USER = "1000:1000"  # any uid but kvtierd's: access comes from the group
BLOCKS = 16
BLOCK_BYTES = 65536  # engine_probe.BLOCK_BYTES


def engine_extras() -> list[str]:
    """What every engine container gets besides its rendered settings: the probe script
    (read-only) and no healthcheck (the image's would ask for a daemon inside it)."""
    return ["-v", f"{PROBE_DIR}:/probe:ro", "--no-healthcheck"]


def sleep_forever() -> list[str]:
    """The engine containers' command: they wait while the test execs the probe in them."""
    return ["sleep", "infinity"]


def metric_samples(text: str) -> dict[str, float]:
    """``{name{labels}: value}`` of a Prometheus text exposition."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def check_clean_stop(containers, daemon: str, engine: str, region: str) -> None:
    """``docker stop`` (SIGTERM): exit 0, the shutdown logged, the region files and the
    socket removed (seen from the engine, which still shares /dev/shm and the socket)."""
    assert containers.stop(daemon) == 0, containers.logs(daemon)
    log = containers.logs(daemon)
    assert "shutdown complete" in log, log
    left = containers.exec(engine, "ls", "-A", os.path.dirname(region)).stdout.split()
    assert os.path.basename(region) not in left, left
    assert not [f for f in left if f.startswith("kvtierd")], left
    sockets = containers.exec(engine, "ls", "-A", "/run/kvtierd").stdout.split()
    assert sockets == [], f"socket files left after shutdown: {sockets}"


def test_readme_layout(containers, docker):
    """The README's two `docker run` lines: the image's own config and HEALTHCHECK, a
    shareable IPC namespace, the socket and state volumes; the engine as uid 1000 in
    group 10001 joined to the daemon's IPC."""
    daemon, engine = f"{containers.prefix}-kvtierd", f"{containers.prefix}-engine"
    run_volume, state_volume = f"{containers.prefix}-run", f"{containers.prefix}-state"
    containers.volumes += [run_volume, state_volume]
    started = time.monotonic()
    containers.run(
        "--name", daemon, "--init", "--ipc=shareable", "--shm-size=1g",
        "-e", "KVTIERD_MEMORY_BUDGET=512MiB",
        "-v", f"{run_volume}:/run/kvtierd", "-v", f"{state_volume}:/var/lib/kvtierd",
        IMAGE,
    )  # fmt: skip
    containers.wait_serving(daemon)
    serving_after = time.monotonic() - started
    containers.wait_healthy(daemon)
    healthy_after = time.monotonic() - started
    print(
        f"\nreadme layout: SERVING {serving_after:.1f} s after docker run, healthy "
        f"{healthy_after:.1f} s (image HEALTHCHECK, interval 10 s); image "
        f"{image_size(docker) / 1e6:.0f} MB"
    )
    containers.run(
        "--name", engine, "--user", ENGINE_USER, "--group-add", KVTIERD_GROUP,
        f"--ipc=container:{daemon}", "-v", f"{run_volume}:/run/kvtierd",
        *engine_extras(), "--entrypoint", "sleep", IMAGE, "infinity",
    )  # fmt: skip
    # kvtierd-health, inside the daemon container, as its HEALTHCHECK runs it
    assert containers.exec(daemon, "kvtierd-health").returncode == 0
    report = containers.probe(engine, "store", "readme/pool", BLOCKS)
    assert report["uid"] == 1000 and int(KVTIERD_GROUP) in report["groups"], report
    assert report["mismatched"] == 0 and report["results"] == ["HIT"] * BLOCKS, report
    assert report["in_fs_tier"] == BLOCKS, report
    # kvtierctl inside the daemon container reaches it through KVTIERD_ADDRESS
    status = containers.exec(daemon, "kvtierctl", "status")
    assert "readme/pool" in status.stdout, status.stdout
    samples = metric_samples(containers.scrape(daemon))
    pool_samples = {k: v for k, v in samples.items() if "pool=readme/pool" in k}
    stored = "kvtierd_stored_bytes_total{pool=readme/pool,tier=%s}"
    assert pool_samples[stored % "primary"] == BLOCKS * BLOCK_BYTES, pool_samples
    # the fs tier counts its files' bytes: each block's header too
    assert pool_samples[stored % "fs"] >= BLOCKS * BLOCK_BYTES, pool_samples
    check_clean_stop(containers, daemon, engine, report["region"])


def _engine_args(pod: Pod, image: str) -> list[str]:
    """The sidecar manifest's engine container, the placeholder vLLM image replaced by
    ours running nothing (the probe is exec'd into it)."""
    args = pod.run_args("engine", image, command=sleep_forever(), args=[])
    return [*engine_extras(), *args]


def test_sidecar_manifest(containers, docker, tmp_path):
    """deploy/k8s/sidecar.yaml rendered: kvtierd read-only, all capabilities dropped, as
    10001:10001 with no privilege escalation, its config from the ConfigMap, its probes as
    the healthcheck; the engine as 1000:1000 with fsGroup 10001, sharing the dshm emptyDir
    (IPC) and the socket emptyDir. Then the daemon restarted on the same state volume: a
    block stored before is a HIT after (promoted from the fs tier), bit-exact."""
    pod = prepare_pod(SIDECAR, containers.prefix, tmp_path)
    containers.volumes += pod.named_volumes()
    daemon, engine = pod.container_name("kvtierd"), pod.container_name("engine")
    daemon_args = pod.run_args("kvtierd", IMAGE)
    for wanted in ("--read-only", "--cap-drop=ALL", "--user", "--ipc=shareable"):
        assert wanted in daemon_args, daemon_args
    started = time.monotonic()
    containers.run(*daemon_args)
    containers.wait_healthy(daemon)
    healthy_s = time.monotonic() - started
    print(
        f"\nsidecar manifest: healthy {healthy_s:.1f} s after docker run (startupProbe "
        "as the healthcheck, every 2 s)"
    )
    containers.run(*_engine_args(pod, IMAGE))
    report = containers.probe(engine, "store", "sidecar/pool", BLOCKS)
    assert report["uid"] == 1000 and 10001 in report["groups"], report
    assert report["mismatched"] == 0 and report["in_fs_tier"] == BLOCKS, report
    assert containers.exec(daemon, "kvtierd-health").returncode == 0
    check_clean_stop(containers, daemon, engine, report["region"])

    # the same container again, on the same volumes: the fs tier is warm
    containers.docker.run("rm", "-f", "-v", engine)
    containers.docker.run("start", daemon)
    containers.wait_healthy(daemon)
    containers.run(*_engine_args(pod, IMAGE))
    again = containers.probe(engine, "load", "sidecar/pool", BLOCKS)
    assert "HIT" not in again["first"], again  # a new region: nothing in the CPU tier yet
    assert again["results"] == ["HIT"] * BLOCKS and again["mismatched"] == 0, again
    samples = metric_samples(containers.scrape(daemon))
    promoted = sum(
        v for k, v in samples.items()
        if k.startswith("kvtierd_hit_blocks_total{") and "sidecar/pool" in k and "tier=fs" in k
    )  # fmt: skip
    assert promoted == BLOCKS, {k: v for k, v in samples.items() if "sidecar/pool" in k}
    assert containers.stop(daemon) == 0, containers.logs(daemon)


def test_daemonset_manifest(containers, docker, tmp_path):
    """deploy/k8s/daemonset.yaml rendered: the prepare-dirs init container (root with
    CHOWN and FOWNER only, read-only) gives the hostPaths to 10001, then kvtierd runs on
    them; an engine pod as the header's snippet shows (same hostPaths, supplementary group
    10001) stores and loads through region files under /dev/shm/kvtierd."""
    pod = prepare_pod(DAEMONSET, containers.prefix, tmp_path)
    containers.volumes += pod.named_volumes()
    init = pod.container_name("prepare-dirs")
    init_args = pod.run_args("prepare-dirs", IMAGE)
    assert "--cap-add=CHOWN" in init_args and "--read-only" in init_args, init_args
    containers.names.append(init)
    done = containers.docker.run("run", *init_args, check=False, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in ("run/kvtierd", "dev/shm/kvtierd", "var/lib/kvtierd"):
        st = os.stat(pod.host_path("/" + path))
        assert (st.st_uid, st.st_gid) == (10001, 10001), (path, st)
    # the ConfigMap's budget is the node's (64 GiB); this machine gets a smaller one
    daemon = pod.container_name("kvtierd")
    containers.run(*pod.run_args("kvtierd", IMAGE, extra_env={"KVTIERD_MEMORY_BUDGET": "1GiB"}))
    containers.wait_healthy(daemon)
    engine_pod = Pod(daemonset_engine_spec(), containers.prefix + "-engine-pod", tmp_path)
    engine = engine_pod.container_name("engine")
    containers.run(
        *engine_extras(),
        *engine_pod.run_args("engine", IMAGE, command=sleep_forever(), args=[], user=ENGINE_USER),
    )
    report = containers.probe(engine, "store", "daemonset/pool", BLOCKS)
    assert report["region"].startswith("/dev/shm/kvtierd/"), report
    assert report["mismatched"] == 0 and report["in_fs_tier"] == BLOCKS, report
    check_clean_stop(containers, daemon, engine, report["region"])


def daemonset_engine_spec() -> dict:
    """The engine pod snippet of daemonset.yaml's header comment, as a pod spec."""
    lines = DAEMONSET.read_text().splitlines()
    start = lines.index("#   spec:")
    body = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        body.append(line[4:])
    return yaml.safe_load("\n".join(body))["spec"]
