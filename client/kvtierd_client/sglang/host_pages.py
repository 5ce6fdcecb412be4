"""How an SGLang host pool lays out its pages, as views the copy engine can move.

SGLang's HiCache host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``)
keeps one ``kv_buffer`` tensor in one of several layouts. Whatever the layout,
one *page* (``page_size`` tokens of every layer of this rank) is a fixed set of
contiguous pieces of that buffer. :func:`describe_host_pool` returns those pieces
as tensors whose first dimension is the page index, each page of each tensor
contiguous: exactly what :class:`kvtierd_client.copy_engine.CopyEngine` takes as
its "KV tensors" (host page ``p`` plays the engine block ``p``). A row of the pool
is the concatenation of one page's pieces, in the order listed here::

    MHA layer_first        kv_buffer (2, L, T*N, H, D)   pieces K[l] for l<L, then V[l]
    MHA page_first         kv_buffer (2, T*N, L, H, D)   pieces K, V
    MHA page_first_direct  kv_buffer (2, N, L, T, H, D)  pieces K, V
    MHA page_head          kv_buffer (2, N, H, T, L, D)  pieces K, V
    MHA page_unified       kv_buffer (N, G, L, 2, T, h, D)   one piece
    MLA layer_first        kv_buffer (L, T*N, 1, C)      pieces kv[l] for l<L
    MLA page_first         kv_buffer (T*N, L, 1, C)      one piece
    MLA page_first_direct  kv_buffer (N, L, T, 1, C)     one piece
    MLA page_unified       kv_buffer (N, L, T, C)        one piece

(N pages of T tokens, L layers, H heads of D, C = kv_lora_rank + rope dim.) So a
row holds the page in SGLang's own *flat page* byte order (what
``get_data_page(flat=True)`` returns and ``set_from_flat_data_page`` reads), and
the generic get/set path stores the very same bytes as the zero-copy path.
:attr:`HostPages.row_order` names that byte order; layouts with one byte order
(MHA layer_first and page_first_direct; MLA layer_first, page_first_direct and
page_unified) share a pool.

Nothing here imports SGLang: the pool is duck-typed, by its class name and the
attributes its layout uses, and anything else is refused with one line naming
what is not supported (:class:`UnsupportedHostPool`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MHA_LAYOUTS", "MLA_LAYOUTS", "HostPages", "UnsupportedHostPool", "describe_host_pool"]

MHA_POOL = "MHATokenToKVPoolHost"
MLA_POOL = "MLATokenToKVPoolHost"

MHA_LAYOUTS: dict[str, str] = {
    "layer_first": "kv,layer,token,head,dim",
    "page_first": "kv,token,layer,head,dim",
    "page_first_direct": "kv,layer,token,head,dim",
    "page_head": "kv,head,token,layer,dim",
    "page_unified": "group,layer,kv,token,head,dim",
}
"""MHA host layouts this backend moves, and the byte order of a page in a row."""

MLA_LAYOUTS: dict[str, str] = {
    "layer_first": "layer,token,dim",
    "page_first": "token,layer,dim",
    "page_first_direct": "layer,token,dim",
    "page_unified": "layer,token,dim",
}
"""MLA host layouts this backend moves, and the byte order of a page in a row."""


class UnsupportedHostPool(ValueError):
    """The host pool cannot be moved by this backend; the message says why, in one line."""


@dataclass(frozen=True)
class HostPages:
    """One host pool's pages, ready for a copy engine.

    Invariant: every tensor has ``page_num`` rows (first dimension = page index),
    each row contiguous; ``page_bytes`` is the sum of one row of each.
    """

    kind: str  # "mha" or "mla"
    layout: str  # SGLang's name (--hicache-mem-layout)
    row_order: str  # byte order of a page in a row (see the module doc)
    page_size: int  # tokens per page
    page_num: int  # pages in the host pool
    page_bytes: int
    dtype: str
    geometry: str  # layers, heads and widths, for the pool's layout fingerprint
    tensors: tuple[torch.Tensor, ...]

    def page_of(self, token_index: int) -> int:
        """The page holding host token slot ``token_index`` (a page's first slot)."""
        return token_index // self.page_size


def describe_host_pool(pool: Any) -> HostPages:
    """The pages of ``pool`` (an SGLang ``HostKVCache``).

    Raises :class:`UnsupportedHostPool` for a pool type, layout or configuration
    this backend does not move (another pool class, a DCP-sharded or allocator-only
    MLA pool, a buffer that is not on the CPU or not where SGLang's
    ``get_page_buffer_meta`` says its pages are).
    """
    kind_name = type(pool).__name__
    if kind_name not in (MHA_POOL, MLA_POOL):
        raise UnsupportedHostPool(
            f"kvtierd: host pool type {kind_name} is not supported (supported: {MHA_POOL}, "
            f"{MLA_POOL}); run without the kvtierd storage backend for this model"
        )
    kind = "mha" if kind_name == MHA_POOL else "mla"
    layout = str(getattr(pool, "layout", ""))
    layouts = MHA_LAYOUTS if kind == "mha" else MLA_LAYOUTS
    if layout not in layouts:
        raise UnsupportedHostPool(
            f"kvtierd: --hicache-mem-layout {layout} is not supported for {kind.upper()} "
            f"host pools (supported: {', '.join(layouts)})"
        )
    if int(getattr(pool, "dcp_size", 1)) != 1:
        raise UnsupportedHostPool(
            "kvtierd: decode context parallelism (dcp_size > 1) is not supported; "
            "SGLang's file or Mooncake backend serves DCP pools"
        )
    kv = getattr(pool, "kv_buffer", None)
    if not isinstance(kv, torch.Tensor):
        raise UnsupportedHostPool(
            f"kvtierd: the {kind.upper()} host pool has no kv_buffer (an allocator-only "
            "pool); nothing to store"
        )
    if kv.device.type != "cpu" or not kv.is_contiguous():
        raise UnsupportedHostPool(
            f"kvtierd: the host pool's kv_buffer must be one contiguous CPU tensor, got "
            f"{kv.device} contiguous={kv.is_contiguous()}"
        )
    page_size, page_num = int(pool.page_size), int(pool.page_num)
    split = _SPLITS[kind][layout]
    try:
        tensors, geometry = split(kv, page_num, page_size)
    except (RuntimeError, ValueError, IndexError) as err:
        raise UnsupportedHostPool(
            f"kvtierd: the {layout} kv_buffer of shape {tuple(kv.shape)} does not split "
            f"into {page_num} pages of {page_size} tokens ({err})"
        ) from None
    pages = HostPages(
        kind=kind,
        layout=layout,
        row_order=layouts[layout],
        page_size=page_size,
        page_num=page_num,
        page_bytes=sum(t.shape[1] * t.element_size() for t in tensors),
        dtype=str(kv.dtype).removeprefix("torch."),
        geometry=geometry,
        tensors=tuple(tensors),
    )
    check_against_page_meta(pool, pages)
    return pages


# -- one splitter per layout: (kv_buffer, pages, tokens per page) -> (tensors, geometry) --


Split = Callable[[torch.Tensor, int, int], tuple[list[torch.Tensor], str]]


def _paged(t: torch.Tensor, pages: int) -> torch.Tensor:
    """``t`` (page-major, contiguous) as (pages, bytes of a page), without a copy."""
    if t.shape[0] * math.prod(t.shape[1:]) % pages:
        raise ValueError(f"{tuple(t.shape)} is not {pages} equal pages")
    return t.view(pages, -1)


def _mha_layer_first(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    _, layers, tokens, heads, dim = kv.shape
    _check_tokens(tokens, n, t)
    pieces = [_paged(kv[c, layer], n) for c in (0, 1) for layer in range(layers)]
    return pieces, f"layers={layers}|heads={heads}|head_dim={dim}"


def _mha_page_first(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    _, tokens, layers, heads, dim = kv.shape
    _check_tokens(tokens, n, t)
    return [_paged(kv[c], n) for c in (0, 1)], f"layers={layers}|heads={heads}|head_dim={dim}"


def _mha_direct(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    _, pages, layers, tokens, heads, dim = kv.shape
    _check_pages(pages, tokens, n, t)
    return [_paged(kv[c], n) for c in (0, 1)], f"layers={layers}|heads={heads}|head_dim={dim}"


def _mha_page_head(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    _, pages, heads, tokens, layers, dim = kv.shape
    _check_pages(pages, tokens, n, t)
    return [_paged(kv[c], n) for c in (0, 1)], f"layers={layers}|heads={heads}|head_dim={dim}"


def _mha_unified(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    pages, groups, layers, _, tokens, heads, dim = kv.shape
    _check_pages(pages, tokens, n, t)
    geometry = f"layers={layers}|heads={groups * heads}|groups={groups}|head_dim={dim}"
    return [_paged(kv, n)], geometry


def _mla_layer_first(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    layers, tokens, _, dim = kv.shape
    _check_tokens(tokens, n, t)
    return [_paged(kv[layer], n) for layer in range(layers)], f"layers={layers}|kv_dim={dim}"


def _mla_page_first(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    tokens, layers, _, dim = kv.shape
    _check_tokens(tokens, n, t)
    return [_paged(kv, n)], f"layers={layers}|kv_dim={dim}"


def _mla_direct(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    pages, layers, tokens, _, dim = kv.shape
    _check_pages(pages, tokens, n, t)
    return [_paged(kv, n)], f"layers={layers}|kv_dim={dim}"


def _mla_unified(kv: torch.Tensor, n: int, t: int) -> tuple[list[torch.Tensor], str]:
    pages, layers, tokens, dim = kv.shape
    _check_pages(pages, tokens, n, t)
    return [_paged(kv, n)], f"layers={layers}|kv_dim={dim}"


def _check_tokens(tokens: int, pages: int, page_size: int) -> None:
    if tokens != pages * page_size:
        raise ValueError(f"{tokens} token slots, expected {pages} x {page_size}")


def _check_pages(pages: int, tokens: int, expected: int, page_size: int) -> None:
    if pages != expected or tokens != page_size:
        raise ValueError(f"{pages} pages of {tokens} tokens, expected {expected} x {page_size}")


_SPLITS: dict[str, dict[str, Split]] = {
    "mha": {
        "layer_first": _mha_layer_first,
        "page_first": _mha_page_first,
        "page_first_direct": _mha_direct,
        "page_head": _mha_page_head,
        "page_unified": _mha_unified,
    },
    "mla": {
        "layer_first": _mla_layer_first,
        "page_first": _mla_page_first,
        "page_first_direct": _mla_direct,
        "page_unified": _mla_unified,
    },
}


# -- the cross-check against SGLang's own idea of where a page is ------------------------


def check_against_page_meta(pool: Any, pages: HostPages) -> None:
    """Compares the pieces of the first and the last page with what the pool's
    ``get_page_buffer_meta`` reports (start address and size of every region of a
    page), so an SGLang release that moves its pages is refused rather than
    copied wrongly. Layouts SGLang has no page meta for (``page_unified``) are
    checked by their shapes alone.

    Raises :class:`UnsupportedHostPool` on a mismatch.
    """
    meta = getattr(pool, "get_page_buffer_meta", None)
    if meta is None or pages.page_num < 1:
        return
    for page in {0, pages.page_num - 1}:
        start = page * pages.page_size
        indices = torch.arange(start, start + pages.page_size, dtype=torch.int64)
        try:
            ptrs, sizes = meta(indices)
        except (ValueError, NotImplementedError, AssertionError):
            return  # SGLang offers no page meta for this layout
        theirs = sorted(zip((int(p) for p in ptrs), (int(s) for s in sizes), strict=True))
        ours = sorted((t[page].data_ptr(), t.shape[1] * t.element_size()) for t in pages.tensors)
        if theirs != ours:
            raise UnsupportedHostPool(
                f"kvtierd: page {page} of the {pages.layout} host pool is not where "
                f"get_page_buffer_meta says (regions {theirs[:2]}... vs {ours[:2]}...): this "
                "SGLang release lays pages out differently; upgrade kvtierd"
            )
