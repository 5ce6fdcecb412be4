"""SGLang's generic path (``interface_v1`` off: ``get`` / ``set`` / ``batch_*`` /
``exists`` of flat staging pages) stores the same bytes as the zero-copy path: a
page stored through either loads bit-exact through the other."""

from __future__ import annotations

import pytest
import torch

from benchmarks import sglang_env as env

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]  # SGLang has no
# flat page for page_unified (its get_data_page refuses it), so its generic path cannot run


def _pair(address: str, layout: str, kind: str = "mha"):
    make = env.mha_host_pool if kind == "mha" else env.mla_host_pool
    out = []
    for v1 in (1, 0):
        pool = make(layout)
        cfg = env.storage_config(address, layout=layout, mla=kind == "mla", interface_v1=v1)
        out.append((pool, env.create_backend(cfg, pool)))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_and_zero_copy_paths_share_pages(daemon, layout):
    (pool_v1, v1), (pool_gen, generic) = _pair(daemon.address, layout)
    size = pool_v1.page_size
    keys = env.page_keys(f"generic-{layout}", 4)
    env.fill_pages(pool_v1, [1, 2], seed=21)
    assert v1.batch_set_v1(keys[:2], env.token_slots(pool_v1, [1, 2])) == [True, True]
    # SGLang's generic set: flat pages it takes from its host pool
    env.fill_pages(pool_gen, [3, 4], seed=22)
    flat = [pool_gen.get_data_page(p * size, flat=True) for p in (3, 4)]
    assert generic.batch_set(keys[2:], flat) is True
    assert generic.exists(keys[3]) and generic.batch_exists(keys) == 4

    # SGLang's generic get: into dummy flat pages, then set_from_flat_data_page
    targets = [pool_gen.get_dummy_flat_data_page() for _ in keys]
    got = generic.batch_get(keys, targets)
    assert [g is t for g, t in zip(got, targets, strict=True)] == [True] * 4, got
    for page, target in zip((10, 11, 12, 13), targets, strict=True):
        pool_gen.set_from_flat_data_page(page * size, target)
    expected = [env.page_bytes(pool_v1, p) for p in (1, 2)] + [
        env.page_bytes(pool_gen, p) for p in (3, 4)
    ]
    assert [env.page_bytes(pool_gen, p) for p in (10, 11, 12, 13)] == expected
    assert v1.batch_get_v1(keys, env.token_slots(pool_v1, [20, 21, 22, 23])) == [True] * 4
    assert [env.page_bytes(pool_v1, p) for p in (20, 21, 22, 23)] == expected

    one = generic.get(keys[0])  # no target: a new flat page
    assert isinstance(one, torch.Tensor) and bytes(one.view(torch.uint8).numpy()) == expected[0]
    assert generic.get(env.page_keys("absent", 1)[0], targets[0]) is None
    assert generic.set(keys[0], flat[0]) is True  # present already: nothing written, held
    assert generic.batch_set(keys[:1], [torch.zeros(3)]) is False  # not a page of this pool
    for b in (v1, generic):
        b.close()


def test_generic_path_for_mla(daemon):
    (pool_v1, v1), (pool_gen, generic) = _pair(daemon.address, "page_first", kind="mla")
    keys = env.page_keys("generic-mla", 2)
    env.fill_pages(pool_v1, [1, 2], seed=4)
    assert v1.batch_set_v1(keys, env.token_slots(pool_v1, [1, 2])) == [True, True]
    targets = [pool_gen.get_dummy_flat_data_page() for _ in keys]
    assert generic.batch_get(keys, targets) == targets
    assert [bytes(t.view(torch.uint8).numpy()) for t in targets] == [
        env.page_bytes(pool_v1, p) for p in (1, 2)
    ]
    for b in (v1, generic):
        b.close()
