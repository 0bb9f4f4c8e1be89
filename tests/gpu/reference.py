"""Reference attention for the tests: exact masking rules, computed in blocks.

Layout everywhere is (batch, seqlen, heads, head_dim). Query head ``h`` reads key/value head
``h // (heads_q // heads_kv)`` (grouped-query attention). Causal masking is aligned bottom-right:
query ``i`` attends key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. A query row that attends no key
has output 0 and log-sum-exp ``-inf``.

Nothing here materialises more than one (query block x seqlen_k) score matrix per step, so
long sequences fit in a few hundred MB whatever the batch and head counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Score elements per block: 2**24 float32 scores = 64 MiB (x2-3 for the softmax temporaries).
MAX_BLOCK_ELEMENTS = 1 << 24


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def causal_allowed(rows: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Boolean (len(rows), seqlen_k) mask, True where query ``rows[r]`` may attend key ``j``."""
    cols = torch.arange(seqlen_k, device=rows.device)
    return cols[None, :] <= rows[:, None] + (seqlen_k - seqlen_q)


def empty_rows(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of leading query rows that attend no key (only causal with seqlen_q > seqlen_k)."""
    if seqlen_k == 0:
        return seqlen_q
    if not causal:
        return 0
    return max(0, seqlen_q - seqlen_k)


@dataclass(frozen=True)
class Block:
    """One unit of work: a query-row range of one (batch, query head)."""

    batch: int
    head_q: int
    head_kv: int
    row0: int
    row1: int


def blocks(q: torch.Tensor, k: torch.Tensor, max_elements: int = MAX_BLOCK_ELEMENTS) -> Iterator[Block]:
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    group = heads_q // heads_kv
    rows = max(1, max_elements // max(1, seqlen_k))
    for b in range(batch):
        for h in range(heads_q):
            for r0 in range(0, seqlen_q, rows):
                yield Block(b, h, h // group, r0, min(seqlen_q, r0 + rows))


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    max_elements: int = MAX_BLOCK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed in ``compute_dtype`` on the inputs' device.

    Returns ``(out, lse)``: out (batch, seqlen_q, heads_q, head_dim) in ``compute_dtype``, lse
    (batch, heads_q, seqlen_q) in ``compute_dtype``, natural log of the sum of exp(scaled scores).
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = default_scale(head_dim) if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, seqlen_q, heads_q, v.shape[-1], dtype=compute_dtype, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=compute_dtype, device=q.device)
    if seqlen_q == 0 or seqlen_k == 0:
        return out, lse
    for blk in blocks(q, k, max_elements):
        qb = q[blk.batch, blk.row0 : blk.row1, blk.head_q].to(compute_dtype)
        kb = k[blk.batch, :, blk.head_kv].to(compute_dtype)
        vb = v[blk.batch, :, blk.head_kv].to(compute_dtype)
        scores = (qb @ kb.T) * scale
        if causal:
            rows = torch.arange(blk.row0, blk.row1, device=q.device)
            scores = scores.masked_fill(~causal_allowed(rows, seqlen_q, seqlen_k), -math.inf)
        row_max = scores.amax(dim=-1)
        empty = torch.isneginf(row_max)
        row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
        p = torch.exp(scores - row_max[:, None])
        denom = p.sum(dim=-1)
        o = (p @ vb) / torch.where(empty, torch.ones_like(denom), denom)[:, None]
        out[blk.batch, blk.row0 : blk.row1, blk.head_q] = torch.where(empty[:, None], torch.zeros_like(o), o)
        lse[blk.batch, blk.head_q, blk.row0 : blk.row1] = torch.where(
            empty, torch.full_like(denom, -math.inf), row_max + torch.log(denom)
        )
    return out, lse


def sdpa_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    max_elements: int = MAX_BLOCK_ELEMENTS,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (math backend) on the inputs as given, in their dtype.

    This is the error yardstick: what PyTorch's own attention gets on the same low-precision
    inputs. It runs per (batch, head, query block) with an explicit boolean mask, because SDPA's
    ``is_causal`` is aligned top-left and the API here is bottom-right. Rows that attend no key
    are returned as 0 (SDPA's answer for them differs between versions).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = default_scale(head_dim) if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, seqlen_q, heads_q, v.shape[-1], dtype=q.dtype, device=q.device)
    if seqlen_q == 0 or seqlen_k == 0:
        return out
    with sdpa_kernel(SDPBackend.MATH):
        for blk in blocks(q, k, max_elements):
            qb = q[blk.batch, blk.row0 : blk.row1, blk.head_q][None, None]
            kb = k[blk.batch, :, blk.head_kv][None, None]
            vb = v[blk.batch, :, blk.head_kv][None, None]
            mask = None
            if causal:
                rows = torch.arange(blk.row0, blk.row1, device=q.device)
                mask = causal_allowed(rows, seqlen_q, seqlen_k)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)[0, 0]
            if mask is not None:
                o = torch.where(mask.any(dim=-1)[:, None], o, torch.zeros_like(o))
            out[blk.batch, blk.row0 : blk.row1, blk.head_q] = o
    return out


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN anywhere gives NaN (which fails every comparison)."""
    ref64 = ref.double()
    diff = torch.linalg.vector_norm(x.double() - ref64).item()
    norm = torch.linalg.vector_norm(ref64).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |x - ref| (NaN if any element is NaN)."""
    if x.numel() == 0:
        return 0.0
    d = (x.double() - ref.double()).abs()
    return math.nan if torch.isnan(d).any().item() else d.max().item()


def rounding_error(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest error of merely storing ``ref`` in ``dtype``: the unavoidable part of any output error."""
    if ref.numel() == 0:
        return 0.0
    return (ref.to(dtype).double() - ref.double()).abs().max().item()
