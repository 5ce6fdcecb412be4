"""redis tier settings (kvtierd.tiers.redis.settings): the issue's normative keys with
their defaults, written once; the docs' table is the generated one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtierd.tiers import registry
from kvtierd.tiers.configured import TierCheckError, TierOptionError
from kvtierd.tiers.redis.configured import ConfiguredRedisTier, read_password
from kvtierd.tiers.redis.settings import DEFAULTS, RedisTierSettings, parse_redis_settings
from tools.docs_reference import render, tier_table

CONFIGURATION = Path(__file__).resolve().parents[4] / "docs" / "reference" / "configuration.md"


def test_the_docs_table_of_redis_options_is_the_generated_one() -> None:
    """The configuration reference asks for the table (``<!-- generated: tier redis -->``)."""
    assert tier_table("redis") in render(CONFIGURATION.read_text())
    assert '| `urls` | `["redis://127.0.0.1:6379"]` | seed nodes' in tier_table("redis")


def test_the_normative_options_and_their_defaults() -> None:
    settings = parse_redis_settings(
        {
            "urls": ["redis://127.0.0.1:7000"],
            "cluster": "auto",
            "username": "",
            "password_file": "",
            "key_prefix": "kvtierd",
            "ttl": "0s",
        }
    )
    assert settings == RedisTierSettings(urls=("redis://127.0.0.1:7000",))
    assert (DEFAULTS.cluster, DEFAULTS.key_prefix, DEFAULTS.ttl) == ("auto", "kvtierd", 0.0)
    assert parse_redis_settings({"ttl": "90s", "cluster": False}).ttl == 90.0
    assert parse_redis_settings({"cluster": True}).cluster == "true"
    assert registry.lookup("redis").parse_settings({}) == DEFAULTS


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"root": "/x"}, "root"),
        ({"urls": []}, "urls"),
        ({"urls": ["http://h:1"]}, "urls"),
        ({"urls": ["redis://h:99999"]}, "urls"),
        ({"cluster": "maybe"}, "cluster"),
        ({"info_interval": "0s"}, "info_interval"),
        ({"password_file": "rel"}, "password_file"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"ttl": "-1s"}, "ttl"),
        ({"presence_ttl": "0s"}, "presence_ttl"),
        ({"threads": 0}, "threads"),
        ({"capacity": "lots"}, "capacity"),
        ({"fleet_capacity": "lots"}, "fleet_capacity"),
        ({"fleet_capacity": "512KiB"}, "fleet_capacity"),
        # TLS files: absolute, only for rediss://, a client certificate with its key
        ({"urls": ["rediss://h:1"], "tls_ca_file": "ca.pem"}, "tls_ca_file"),
        ({"tls_ca_file": "/etc/ca.pem"}, "tls_ca_file"),
        ({"urls": ["redis://a:1", "rediss://b:1"]}, "urls"),
        ({"urls": ["rediss://h:1"], "tls_cert_file": "/c.pem"}, "tls_key_file"),
        ({"urls": ["rediss://h:1"], "tls_key_file": "/c.key"}, "tls_cert_file"),
    ],
)
def test_bad_options_name_the_option(options: dict[str, object], key: str) -> None:
    with pytest.raises(TierOptionError) as caught:
        parse_redis_settings(options)
    assert caught.value.key == key


def test_the_password_file_must_not_be_readable_by_others(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("s3cret\n")
    os.chmod(path, 0o600)
    assert read_password(str(path)) == "s3cret"
    os.chmod(path, 0o644)
    with pytest.raises(TierCheckError, match="readable by others"):
        read_password(str(path))
    configured = ConfiguredRedisTier("r", RedisTierSettings(password_file=str(tmp_path / "no")))
    with pytest.raises(TierCheckError, match="cannot read"):
        configured.check()


def test_the_description_hides_a_password_in_a_url() -> None:
    settings = RedisTierSettings(urls=("redis://u:pw@h:1",))
    assert "pw" not in settings.describe() and "u:***@h:1" in settings.describe()
