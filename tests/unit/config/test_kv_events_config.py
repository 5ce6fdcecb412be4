"""``[kv_events]``: off by default, an endpoint needs its pools, and with principals
every published pool belongs to the one principal named (no principal's prompts on
an endpoint another reads)."""

from __future__ import annotations

import pytest

from kvtierd.config import ConfigError, load_config


def config(tmp_path, text: str):  # noqa: ANN001, ANN201
    path = tmp_path / "kvtierd.toml"
    path.write_text(text)
    return load_config(str(path), env={})


def test_off_by_default(tmp_path):
    events = config(tmp_path, "").kv_events
    assert not events.enabled and events.pools == () and events.endpoint == ""


def test_an_endpoint_without_pools_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="kv_events.pools: name the pools to publish"):
        config(tmp_path, '[kv_events]\nendpoint = "tcp://127.0.0.1:5557"\n')


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("tcp://127.0.0.1", "expected '', 'tcp://HOST:PORT' or 'ipc:///abs/path'"),
        ("ipc://relative", "expected ipc:///abs/path"),
        ("udp://1.2.3.4:5", "expected '', 'tcp://HOST:PORT'"),
    ],
)
def test_bad_endpoints_say_what_to_write(tmp_path, endpoint, message):
    with pytest.raises(ConfigError, match=f"kv_events.endpoint: {message}"):
        config(tmp_path, f'[kv_events]\nendpoint = "{endpoint}"\npools = ["a"]\n')


def test_a_topic_part_cannot_hold_the_separator(tmp_path):
    text = '[kv_events]\nendpoint = "tcp://127.0.0.1:1"\npools = ["a"]\nengines = ["x@y"]\n'
    with pytest.raises(ConfigError, match="kv_events.engines: a name cannot hold '@'"):
        config(tmp_path, text)


PRINCIPALS = """
[[security.principals]]
name = "team-a"
uids = [1001]
pools = ["team-a/*"]
[[security.principals]]
name = "team-b"
uids = [1002]
pools = ["team-b/*", "shared"]
[[security.principals]]
name = "team-c"
uids = [1003]
pools = ["shared"]
"""


def test_with_principals_the_endpoint_belongs_to_one(tmp_path):
    base = '[kv_events]\nendpoint = "tcp://127.0.0.1:5557"\n'
    ok = config(tmp_path, base + 'pools = ["team-a/x"]\nprincipal = "team-a"\n' + PRINCIPALS)
    assert ok.kv_events.principal == "team-a"
    named = r"kv_events.principal: with \[\[security.principals\]\], name the principal"
    with pytest.raises(ConfigError, match=named):
        config(tmp_path, base + 'pools = ["team-a/x"]\n' + PRINCIPALS)
    with pytest.raises(ConfigError, match=r"pool 'team-b/x' is reachable by \['team-b'\]"):
        config(tmp_path, base + 'pools = ["team-a/x", "team-b/x"]\nprincipal = "team-a"\n'
               + PRINCIPALS)  # fmt: skip
    with pytest.raises(ConfigError, match=r"pool 'shared' is reachable by \['team-b', 'team-c'\]"):
        config(tmp_path, base + 'pools = ["shared"]\nprincipal = "team-b"\n' + PRINCIPALS)
