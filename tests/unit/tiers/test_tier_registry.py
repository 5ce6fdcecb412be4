"""The registry of tier types (kvtierd.tiers.registry): the configuration, the daemon
and the pool table reach tier types only through it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from kvtierd.config import ConfigError, load_config
from kvtierd.contract import LookupResult
from kvtierd.tiers import registry
from kvtierd.tiers.base import JobCallback, SecondaryTier, TierJob, TierStats
from kvtierd.tiers.configured import (
    ConfiguredTier,
    PoolBinding,
    TierOptionError,
)
from kvtierd.tiers.fs.configured import ConfiguredFsTier
from kvtierd.tiers.fs.settings import FsTierSettings
from kvtierd.tiers.options import TEXT, option, tier_options


def test_fs_is_supported_and_configures_a_configured_fs_tier(tmp_path: Any) -> None:
    assert "fs" in registry.supported()
    settings = registry.lookup("fs").parse_settings({"root": str(tmp_path)})
    configured = registry.configure("fs", "nvme", settings)
    assert isinstance(configured, ConfiguredFsTier) and configured.name == "nvme"
    assert configured.describe() == f"fs at {tmp_path}, capacity {10 << 30} bytes"
    configured.check()


def test_an_unknown_type_names_the_supported_ones() -> None:
    with pytest.raises(
        registry.UnknownTierType, match=r"^unsupported tier type 's3'; supported: fs, redis"
    ):
        registry.lookup("s3")


def test_a_type_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.lookup("fs"))


def test_the_embedded_default_is_an_fs_tier_under_the_data_directory() -> None:
    type_name, name, settings = registry.embedded_default("/var/lib/x")
    assert (type_name, name) == ("fs", "fs")
    assert settings == FsTierSettings(root="/var/lib/x/fs", create_root=True)


# -- a tier type registered from outside: the config and the daemon need no change --------


@dataclass(frozen=True, slots=True)
class MemorySettings:
    label: str = option(dataclasses.MISSING, "a label", TEXT)

    def exclusive(self) -> Mapping[str, object]:
        return {"label": self.label}

    def describe(self) -> str:
        return f"memory {self.label}"


def parse_memory(options: Mapping[str, Any]) -> MemorySettings:
    if set(options) != {"label"}:
        raise TierOptionError("label", "exactly one option: label")
    return MemorySettings(options["label"])


class ConfiguredMemoryTier(ConfiguredTier):
    type_name = "memory-test"

    def check(self) -> None:
        pass

    def create(
        self, pool: PoolBinding, on_done: JobCallback, loop: asyncio.AbstractEventLoop
    ) -> SecondaryTier:
        raise NotImplementedError

    async def drain(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.fixture
def memory_type() -> Any:
    tier_type = registry.TierType(
        name="memory-test",
        parse_settings=parse_memory,
        configured_class=f"{__name__}:ConfiguredMemoryTier",
        options=tier_options(MemorySettings),
    )
    registry.register(tier_type)
    try:
        yield tier_type
    finally:
        registry.unregister(tier_type.name)


def write(tmp_path: Any, text: str) -> str:
    path = tmp_path / "kvtierd.toml"
    path.write_text(text)
    return str(path)


def test_a_registered_type_is_parsed_checked_for_sharing_and_configured(
    tmp_path: Any, memory_type: Any
) -> None:
    config = load_config(write(tmp_path, "[[tiers]]\ntype = 'memory-test'\nlabel = 'a'\n"), env={})
    (tier,) = config.tiers
    assert (tier.type, tier.name, tier.settings) == (
        "memory-test",
        "memory-test0",
        MemorySettings("a"),
    )
    configured = registry.configure(tier.type, tier.name, tier.settings)
    assert isinstance(configured, ConfiguredMemoryTier)
    assert configured.describe() == "memory a"
    twice = "[[tiers]]\ntype = 'memory-test'\nlabel = 'a'\n" * 2
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.label: a is already another tier's label"):
        load_config(write(tmp_path, twice), env={})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.label: exactly one option"):
        load_config(write(tmp_path, "[[tiers]]\ntype = 'memory-test'\n"), env={})
    assert '  type = "memory-test":\n    - label: a label (required)' in registry.help_text()


def test_a_registered_class_must_be_a_configured_tier() -> None:
    bogus = registry.TierType("bogus", parse_memory, f"{__name__}:MemorySettings", ())
    with pytest.raises(TypeError, match="is not a ConfiguredTier"):
        bogus.configured()


class _Unused(SecondaryTier):
    """Implements the job methods only: not how it starts, nor when it is ready."""

    name = "unused"

    def lookup(self, keys: Any) -> list[LookupResult]:
        return []

    def submit_store(self, job: TierJob) -> bool:
        return False

    def submit_load(self, job: TierJob) -> None:
        pass

    async def drain(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def statistics(self) -> TierStats:
        raise NotImplementedError


def test_a_tier_must_say_how_it_starts_and_when_it_is_ready() -> None:
    with pytest.raises(TypeError, match="launch, ready, wait_ready"):
        _Unused()  # type: ignore[abstract]
