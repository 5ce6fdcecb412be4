"""Which kvtierd pool an SGLang rank stores its pages in, and what its keys are.

Scoping (who shares pages with whom):

* **MHA**: every tensor-parallel rank holds other heads, so each rank has its
  *own pool* (``.../tp<r>of<T>``): rank 1 can never load a page of rank 0. Engines
  of the same model, dtype, page geometry and parallel layout (two servers, a
  restarted one, data-parallel replicas) derive the same pools and share pages.
* **MLA**: the latent cache is the same on every rank, so all ranks of all TP
  widths share *one* pool (``.../mla``); only SGLang's storage writer
  (``storage_config.is_storage_writer``) stores, every rank loads.
* Pipeline stages (other layers) and attention context-parallel ranks (another
  slice of every page) get their own pools in both cases.

The pool's *layout* string (the daemon's fingerprint, compared when an engine
joins) spells out everything a row's bytes depend on; its hash is part of the
default name, so an engine with another model, dtype or geometry lands in another
pool instead of being refused by this one. Keys are SGLang's page hashes (hex
SHA-256 chains) as UTF-8: one page, one key, one row.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

from kvtierd_client.sglang.host_pages import HostPages
from kvtierd_client.sglang.settings import StorageSettings

__all__ = ["LAYOUT_VERSION", "PoolPlan", "encode_keys", "plan_pool"]

LAYOUT_VERSION = "kvtierd-sglang/1"
"""Bumped whenever the bytes this backend writes into a row change."""
ROW_ALIGNMENT = 4096
MAX_KEY_BYTES = 256
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_POOL_NAME = 128


@dataclass(frozen=True)
class PoolPlan:
    """The pool one rank opens.

    Invariant: ``block_bytes`` is ``page_bytes`` rounded up to 4096; ``writer`` is
    False only for an MLA rank that is not SGLang's storage writer.
    """

    name: str
    block_bytes: int
    num_blocks: int  # 0: the daemon's default_pool_blocks
    layout: str
    page_bytes: int
    writer: bool
    scope: str  # "tp<r>of<T>" (MHA) or "mla", plus pipeline / context-parallel parts


def plan_pool(settings: StorageSettings, config: Any, pages: HostPages) -> PoolPlan:
    """The pool for SGLang's ``HiCacheStorageConfig`` ``config`` and this rank's pages.

    Raises ValueError when a page does not fit a row (over 1 GiB).
    """
    block_bytes = math.ceil(pages.page_bytes / ROW_ALIGNMENT) * ROW_ALIGNMENT
    if block_bytes > 1 << 30:
        raise ValueError(
            f"kvtierd: a host page of {pages.page_bytes} bytes exceeds the daemon's 1 GiB "
            "row limit; lower --page-size"
        )
    mla = pages.kind == "mla"
    scope = _scope(config, mla)
    layout = layout_fingerprint(config, pages, scope)
    ranks = 1 if mla else max(1, int(getattr(config, "tp_size", 1)))
    if settings.pool_prefix:
        name = f"{settings.pool_prefix.rstrip('/')}/{scope}"
    else:
        digest = hashlib.sha256(layout.encode()).hexdigest()[:12]
        name = _default_name(_model(config), scope, digest)
    rows = settings.pool_bytes // ranks // block_bytes
    if settings.pool_bytes and not rows:
        raise ValueError(
            f"kvtierd: kvtierd_pool_bytes {settings.pool_bytes} holds no row of {block_bytes} "
            f"bytes for each of {ranks} rank(s); give at least {ranks * block_bytes * 128} "
            "(128 pages a rank, one SGLang batch)"
        )
    return PoolPlan(
        name=name,
        block_bytes=block_bytes,
        num_blocks=rows,
        layout=layout,
        page_bytes=pages.page_bytes,
        writer=not mla or bool(getattr(config, "is_storage_writer", True)),
        scope=scope,
    )


def layout_fingerprint(config: Any, pages: HostPages, scope: str) -> str:
    """Everything a row's bytes depend on, readable (< 4 KiB): the model, the page's
    kind, dtype, tokens, byte order, geometry and size, and the rank scope."""
    model = _model(config)
    if len(model) > 512:
        model = "sha256:" + hashlib.sha256(model.encode()).hexdigest()
    return (
        f"{LAYOUT_VERSION}|kind={pages.kind}|model={model}|dtype={pages.dtype}"
        f"|page_tokens={pages.page_size}|rows={pages.row_order}|{pages.geometry}"
        f"|page_bytes={pages.page_bytes}|scope={scope}"
    )


def encode_keys(keys: list[str]) -> list[bytes]:
    """SGLang page keys as daemon keys: UTF-8, or ``sha256:`` + digest for one over
    256 bytes (SGLang's own are 64 hex characters)."""
    out = []
    for key in keys:
        raw = str(key).encode()
        if len(raw) > MAX_KEY_BYTES or not raw:
            raw = b"sha256:" + hashlib.sha256(raw).digest()
        out.append(raw)
    return out


def _scope(config: Any, mla: bool) -> str:
    scope = "mla" if mla else f"tp{int(config.tp_rank)}of{int(config.tp_size)}"
    pp_size = int(getattr(config, "pp_size", 1))
    if pp_size > 1:
        scope += f"-pp{int(config.pp_rank)}of{pp_size}"
    cp_size = int(getattr(config, "attn_cp_size", 1))
    if cp_size > 1:
        scope += f"-cp{int(config.attn_cp_rank)}of{cp_size}"
    return scope


def _model(config: Any) -> str:
    return str(getattr(config, "model_name", None) or "model")


def _default_name(model: str, scope: str, digest: str) -> str:
    base = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    base = _NAME_CHARS.sub("_", base).strip("_.") or "model"
    tag = hashlib.sha256(model.encode()).hexdigest()[:8]
    suffix = f"/{tag}/{scope}/{digest}"
    room = _MAX_POOL_NAME - len("sglang/") - len(suffix)
    return "sglang/" + base[: max(room, 1)] + suffix
