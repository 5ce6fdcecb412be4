"""The backend's parts without a daemon: extra-config keys, pool plans, host page
views against SGLang's page meta, host indices, the one-line-per-period log, and
SGLang's StorageMetrics."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from benchmarks import sglang_env as env
from kvtierd_client.sglang.host_pages import describe_host_pool
from kvtierd_client.sglang.metrics import MAX_SAMPLES, TransferCounters
from kvtierd_client.sglang.pool_plan import encode_keys, plan_pool
from kvtierd_client.sglang.quiet_log import QuietLog
from kvtierd_client.sglang.settings import EXTRA_KEYS, SettingsError, StorageSettings
from kvtierd_client.sglang.transfers import pages_of

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "sglang.md"


def test_the_guide_lists_every_extra_config_key():
    text = GUIDE.read_text()
    section = text[text.index("## The extra-config keys") :]
    table = re.findall(r"^\| `([a-z_0-9]+)` \|", section, flags=re.M)
    assert table[: len(EXTRA_KEYS)] == list(EXTRA_KEYS)


@pytest.mark.parametrize(
    ("key", "value"),
    [("kvtierd_timeout", "soon"), ("kvtierd_pool_bytes", -1), ("kvtierd_pool_bytes", 1.5),
     ("eviction_policy", "fifo"), ("interface_v1", "maybe"), ("kvtierd_load_wait", True)],
)  # fmt: skip
def test_bad_extra_config_value_names_the_key(key, value):
    with pytest.raises(SettingsError, match=f"^--hicache-storage-backend-extra-config {key}: "):
        StorageSettings.from_extra_config({key: value})


def _plan(pool, **config):
    settings = StorageSettings.from_extra_config({"kvtierd_pool_bytes": 1 << 20})
    cfg = env.storage_config("unix:///x.sock", layout=pool.layout, **config)
    return plan_pool(settings, cfg, describe_host_pool(pool))


def test_pool_plans_scope_ranks_and_share_byte_orders():
    rank0 = _plan(env.mha_host_pool("page_first"), tp_rank=0, tp_size=2)
    rank1 = _plan(env.mha_host_pool("page_first"), tp_rank=1, tp_size=2)
    assert rank0.name != rank1.name and "/tp1of2/" in rank1.name
    assert rank0.num_blocks == (1 << 20) // 2 // 4096  # the bytes are for both ranks
    # two layouts with one byte order share a pool; another byte order does not
    assert _plan(env.mha_host_pool("layer_first")) == _plan(env.mha_host_pool("page_first_direct"))
    assert _plan(env.mha_host_pool("page_head")).name != _plan(env.mha_host_pool("page_first")).name
    mla0 = _plan(env.mla_host_pool("page_first"), tp_rank=0, tp_size=2, mla=True)
    mla1 = _plan(env.mla_host_pool("page_first"), tp_rank=1, tp_size=2, mla=True)
    mla_tp1 = _plan(env.mla_host_pool("page_first"), mla=True)
    assert mla0.name == mla1.name and mla0.layout == mla_tp1.layout and "/mla/" in mla0.name
    assert mla0.writer and not mla1.writer and mla0.num_blocks == (1 << 20) // 4096
    assert "|dtype=bfloat16|page_tokens=4|rows=token,layer,dim|" in mla0.layout


def test_host_pages_are_where_sglang_says():
    for layout in env.MHA_LAYOUTS:
        pool = env.mha_host_pool(layout)
        pages = describe_host_pool(pool)  # checks itself against get_page_buffer_meta
        assert pages.page_bytes == 2 * 2 * 4 * 2 * 16 * 2
        env.fill_pages(pool, [5], seed=1)
        row = b"".join(bytes(t[5].view(torch.uint8).numpy()) for t in pages.tensors)
        assert row == env.page_bytes(pool, 5)  # a row holds SGLang's flat page


def test_moved_pages_are_refused():
    pool = env.mha_host_pool("page_first")
    real = pool.get_page_buffer_meta
    pool.get_page_buffer_meta = lambda idx: ([p + 64 for p in real(idx)[0]], real(idx)[1])
    with pytest.raises(ValueError, match="is not where get_page_buffer_meta says"):
        describe_host_pool(pool)


def test_host_indices_must_be_whole_pages():
    assert pages_of(torch.arange(8, 16), 2, 4) == [2, 3]
    assert pages_of(torch.tensor([12, 13, 14, 15, 0, 1, 2, 3]), 2, 4) == [3, 0]
    for bad in (torch.arange(8, 15), torch.arange(9, 17), torch.tensor([8, 9, 11, 10])):
        with pytest.raises(ValueError):
            pages_of(bad, 2 if bad.numel() != 4 else 1, 4)


def test_keys_are_utf8_and_long_ones_hashed():
    key = env.page_keys("k", 1)[0]
    assert encode_keys([key]) == [key.encode()]
    (long,) = encode_keys(["x" * 300])
    assert long.startswith(b"sha256:") and len(long) == 39


def test_quiet_log_says_what_it_left_out(caplog):
    now = [0.0]
    quiet = QuietLog(logging.getLogger("q"), 30.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="q")
    assert quiet.log(logging.WARNING, "down", "down %d", 1)
    assert not quiet.log(logging.WARNING, "down", "down %d", 2)
    assert quiet.log(logging.WARNING, "other", "other")  # another kind logs at once
    now[0] = 31.0
    assert quiet.log(logging.WARNING, "down", "down %d", 3)
    assert [r.getMessage() for r in caplog.records] == [
        "down 1",
        "other",
        "down 3 (1 more like this in the last 31s)",
    ]


def test_storage_metrics_are_drained_and_bounded():
    counters = TransferCounters(enabled=True)
    for _ in range(MAX_SAMPLES + 10):
        counters.loaded(128, 0, 2 << 20, 0.01)
    counters.stored(4, 1, 2 << 20, 0.5)
    metrics = counters.drain_storage_metrics()
    assert type(metrics).__name__ == "StorageMetrics"
    assert len(metrics.prefetch_pgs) == MAX_SAMPLES and metrics.backup_pgs == [4]
    assert metrics.prefetch_bandwidth[0] == pytest.approx(128 * (2 << 20) / 0.01 / 1e9)
    assert counters.drain_storage_metrics().prefetch_pgs == []
    totals = counters.totals()
    assert totals.pages_loaded == 128 * (MAX_SAMPLES + 10) and totals.pages_not_stored == 1
