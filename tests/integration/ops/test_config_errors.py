"""Invalid configuration exits 2 with the key named; nothing is left behind."""

from __future__ import annotations

import os
import subprocess

import pytest
from daemon_harness import daemon_command


def run_daemon(*args: str, env: dict[str, str] | None = None, config: str | None = None,
               tmp_path=None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    cmd = list(args)
    if config is not None:
        path = tmp_path / "kvtierd.toml"
        path.write_text(config)
        cmd = ["--config", str(path), *cmd]
    return subprocess.run(
        daemon_command(*cmd), capture_output=True, text=True, timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


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
        (["--removals-retained-bytes", "1"], ["limits.removals_retained_bytes", "between"]),
        (["--config", "/nonexistent/kvtierd.toml"], ["--config", "no such file"]),
    ],
)
def test_bad_flag_exits_2_naming_the_key(args, fragments):
    result = run_daemon(*args)
    assert result.returncode == 2, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_bad_environment_value_names_the_key():
    result = run_daemon(env={"KVTIERD_MEMORY_BUDGET": "12 parsecs"})
    assert result.returncode == 2
    assert "memory.budget" in result.stderr


@pytest.mark.parametrize(
    ("toml", "fragment"),
    [
        ("[memory]\nbudgt = '1GiB'\n", "memory.budgt: unknown key"),
        ("[memroy]\n", "memroy: unknown section"),
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


def test_help_documents_every_flag():
    result = run_daemon("--help")
    assert result.returncode == 0
    from kvtierd.config import OPTIONS

    for option in OPTIONS:
        if option.flag:
            assert option.flag in result.stdout
            assert option.dotted in result.stdout and option.env in result.stdout


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
