"""Invalid configuration exits 2 with the key named; nothing is left behind. So do
start-up refusals the operator fixes (a socket or port in use, a directory that
cannot be made): one line, never a traceback. Start-up warnings: unknown KVTIERD_*
variables, a memory budget above the machine's memory or the shm mount. --help
shows each flag's default."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import (
    REPO,
    daemon_command,
    free_port,
    health_status,
    start_daemon,
    write_config,
)
from shm_leftovers import shm_tempdir

from kvtierd.util.units import format_bytes


def run_daemon(*args: str, env: dict[str, str] | None = None, config: str | None = None,
               tmp_path=None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """The daemon run to its end. One that gets past its arguments serves on a socket
    and a shm directory of its own unless ``args`` name them: never the machine's
    default socket (where a daemon may serve) or shm directory (left behind)."""
    cmd = list(args)
    if config is not None:
        path = tmp_path / "kvtierd.toml"
        path.write_text(config)
        cmd = ["--config", str(path), *cmd]
    shm, sockets = shm_tempdir(), tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    if not any(arg.startswith("--listen") for arg in cmd):
        cmd = ["--listen", f"unix://{sockets}/kvtierd.sock", *cmd]
    if not any(arg.startswith("--shm-dir") for arg in cmd):
        cmd = ["--shm-dir", shm, *cmd]
    try:
        return subprocess.run(
            daemon_command(*cmd), capture_output=True, text=True, timeout=60,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--memory-budget", "lots"], ["memory.budget", "8GiB"]),
        (["--memory-budget", "1"], ["memory.budget", "between"]),
        (["--lease", "0s"], ["sessions.lease", "between 0.1s and 3600s"]),
        (["--lease", "ten"], ["sessions.lease", "duration"]),
        (["--default-pool-blocks", "0"], ["memory.default_pool_blocks", "[1, 2147483648]"]),
        (["--max-keys-per-call", "-3"], ["limits.max_keys_per_call"]),
        (["--log-level", "loud"], ["log.level", "debug, info, warning, error"]),
        (["--listen", "tcp-ish"], ["server.listen", "HOST:PORT"]),
        (["--listen", "unix://relative.sock"], ["server.listen", "absolute"]),
        (["--listen", "127.0.0.1:7070"], ["server.listen", "security.tokens_file"]),
        (["--shm-dir", "relative"], ["memory.shm_dir", "absolute"]),
        # above 2 GiB gRPC's send limit (a C int) overflowed: a traceback and exit 1
        (["--events-retained-bytes", "3GiB"], ["limits.events_retained_bytes", "1.0 GiB"]),
        (["--max-watch-streams", "0"], ["limits.max_watch_streams", "[1, 65536]"]),
        (["--watch-write-timeout", "10ms"], ["limits.watch_write_timeout", "between"]),
        (["--write-quarantine", "2h"], ["sessions.write_quarantine", "between 0s and 3600s"]),
        (["--promotion-hold", "soon"], ["limits.promotion_hold", "duration"]),
        # longer than a scheduler step would hold the engine: refused, as a negative wait
        (["--remote-lookup-wait", "2s"], ["limits.remote_lookup_wait", "between 0s and 1s"]),
        (["--remote-lookup-wait=-5ms"], ["limits.remote_lookup_wait: a duration cannot be "
                                         "negative, got '-5ms'; write one between 0s and 1s"]),
        # a negative value after its flag was taken for a flag by argparse
        (["--lease", "-5s"], ["sessions.lease: a duration cannot be negative, got '-5s'; "
                              "write one between 0.1s and 3600s"]),
        (["--max-keys-per-call", "-3.5"], ["limits.max_keys_per_call: expected an integer"]),
        (["--removals-retained-bytes", "1"], ["limits.removals_retained_bytes", "between"]),
        (["--config", "/nonexistent/kvtierd.toml"], ["--config", "no such file"]),
        (["--config", "/"], ["--config: cannot read /: Is a directory"]),
        # sizes are binary; "10GB" was 10,000,000,000 bytes without a word (issue #31)
        (["--memory-budget", "10GB"], ["memory.budget: '10GB': sizes are binary, write "
                                       "'10GiB' (10 x 1073741824 bytes) or 10000000000"]),
        (["--memory-budget", "2Gi"], ["memory.budget: '2Gi': sizes are binary, write '2GiB'"]),
        # a duration needs its unit; lease = "10" was 10 s
        (["--lease", "10"], ["sessions.lease: a duration needs a unit, got '10': write '10s' "
                             "(seconds) or '10ms'"]),
    ],
)  # fmt: skip
def test_bad_flag_exits_2_naming_the_key(args, fragments):
    result = run_daemon(*args)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line, no trace
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_bad_environment_value_names_the_key():
    result = run_daemon(env={"KVTIERD_MEMORY_BUDGET": "12 parsecs"})
    assert result.returncode == 2
    assert "memory.budget" in result.stderr


@pytest.mark.parametrize(
    ("toml", "fragment"),
    [
        # a misspelt name gets "did you mean", as a misspelt environment variable does
        ("[memory]\nbudgt = '1GiB'\n", "memory.budgt: unknown key; did you mean budget? known: "),
        ("[memroy]\n", "memroy: unknown section; did you mean [memory]? known sections: "),
        ("[memory]\nlease = '5s'\n", "memory.lease: unknown key; did you mean sessions.lease?"),
        ("[memory]\nzzz = 1\n", "memory.zzz: unknown key; known: budget, "),
        ("[[security.principal]]\nname = 'a'\n", "unknown key; did you mean principals?"),
        (
            "[[tiers]]\ntype = 'fs'\nroot = '/x'\ncapcity = '1GiB'\n",
            "tiers[0].capcity: unknown fs tier option; known: admission, capacity, ",
        ),
        ("[[tiers]]\ntype = 'fs'\nroot = '/x'\ncapcity = '1GiB'\n", "; did you mean capacity?"),
        ("[sessions]\nlease = true\n", "sessions.lease"),
        ("[memory\n", "not valid TOML"),
        ("[[tiers]]\nroot = '/x'\n", "tiers[0].type: missing"),
        ("[[tiers]]\ntype = 's3'\nroot = '/x'\n", "unsupported tier type 's3'"),
        ("[[tiers]]\ntype = 'redis'\nroot = '/x'\n", "tiers[0].root: unknown redis tier option"),
        ("[[tiers]]\ntype = 'redis'\ncluster = 'yes'\n", "tiers[0].cluster: expected true, false"),
        ("[[tiers]]\ntype = 'redis'\nurls = ['http://x']\n", "tiers[0].urls: expected redis://"),
        ("[[tiers]]\ntype = 'redis'\nttl = 'soon'\n", "tiers[0].ttl"),
        (
            "[[tiers]]\ntype = 'redis'\n[[tiers]]\ntype = 'redis'\n",
            "tiers[1].key_prefix: kvtierd on redis://127.0.0.1:6379 is already another tier's",
        ),
        ("[[tiers]]\ntype = 'fs'\n", "tiers[0].root: missing"),
        ("[[tiers]]\ntype = 'fs'\nroot = 'rel/dir'\n", "tiers[0].root: expected an absolute"),
        ("[[tiers]]\ntype = 'fs'\nroot = '/x'\ncapacity = 'big'\n", "tiers[0].capacity"),
        (
            "[[tiers]]\ntype = 'fs'\nroot = '/x'\ncapacity = '100 GB'\n",
            "tiers[0].capacity: '100 GB': sizes are binary, write '100GiB'",
        ),
        ("[sessions]\nlease = 10\n", "sessions.lease: a duration needs a unit, got 10"),
        # the refusal gives the option's range: "or 0" was suggested, then refused
        (
            "[sessions]\nlease = '-5s'\n",
            "sessions.lease: a duration cannot be negative, got '-5s'; write one between 0.1s "
            "and 3600s",
        ),
        (
            "[sessions]\nlease = 'soon'\n",
            "sessions.lease: expected a duration: a number with ms, s, m (minutes) or h ('500ms', "
            "'10s', '2m'); got 'soon'; write one between 0.1s and 3600s",
        ),
        ("[limits]\nremote_lookup_wait = '1h'\n", "limits.remote_lookup_wait: must be between"),
        ("[memory]\nbudget = '8G'\n", "memory.budget: '8G': sizes are binary, write '8GiB'"),
        (
            "[[tiers]]\ntype = 'redis'\ntimeout = '2'\n",
            "tiers[0].timeout: a duration needs a unit, got '2': write '2s'",
        ),
        ("[[tiers]]\ntype = 'fs'\nroot = '/x'\nthreads = 4\n", "tiers[0].threads: unknown"),
        ("[[tiers]]\ntype = 'fs'\nroot = '/x'\nfsync = 'yes'\n", "tiers[0].fsync"),
        (
            "[[tiers]]\ntype = 'fs'\nroot = '/x'\nio_processes = -1\n",
            "tiers[0].io_processes: expected an integer in [0, 256]",
        ),
        (
            "[[tiers]]\ntype = 'fs'\nroot = '/x'\n[[tiers]]\ntype = 'fs'\nroot = '/x/'\n",
            "tiers[1].root: /x is already another tier's root",
        ),
    ],
)
def test_bad_config_file_exits_2(tmp_path, toml, fragment):
    result = run_daemon(config=toml, tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line, no trace
    assert fragment in result.stderr, result.stderr


def test_flag_overrides_environment_overrides_file(tmp_path):
    from kvtierd.config import load_config

    path = tmp_path / "k.toml"
    path.write_text("[memory]\nbudget = '1GiB'\ndefault_pool_blocks = 7\n")
    env = {"KVTIERD_MEMORY_BUDGET": "2GiB"}
    assert load_config(str(path), env={}).memory.budget == 1 << 30
    assert load_config(str(path), env=env).memory.budget == 2 << 30
    config = load_config(str(path), env=env, overrides={"memory.budget": "3GiB"})
    assert config.memory.budget == 3 << 30 and config.memory.default_pool_blocks == 7


def test_help_documents_every_flag_with_its_default():
    """Each flag with its key, its variable and its default as it would be written
    (the default socket as it is for this user); --listen says it repeats; the tier
    types' options are a list, one item per option (issue #31)."""
    result = run_daemon("--help")
    assert result.returncode == 0
    from kvtierd.config import OPTIONS
    from kvtierd.tiers import registry
    from kvtierd_client.wire.address import default_socket_path

    text = " ".join(result.stdout.split())  # argparse wraps the flags' help
    for option in OPTIONS:
        if option.flag:
            assert option.flag in result.stdout
            assert option.dotted in result.stdout and option.env in result.stdout
            assert f"(default: {option.default_text()}) [{option.dotted}," in text, option
    for shown in (
        f"(default: unix://{default_socket_path()})",
        "(default: 1GiB) [memory.budget,",
        "(default: 10s) [sessions.lease,",
        "(default: 127.0.0.1:9464) [server.metrics_address,",
        "(default: 64KiB) [memory.warm_restart_checksum_bytes,",
        "repeat the flag for several",
        "env KVTIERD_SERVER_LISTEN as A,B]",
    ):
        assert shown in text, shown
    lines = result.stdout.splitlines()
    for tier_type in registry.supported():
        header = lines.index(f'  type = "{tier_type}":')
        keys = [option.key for option in registry.lookup(tier_type).options]
        items = [line for line in lines[header + 1 :] if line.startswith("    - ")]
        assert [item.split(":")[0][len("    - ") :] for item in items][: len(keys)] == keys


