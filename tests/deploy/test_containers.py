"""The container path run for real (``make test-deploy``): the image built from
deploy/docker/Dockerfile, started as docs/guides/deployment.md shows and as the Kubernetes
manifests declare (their settings rendered into ``docker run`` by tests/k8s_render.py), with
an engine-like container as another user that shares the daemon's /dev/shm and socket and
stores and loads blocks bit-exact through the region.

Each test prints (``-s``) the numbers docs/benchmarks/current.md reports ("Containers"):
image size, container start to healthy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml
from container_harness import IMAGE, filesystem_type, image_size
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


# What a clean stop leaves in shm_dir with memory.warm_restart on (the default): each pool's
# region file and its journal, for the next daemon to adopt (docs/operations/warm-restart.md).
# Modes as docs/security.md documents them: the region 0660 (group: server.socket_group, the
# daemon's own group 10001 here; no principals are configured), the journal 0600, daemon
# only; both owned by the daemon's user.
KVTIERD_UID = 10001
REGION_MODE = "660"
JOURNAL_MODE = "600"


def shm_listing(containers, container: str, shm_dir: str) -> dict[str, tuple[int, int, str]]:
    """``{name: (uid, gid, octal mode)}`` of every entry of ``shm_dir`` as ``container``
    sees it (``stat``, links not followed)."""
    found = containers.exec(container, "find", shm_dir, "-mindepth", "1", "-maxdepth", "1",
                            "-printf", "%f %U %G %m %y\n").stdout  # fmt: skip
    listing = {}
    for line in found.splitlines():
        name, uid, gid, mode, kind = line.split()
        listing[name] = (int(uid), int(gid), mode if kind == "f" else f"{kind}:{mode}")
    return listing


def expected_warm_files(regions: list[str]) -> dict[str, tuple[int, int, str]]:
    """The files a clean stop keeps for the pools whose region paths are ``regions``."""
    kept = {}
    for region in regions:
        name = os.path.basename(region)
        assert name.endswith(".region"), region
        kept[name] = (KVTIERD_UID, int(KVTIERD_GROUP), REGION_MODE)
        kept[name[: -len(".region")] + ".journal"] = (KVTIERD_UID, int(KVTIERD_GROUP), JOURNAL_MODE)
    return kept


def check_clean_stop(containers, daemon: str, engine: str, regions: list[str]) -> None:
    """``docker stop`` (SIGTERM): exit 0, the shutdown logged, the sockets removed, and in
    shm_dir exactly each pool's region file and journal, kept for a warm restart, with the
    daemon's owner and modes (seen from the engine, which still shares /dev/shm and the
    socket volume)."""
    assert containers.stop(daemon) == 0, containers.logs(daemon)
    log = containers.logs(daemon)
    assert "shutdown complete" in log, log
    shm_dir = os.path.dirname(regions[0])
    assert shm_listing(containers, engine, shm_dir) == expected_warm_files(regions), log
    sockets = containers.exec(engine, "ls", "-A", "/run/kvtierd").stdout.split()
    assert sockets == [], f"socket files left after shutdown: {sockets}"


def labelled(samples: dict[str, float], family: str, **labels: str) -> float:
    """The one sample of ``family`` whose labels include ``labels``; 0 when the daemon
    exposes none (a labelled counter never incremented)."""
    values = []
    for key, value in samples.items():
        name, _, rest = key.partition("{")
        have = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if pair)
        if name == family and labels.items() <= have.items():
            values.append(value)
    assert len(values) <= 1, (family, labels, values)
    return values[0] if values else 0.0


def check_warm_hits(containers, daemon: str, engine: str, pool: str, stored: dict) -> None:
    """After a daemon restart that kept shm_dir: the blocks the engine stored (``stored``:
    its store report) are HITs at the first lookup, bit-exact, from the same region file
    (same inode), adopted by the new daemon and served by the primary tier: no promotion
    from the fs tier, no cold start."""
    again = containers.probe(engine, "load", pool, BLOCKS)
    assert again["first"] == ["HIT"] * BLOCKS and again["mismatched"] == 0, again
    assert (again["region"], again["region_inode"]) == (stored["region"], stored["region_inode"])
    samples = metric_samples(containers.scrape(daemon))
    assert labelled(samples, "kvtierd_warm_adopted_blocks", pool=pool) == BLOCKS, samples
    assert labelled(samples, "kvtierd_hit_blocks_total", tier="primary", pool=pool) >= BLOCKS
    assert labelled(samples, "kvtierd_hit_blocks_total", tier="fs", pool=pool) == 0, samples
    for outcome in ("loaded", "failed"):
        promoted = labelled(samples, "kvtierd_promoted_blocks_total", tier="fs",
                            outcome=outcome, pool=pool)  # fmt: skip
        assert promoted == 0, samples
    assert "starting cold" not in containers.logs(daemon), containers.logs(daemon)


def test_readme_layout(containers, docker):
    """The deployment guide's two `docker run` lines (docs/guides/deployment.md): the
    image's own config and HEALTHCHECK, a shareable IPC namespace, the socket and state
    volumes; the engine as uid 1000 in group 10001 joined to the daemon's IPC."""
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
    check_clean_stop(containers, daemon, engine, [report["region"]])


