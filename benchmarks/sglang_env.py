"""SGLang 0.5.23's real classes on a CPU-only machine, for the backend's tests and
benchmark (``tests/sglang``, ``benchmarks/sglang_backend.py``).

``make test-sglang`` installs SGLang without its CUDA dependencies next to CPU
torch (``.venv-sglang``). Two things stand between that and SGLang's HiCache
classes, and :func:`install_import_hook` deals with both before SGLang is
imported:

* a handful of SGLang's model-config and multimodal modules import
  ``torchvision`` at module level (reached through ``memory_pool`` ->
  ``forward_batch_info`` -> ``configs``); torchvision has no wheel for CPU torch
  2.13 (the CUDA one fails to load its operators), and the HiCache classes never
  call those modules. The hook lets such an SGLang module import when the only
  thing it lacks is torchvision: its names become inert placeholder classes that
  raise if anything instantiates them. Every other import error stays an error.
* nothing else: the host pools, the storage factory, the cache controller and the
  backend run as SGLang ships them.

The helpers build real host pools (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``) over CPU tensors and storage configs as SGLang's cache
controller does, and create the backend through SGLang's
``StorageBackendFactory`` with the extra config docs/guides/sglang.md documents.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

ABSENT: list[str] = []  # the SGLang modules that were stood in for (they need torchvision)


class _AbsentMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{cls.__qualname__}.{name}")


def _absent(name: str) -> type:
    def refuse(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{name} needs torchvision, which .venv-sglang does not have")

    return _AbsentMeta(name, (), {"__init__": refuse, "__qualname__": name})


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{self.__name__}.{name}")


class _TorchvisionTolerantLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self._real.exec_module(module)
        except ModuleNotFoundError as err:
            if not (err.name or "").startswith("torchvision"):
                raise
            ABSENT.append(module.__name__)
            module.__class__ = _AbsentModule


class _SglangFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("sglang."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _TorchvisionTolerantLoader(spec.loader)
        return spec


def install_import_hook() -> None:
    """Installs the hook (once); a no-op where torchvision imports."""
    if any(isinstance(f, _SglangFinder) for f in sys.meta_path):
        return
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a wheel built for another torch
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, _SglangFinder())


install_import_hook()

import torch  # noqa: E402

EXTRA_CONFIG = {
    "backend_name": "kvtierd",
    "module_path": "kvtierd_client.sglang",
    "class_name": "KvtierdStorage",
    "interface_v1": 1,
}

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")


def mha_host_pool(
    layout: str,
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    device_tokens: int = 64,
    ratio: float = 2.0,
    dtype: torch.dtype = torch.bfloat16,
    host_tokens: int | None = None,
) -> Any:
    """A real ``MHATokenToKVPoolHost`` over CPU tensors (pages of
    ``2 * layers * page_size * heads * head_dim * itemsize`` bytes; ``host_tokens``
    token slots, else ``device_tokens * ratio`` and a padding page)."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return MHATokenToKVPoolHost(
        info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
        host_token_capacity=host_tokens,
    )  # fmt: skip


def mla_host_pool(
    layout: str,
    *,
    layers: int = 2,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    page_size: int = 4,
    device_tokens: int = 64,
    ratio: float = 2.0,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """A real ``MLATokenToKVPoolHost`` over CPU tensors."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dim = kv_lora_rank + rope_dim
    buffers = tuple(torch.zeros(device_tokens, 1, dim, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=buffers, data_ptrs=_ptrs(buffers), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim, kv_cache_dim=dim, dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return MLATokenToKVPoolHost(
        info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
        target_layer_num=layers,
    )  # fmt: skip


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def storage_config(
    address: str,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    layout: str = "page_first",
    model: str = "test-org/tiny-model",
    metrics: bool = False,
    **extra: Any,
) -> Any:
    """SGLang's ``HiCacheStorageConfig`` as its cache controller makes it, with the
    SGLang guide's extra config for ``address`` (plus ``extra``)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first", model_name=model,
        extra_config={**EXTRA_CONFIG, "kvtierd_address": address, **extra},
    )  # fmt: skip


def create_backend(config: Any, host_pool: Any) -> Any:
    """The backend as SGLang's controller attaches it: ``StorageBackendFactory``
    (``dynamic``), then ``register_mem_pool_host`` and ``on_host_pools_registered``.
    With SGLang's fault-injector variables set the factory wraps it in
    ``HiCacheStorageFailureInjector``."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", config, host_pool)
    backend.register_mem_pool_host(host_pool)
    backend.on_host_pools_registered()
    return backend


def unwrap(backend: Any) -> Any:
    """The ``KvtierdStorage`` inside SGLang's fault injector (or ``backend`` itself)."""
    return getattr(backend, "_backend", backend)


def fill_pages(host_pool: Any, pages: list[int], seed: int) -> None:
    """Writes bytes determined by ``(seed, page)`` into the given host pages."""
    for page in pages:
        size = len(page_bytes(host_pool, page))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + page)
        raw = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
        if host_pool.layout == "page_unified":  # SGLang has no flat page for it
            host_pool.kv_buffer[page].view(-1).view(torch.uint8).copy_(raw)
        else:
            flat = raw.view(host_pool.kv_buffer.dtype)
            host_pool.set_from_flat_data_page(page * host_pool.page_size, flat)


def page_bytes(host_pool: Any, page: int) -> bytes:
    """The bytes of host ``page`` in SGLang's flat page order (``page_unified``: the
    page block, which SGLang lays out page-major)."""
    if host_pool.layout == "page_unified":
        data = host_pool.kv_buffer[page]
    else:
        data = host_pool.get_data_page(page * host_pool.page_size, flat=True)
    return bytes(data.contiguous().view(-1).view(torch.uint8).numpy())


def token_slots(host_pool: Any, pages: list[int]) -> torch.Tensor:
    """The host token slots of ``pages``, as SGLang passes ``host_indices``."""
    size = host_pool.page_size
    return torch.cat([torch.arange(p * size, (p + 1) * size, dtype=torch.int64) for p in pages])


def page_keys(prefix: str, count: int) -> list[str]:
    """``count`` chained SHA-256 hex keys, as SGLang's ``get_hash_str`` makes them."""
    import hashlib

    keys, last = [], prefix.encode()
    for i in range(count):
        last = hashlib.sha256(last + str(i).encode()).hexdigest().encode()
        keys.append(last.decode())
    return keys