def test_missing_fs_root_refuses_to_start_naming_it(tmp_path):
    root = tmp_path / "not-there"
    result = run_daemon(config=f"[[tiers]]\ntype = 'fs'\nroot = '{root}'\n", tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"tiers[0].root: fs tier fs0: root directory {root} does not exist" in result.stderr
    assert not root.exists()


def test_fs_root_that_is_a_file_refuses_to_start(tmp_path):
    root = tmp_path / "a-file"
    root.write_text("")
    result = run_daemon(config=f"[[tiers]]\ntype = 'fs'\nroot = '{root}'\n", tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"root {root} is not a directory" in result.stderr


def test_unwritable_fs_root_refuses_to_start_naming_it(tmp_path):
    """A 0555 directory; as root (mode bits do not stop root) sysfs, where nobody
    may create files."""
    if os.geteuid() == 0:
        root = "/sys"
    else:
        root = str(tmp_path / "read-only")
        os.mkdir(root, mode=0o555)
    result = run_daemon(config=f"[[tiers]]\ntype = 'fs'\nroot = '{root}'\n", tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"tiers[0].root: fs tier fs0: root directory {root} is not writable" in result.stderr


def test_an_fs_root_that_cannot_be_checked_refuses_to_start_naming_it(tmp_path):
    """Its entries cannot be listed or tightened (a traceback and exit 1 before). As
    root: /proc, whose directories root may not chmod; otherwise a 0300 directory."""
    if os.geteuid() == 0:
        root, reason = "/proc", "Operation not permitted"
    else:
        root, reason = str(tmp_path / "unlistable"), "Permission denied"
        os.mkdir(root, mode=0o300)
    result = run_daemon(config=f"[[tiers]]\ntype = 'fs'\nroot = '{root}'\n", tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    assert (
        f"tiers[0].root: fs tier fs0: root directory {root} cannot be checked by this process "
        f"(uid {os.geteuid()}): {reason}"
    ) in result.stderr
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------- start-up refusals
# Problems the operator fixes that are not a bad value (a socket or port in use, a
# directory that cannot be made) exit 2 with one line, like a bad value: no traceback
# (issue #31: two of them printed 25 lines and exited 1).

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


def refusal(*args: str, tmp_path, env: dict[str, str] | None = None) -> str:
    """Runs a daemon on its own socket, shm directory and no metrics (unless ``args``
    say otherwise) that must refuse to start: exit code 2, and besides its log lines
    exactly one line on stderr, which is returned."""
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    sockets = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")  # short: sun_path is 108 bytes
    try:
        result = run_daemon(
            "--listen", f"unix://{sockets}/kvtierd.sock", "--shm-dir", str(shm),
            "--metrics-address", "", "--config", "/dev/null", *args, env=env,
        )  # fmt: skip
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_served_socket_refuses_the_second_daemon_in_one_line(daemon, tmp_path):
    line = refusal("--listen", daemon.address, tmp_path=tmp_path)
    assert line == (
        f"kvtierd: cannot start: server.listen: another process is already serving "
        f"{daemon.socket_path}; stop it first, or give this daemon another listen path"
    )
    assert health_status(daemon) == "SERVING"  # the first one is untouched


def test_a_socket_directory_that_cannot_be_made_is_one_line(tmp_path):
    """As root: sysfs, where nobody may make a directory; otherwise a 0555 directory."""
    if os.geteuid() == 0:
        parent, reason = "/sys", "Operation not permitted"
    else:
        parent, reason = str(tmp_path / "read-only"), "Permission denied"
        os.mkdir(parent, mode=0o555)
    line = refusal("--listen", f"unix://{parent}/kvtierd-nope/k.sock", tmp_path=tmp_path)
    assert line == (
        f"kvtierd: cannot start: server.listen: cannot create socket directory "
        f"{parent}/kvtierd-nope: {reason}; create it for the daemon's user or choose another "
        "listen path"
    )


def test_a_socket_directory_the_daemon_may_not_write_is_one_line(tmp_path):
    """The directory exists but no socket can be made in it (gRPC said only "Failed
    to bind", a traceback). As root: sysfs; otherwise a 0555 directory."""
    if os.geteuid() == 0:
        parent, reason = "/sys", "Operation not permitted"
    else:
        parent, reason = str(tmp_path / "read-only"), "Permission denied"
        os.mkdir(parent, mode=0o555)
    line = refusal("--listen", f"unix://{parent}/kvtierd.sock", tmp_path=tmp_path)
    assert line == (
        f"kvtierd: cannot start: server.listen: cannot listen on unix socket "
        f"{parent}/kvtierd.sock: {reason}; choose another listen path, or one in a directory "
        "the daemon's user may write"
    )


def test_a_file_in_the_way_of_the_socket_directory_is_named(tmp_path):
    (tmp_path / "a-file").write_text("")
    line = refusal("--listen", f"unix://{tmp_path}/a-file/k.sock", tmp_path=tmp_path)
    assert line.endswith(
        f"cannot create socket directory {tmp_path}/a-file: {tmp_path}/a-file exists and is "
        "not a directory; choose another listen path"
    )


def tcp_listen(*args: str, tmp_path) -> str:
    tokens = tmp_path / "tokens"
    tokens.write_text("t0ken-for-config-errors-0123456789\n")
    tokens.chmod(0o600)
    return refusal("--tokens-file", str(tokens), *args, tmp_path=tmp_path)


def test_a_tcp_port_in_use_is_one_line_saying_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        line = tcp_listen("--listen", address, tmp_path=tmp_path)
    assert line == (
        f"kvtierd: cannot start: server.listen: cannot listen on {address}: address already "
        "in use: another process (another kvtierd?) listens there; stop it or choose another port"
    )


def test_a_tcp_address_of_another_host_is_one_line_saying_so(tmp_path):
    line = tcp_listen("--listen", "192.0.2.1:7070", tmp_path=tmp_path)  # TEST-NET-1
    assert line == (
        "kvtierd: cannot start: server.listen: cannot listen on 192.0.2.1:7070: 192.0.2.1 is "
        "not an address of this host"
    )


def test_a_second_daemon_on_the_same_metrics_port_is_told_what_to_do(tmp_path):
    """The default port is the same for every daemon: the second one's refusal says
    that another daemon may run and how to give this one its own port or none."""
    port = free_port()
    first = start_daemon("--metrics-address", f"127.0.0.1:{port}")
    try:
        line = refusal("--metrics-address", f"127.0.0.1:{port}", tmp_path=tmp_path)
        assert health_status(first) == "SERVING"
    finally:
        assert first.stop() == 0
        first.cleanup()
    assert line == (
        f"kvtierd: cannot start: server.metrics_address: cannot listen on 127.0.0.1:{port}: "
        "address already in use; another kvtierd may be running: stop it, or give this daemon "
        "another port (--metrics-address HOST:PORT) or none (--metrics-address '', "
        'server.metrics_address = "")'
    )


# ----------------------------------------------------------------- start-up warnings


def warnings_of(log: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in log.splitlines() if " WARNING " in line]


def test_unknown_kvtierd_variables_are_a_warning_naming_the_closest(tmp_path):
    """A misspelt variable changed nothing without a word (issue #31); the variables
    other programs of the project read are not reported."""
    env = {
        "KVTIERD_MEMORY_BUDGT": "2GiB",
        "KVTIERD_LEASE": "3s",
        "KVTIERD_SOMETHING_ELSE": "1",
        "KVTIERD_ADDRESS": "unix:///elsewhere.sock",  # kvtierctl's and the client's
        "KVTIERD_REPLAY_TRACE": "/nonexistent.jsonl",  # make replay's
        "KVTIERD_BENCH_FS_ROOT": "/var/tmp",  # the benchmarks'
    }
    daemon = start_daemon(env=env)
    try:
        warnings = warnings_of(daemon.log())
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()
    assert [w for w in warnings if "environment variable" in w] == [
        "unknown environment variable KVTIERD_LEASE is ignored; did you mean "
        "KVTIERD_SESSIONS_LEASE?",
        "unknown environment variable KVTIERD_MEMORY_BUDGT is ignored; did you mean "
        "KVTIERD_MEMORY_BUDGET?",
        "unknown environment variable KVTIERD_SOMETHING_ELSE is ignored; the daemon reads "
        "KVTIERD_<SECTION>_<KEY> for the keys kvtierd --help lists",
    ]


# names that look like variables but are not read from the environment (Docker build
# arguments, test constants, the misspelling tested above, which the docs quote in the
# warning it gets)
NOT_ENVIRONMENT = {"KVTIERD_UID", "KVTIERD_GID", "KVTIERD_GROUP", "KVTIERD_MEMORY_BUDGT"}


def test_every_kvtierd_variable_of_the_project_is_known():
    """Each KVTIERD_* name the repository's code, docs and deploy files use is a
    daemon option's variable or listed in OTHER_PROGRAMS_ENVIRONMENT, so adding one
    without listing it fails here rather than warning every operator who sets it."""
    from kvtierd.config import OPTIONS, OTHER_PROGRAMS_ENVIRONMENT

    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    used: dict[str, str] = {}
    for name in filter(None, files):
        path = REPO / os.fsdecode(name)
        if path.suffix in (".py", ".md", ".toml", ".yaml", ".yml", ".service", "") and (
            path.is_file() and path.name != Path(__file__).name
        ):
            for found in re.findall(r"\bKVTIERD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
                used.setdefault(found, str(path.relative_to(REPO)))
    known = {o.env for o in OPTIONS} | set(OTHER_PROGRAMS_ENVIRONMENT) | NOT_ENVIRONMENT
    assert {name: where for name, where in used.items() if name not in known} == {}
    assert set(OTHER_PROGRAMS_ENVIRONMENT) <= set(used)  # none listed that nothing reads


def budget_warnings(log: str) -> list[str]:
    return [w for w in warnings_of(log) if w.startswith("memory.budget")]


def test_a_budget_above_memory_and_shm_is_a_warning_naming_both():
    """1 PiB: more than this machine's memory and its /dev/shm (issue #31: 64 GiB on
    a 24 GiB machine started without a word)."""
    daemon = start_daemon("--memory-budget", "1PiB")
    try:
        log = daemon.log()
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        mount = os.statvfs(daemon.shm_dir)
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()
    assert budget_warnings(log) == [
        f"memory.budget (1024.0 TiB) is more than this machine's memory "
        f"({format_bytes(machine)}) and the size of the file system of {daemon.shm_dir} "
        f"({format_bytes(mount.f_blocks * mount.f_frsize)}): pools are refused (or the "
        "machine runs short of memory) before the budget is reached; lower memory.budget "
        "(--memory-budget)"
    ]


@pytest.fixture
def small_tmpfs(tmp_path) -> Iterator[str]:
    """A 16 MiB tmpfs mounted for the test (root only), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a 16 MiB tmpfs")
    mount_point = tmp_path / "small-shm"
    mount_point.mkdir(mode=0o755)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(mount_point)],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)


def test_a_budget_above_the_shm_mount_only_names_the_mount(small_tmpfs):
    over = start_daemon("--memory-budget", "64MiB", shm_dir=small_tmpfs)
    try:
        over_log = over.log()
    finally:
        assert over.stop() == 0
        over.cleanup()
    assert budget_warnings(over_log) == [
        f"memory.budget (64.0 MiB) is more than the size of the file system of {small_tmpfs} "
        "(16.0 MiB): pools are refused (or the machine runs short of memory) before the "
        "budget is reached; lower memory.budget (--memory-budget)"
    ]
    os.makedirs(small_tmpfs, exist_ok=True)  # cleanup() removed the shm directory
    within = start_daemon("--memory-budget", "8MiB", shm_dir=small_tmpfs)
    try:
        assert budget_warnings(within.log()) == []
    finally:
        assert within.stop() == 0
        within.cleanup()


def test_a_listen_path_too_long_for_the_sockets_next_to_it_is_a_config_error(tmp_path):
    """The daemon binds ``<listen>.regions``, ``.tickets`` and ``.lane`` next to its
    Unix socket; a listen path that fits the kernel's 107 bytes but not with those
    suffixes used to crash the start with a traceback (``AF_UNIX path too long``)
    after the gRPC socket was already bound. It is now refused as a config error
    (exit 2) naming the limit and the path."""
    directory = tempfile.mkdtemp(prefix="kvt-" + "x" * 70, dir="/tmp")
    try:
        path = os.path.join(directory, "k.sock")
        path = path + "s" * (104 - len(path))  # fits sun_path alone, not with ".regions"
        done = subprocess.run(
            [sys.executable, "-m", "kvtierd", "--config", write_config(tmp_path, ""),
             "--listen", "unix://" + path, "--shm-dir", "/dev/shm", "--metrics-address", ""],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "at most 99 bytes" in done.stderr and "Traceback" not in done.stderr
        assert not os.path.exists(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