def test_readme_host_shm_layout(containers, docker, host_tmpfs):
    """The deployment guide's docker layout that keeps the CPU tier across ``docker
    restart``: the regions in a directory of the host's /dev/shm (2750, 10001:10001) bind-mounted at
    /dev/shm/kvtierd into the daemon (``memory.shm_dir`` set through the environment) and
    the engine, no IPC namespace shared. The daemon restarted with ``docker restart``
    (SIGTERM, clean stop, start): the engine, which kept running, finds its blocks adopted
    (warm restart), not promoted from the fs tier."""
    shm = host_tmpfs / "kvtierd"
    shm.mkdir()
    os.chown(shm, KVTIERD_UID, int(KVTIERD_GROUP))
    shm.chmod(0o2750)
    daemon, engine = f"{containers.prefix}-kvtierd", f"{containers.prefix}-engine"
    run_volume, state_volume = f"{containers.prefix}-run", f"{containers.prefix}-state"
    containers.volumes += [run_volume, state_volume]
    containers.run(
        "--name", daemon, "--init", "-e", "KVTIERD_MEMORY_SHM_DIR=/dev/shm/kvtierd",
        "-e", "KVTIERD_MEMORY_BUDGET=512MiB", "-v", f"{shm}:/dev/shm/kvtierd",
        "-v", f"{run_volume}:/run/kvtierd", "-v", f"{state_volume}:/var/lib/kvtierd",
        IMAGE,
    )  # fmt: skip
    containers.wait_serving(daemon)
    containers.run(
        "--name", engine, "--user", ENGINE_USER, "--group-add", KVTIERD_GROUP,
        "-v", f"{shm}:/dev/shm/kvtierd", "-v", f"{run_volume}:/run/kvtierd",
        *engine_extras(), "--entrypoint", "sleep", IMAGE, "infinity",
    )  # fmt: skip
    report = containers.probe(engine, "store", "hostshm/pool", BLOCKS)
    assert report["region"].startswith("/dev/shm/kvtierd/"), report
    assert report["mismatched"] == 0 and report["in_fs_tier"] == BLOCKS, report
    started = time.monotonic()
    containers.docker.run("restart", "-t", "60", daemon, timeout=180)
    containers.wait_serving(daemon)
    print(
        f"\nhost shm layout: SERVING again {time.monotonic() - started:.1f} s after docker restart"
    )
    assert "shutdown complete" in containers.logs(daemon), containers.logs(daemon)
    assert shm_listing(containers, engine, "/dev/shm/kvtierd") == expected_warm_files(
        [report["region"]]
    )
    check_warm_hits(containers, daemon, engine, "hostshm/pool", report)
    check_clean_stop(containers, daemon, engine, [report["region"]])


def _engine_args(pod: Pod, image: str) -> list[str]:
    """The sidecar manifest's engine container, the placeholder vLLM image replaced by
    ours running nothing (the probe is exec'd into it)."""
    args = pod.run_args("engine", image, command=sleep_forever(), args=[])
    return [*engine_extras(), *args]


