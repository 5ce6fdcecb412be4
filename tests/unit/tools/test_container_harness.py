"""The pure parts of tests/container_harness.py (make test-deploy): what of this machine's pip
settings reaches the image build, and which Debian mirror the base image comes from."""

from __future__ import annotations

from pathlib import Path

import pytest
from container_harness import DEFAULT_MIRROR, IMAGE_CA_BUNDLE, build_pip_config, debian_mirror


def test_pip_config_keeps_remote_indexes_and_maps_the_cert():
    listing = "\n".join(
        [
            "global.cert='/etc/ssl/certs/ca-certificates.crt'",
            "global.extra-index-url='file:///opt/pypi/simple https://mirror.example/simple'",
            "global.find-links='/opt/wheels'",
            "user.index-url='https://pypi.example/simple'",
            ":env:.default-timeout='180'",
        ]
    )
    text = build_pip_config(listing, {"PIP_TRUSTED_HOST": "mirror.example"})
    assert text.splitlines() == [
        "[global]",
        "index-url = https://pypi.example/simple",
        "extra-index-url = https://mirror.example/simple",  # file:// stays behind
        "trusted-host = mirror.example",
        "default-timeout = 180",
        f"cert = {IMAGE_CA_BUNDLE}",
    ]
    assert "/opt/wheels" not in text and "file://" not in text


def test_pip_config_environment_wins_and_empty_means_defaults():
    text = build_pip_config("global.index-url='https://a/simple'", {"PIP_INDEX_URL": "https://b/s"})
    assert "index-url = https://b/s" in text
    assert build_pip_config("", {}) == "[global]\n"


def test_debian_mirror_from_deb822_and_one_line_sources(tmp_path: Path):
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert debian_mirror([str(deb822)]) == "http://mirror.example/debian"
    one_line = tmp_path / "sources.list"
    one_line.write_text("deb [arch=amd64] http://other.example/debian bookworm main contrib\n")
    assert debian_mirror([str(one_line)]) == "http://other.example/debian"
    assert debian_mirror([str(tmp_path / "absent")]) == DEFAULT_MIRROR


def test_no_runtime_is_reported_with_the_reason(monkeypatch):
    """Where no docker daemon answers and none can be started, connect() says why (the
    deploy tests skip with that text). No daemon and no dockerd cannot be caused for real
    on a machine where make test-deploy installed docker.io: stand-ins for both."""
    import container_harness

    monkeypatch.setattr(container_harness, "_answers", lambda binary, host: False)
    monkeypatch.setattr(container_harness, "docker_client", lambda: "/usr/bin/docker")
    real_which = container_harness.shutil.which
    monkeypatch.setattr(
        container_harness.shutil,
        "which",
        lambda name: None if name == "dockerd" else real_which(name),
    )
    with pytest.raises(container_harness.RuntimeUnavailable, match="there is no dockerd"):
        container_harness.connect()