def test_sidecar_manifest(containers, docker, tmp_path):
    """deploy/k8s/sidecar.yaml rendered: kvtierd read-only, all capabilities dropped, as
    10001:10001 with no privilege escalation, its config from the ConfigMap, its probes as
    the healthcheck; the engine as 1000:1000 with fsGroup 10001, sharing the dshm emptyDir
    (IPC) and the socket emptyDir. Then the daemon container restarted on the same state
    volume: docker's /dev/shm does not survive it (the kept region is gone), so a block
    stored before is a HIT after, promoted from the fs tier, bit-exact."""
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
    check_clean_stop(containers, daemon, engine, [report["region"]])

    # The same container started again, on the same volumes. docker gives a container's
    # own /dev/shm (--ipc=shareable, the dshm emptyDir rendered) a new, empty tmpfs at every
    # start: the kept region and journal are gone (the engine joined to the old IPC
    # namespace still sees them: it must be restarted too), so the pool starts cold and
    # the fs tier, which is on the state volume, serves the blocks.
    containers.docker.run("rm", "-f", "-v", engine)
    containers.docker.run("start", daemon)
    containers.wait_healthy(daemon)
    # the daemon made its shm_dir again (deploy/k8s/sidecar.yaml: /dev/shm/kvtierd), empty
    assert shm_listing(containers, daemon, "/dev/shm/kvtierd") == {}, containers.logs(daemon)
    containers.run(*_engine_args(pod, IMAGE))
    again = containers.probe(engine, "load", "sidecar/pool", BLOCKS)
    assert "HIT" not in again["first"], again  # a new region: nothing in the CPU tier yet
    assert again["results"] == ["HIT"] * BLOCKS and again["mismatched"] == 0, again
    samples = metric_samples(containers.scrape(daemon))
    pool = {"pool": "sidecar/pool"}
    assert labelled(samples, "kvtierd_warm_adopted_blocks", **pool) == 0, samples
    assert labelled(samples, "kvtierd_hit_blocks_total", tier="fs", **pool) == BLOCKS, samples
    promoted = labelled(samples, "kvtierd_promoted_blocks_total", tier="fs", outcome="loaded",
                        **pool)  # fmt: skip
    assert promoted == BLOCKS, samples
    assert containers.stop(daemon) == 0, containers.logs(daemon)


def test_daemonset_manifest(containers, docker, host_tmpfs):
    """deploy/k8s/daemonset.yaml rendered: the prepare-dirs init container (root with
    CHOWN and FOWNER only, read-only) gives the hostPaths to 10001, then kvtierd runs on
    them; an engine pod as the header's snippet shows (same hostPaths, supplementary group
    10001) stores and loads through region files under /dev/shm/kvtierd. Then the daemon
    pod replaced: the region files on the node's tmpfs survive, and the blocks are HITs
    again from the adopted region (warm restart), not promoted from the fs tier."""
    # the hostPaths live under a directory of this machine's /dev/shm: /dev/shm/kvtierd is
    # on a tmpfs, as on a node, and the fs tier's few blocks fit there too
    pod = prepare_pod(DAEMONSET, containers.prefix, host_tmpfs)
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
    assert filesystem_type(pod.host_path("/dev/shm/kvtierd")) == "tmpfs"
    engine_pod = Pod(daemonset_engine_spec(), containers.prefix + "-engine-pod", host_tmpfs)
    engine = engine_pod.container_name("engine")
    containers.run(
        *engine_extras(),
        *engine_pod.run_args("engine", IMAGE, command=sleep_forever(), args=[], user=ENGINE_USER),
    )
    report = containers.probe(engine, "store", "daemonset/pool", BLOCKS)
    assert report["region"].startswith("/dev/shm/kvtierd/"), report
    assert report["mismatched"] == 0 and report["in_fs_tier"] == BLOCKS, report
    check_clean_stop(containers, daemon, engine, [report["region"]])
    kept = shm_listing(containers, engine, "/dev/shm/kvtierd")

    # The daemon pod replaced (prepare-dirs again, a new daemon container on the same
    # hostPaths; the engine pod keeps running): /dev/shm/kvtierd is a directory of the
    # node's tmpfs, so the region and its journal are still there and the new daemon
    # adopts the pool when the engine reopens it. The blocks are HITs at the first lookup,
    # bit-exact, from the same region file (same inode), served by the primary tier:
    # nothing promoted from the fs tier.
    containers.docker.run("rm", "-f", "-v", daemon)
    containers.names.remove(daemon)
    containers.docker.run("rm", "-f", init)  # a new pod runs its init container again
    done = containers.docker.run("run", *init_args, check=False, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    containers.run(*pod.run_args("kvtierd", IMAGE, extra_env={"KVTIERD_MEMORY_BUDGET": "1GiB"}))
    containers.wait_healthy(daemon)
    assert shm_listing(containers, engine, "/dev/shm/kvtierd") == kept  # pools open lazily
    check_warm_hits(containers, daemon, engine, "daemonset/pool", report)
    check_clean_stop(containers, daemon, engine, [report["region"]])


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
