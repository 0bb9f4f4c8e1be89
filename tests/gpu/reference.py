"""Reference attention for the tests: exact masking rules and score modifiers, computed in blocks.

Dense layout is (batch, seqlen, heads, head_dim); the packed (variable-length) layout is
(total, heads, head_dim) with int32 prefix sums ``cu_seqlens`` (:func:`varlen_ref`). Query head
``h`` reads key/value head ``h // (heads_q // heads_kv)`` (grouped-query attention).

Semantics, for one sequence of ``seqlen_q`` queries and ``seqlen_k`` keys (``d = seqlen_k -
seqlen_q``, the bottom-right alignment):

- query ``i`` attends key ``j`` iff ``i + d - left <= j <= i + d + right`` for ``window_size =
  (left, right)``, a negative (or None) side being unbounded; ``causal`` caps ``right`` at 0, so
  causal alone is ``j <= i + d`` and window ``(-1, 0)`` is causal;
- a score is ``s = softmax_scale * q.k``, then ``softcap * tanh(s / softcap)`` when ``softcap >
  0``, then ``- slope * |i + d - j|`` is added with ALiBi (``alibi_slopes`` (heads_q,) or (batch,
  heads_q));
- ``sinks`` (heads_q,) is one extra logit per head in the softmax denominator that takes no value:
  ``lse = log(exp(sink) + sum_j exp(s_j))`` and ``out = sum_j exp(s_j - lse) v_j``;
- a query row that attends no key has output 0 and log-sum-exp ``-inf`` (the sink with sinks).

Everything is differentiable by torch autograd (q, k, v and sinks; the rows that attend no key
give no NaN), so the tests take exact gradients from here. Nothing materialises more than about
``max_elements`` scores per step, so long sequences fit in a few hundred MB.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Score elements per block: 2**24 float32 scores = 64 MiB (x2-3 for the softmax temporaries).
MAX_BLOCK_ELEMENTS = 1 << 24

Window = tuple[int | None, int | None]
NO_WINDOW: Window = (-1, -1)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def window_bounds(window_size: Window, causal: bool) -> tuple[int | None, int | None]:
    """(left, right) offsets from the diagonal, None where unbounded; causal caps right at 0."""
    left, right = window_size
    left = None if left is None or left < 0 else int(left)
    right = None if right is None or right < 0 else int(right)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def allowed_keys(
    rows: torch.Tensor, seqlen_q: int, seqlen_k: int, causal: bool = False, window_size: Window = NO_WINDOW
) -> torch.Tensor:
    """Boolean (len(rows), seqlen_k) mask, True where query ``rows[r]`` may attend key ``j``."""
    left, right = window_bounds(window_size, causal)
    diag = rows[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=rows.device)[None, :]
    allowed = torch.ones(len(rows), seqlen_k, dtype=torch.bool, device=rows.device)
    if left is not None:
        allowed &= cols >= diag - left
    if right is not None:
        allowed &= cols <= diag + right
    return allowed


def causal_allowed(rows: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Boolean (len(rows), seqlen_k) mask, True where query ``rows[r]`` may attend key ``j``."""
    return allowed_keys(rows, seqlen_q, seqlen_k, causal=True)


def empty_rows(seqlen_q: int, seqlen_k: int, causal: bool, window_size: Window = NO_WINDOW) -> int:
    """Number of leading query rows that attend no key. Only leading rows can: the band's lower
    end ``i + d - left`` never passes the last key (``i < seqlen_q``, ``left >= 0``), its upper end
    ``i + d + right`` is below the first key exactly for ``i < seqlen_q - seqlen_k - right``."""
    if seqlen_k == 0:
        return seqlen_q
    _, right = window_bounds(window_size, causal)
    if right is None:
        return 0
    return min(seqlen_q, max(0, seqlen_q - seqlen_k - right))


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


def _slopes(alibi_slopes: torch.Tensor | None, batch: int, heads_q: int) -> torch.Tensor | None:
    """ALiBi slopes as (batch, heads_q), or None."""
    if alibi_slopes is None:
        return None
    if alibi_slopes.shape == (heads_q,):
        return alibi_slopes[None].expand(batch, heads_q)
    if alibi_slopes.shape != (batch, heads_q):
        raise ValueError(
            f"alibi_slopes has shape {tuple(alibi_slopes.shape)}, expected ({heads_q},) or ({batch}, {heads_q})"
        )
    return alibi_slopes


def _rows_softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, lse) of masked scores (..., keys) with an optional extra logit per row
    (``sink``, shaped like the rows). A row with nothing to attend (all scores -inf, no finite
    sink) gets probabilities 0 and lse -inf, and gradients without NaN."""
    if scores.shape[-1]:
        row_max = scores.amax(dim=-1).detach()
    else:
        row_max = torch.full(scores.shape[:-1], -math.inf, dtype=scores.dtype, device=scores.device)
    if sink is not None:
        row_max = torch.maximum(row_max, sink.detach())
    # any finite shift gives the same result: the row maximum keeps exp in range
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max[..., None])
    denom = p.sum(dim=-1)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    empty = denom == 0
    safe = torch.where(empty, torch.ones_like(denom), denom)
    lse = torch.where(empty, torch.full_like(denom, -math.inf), row_max + torch.log(safe))
    return p / safe[..., None], lse


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window_size: Window = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    max_elements: int = MAX_BLOCK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (the module docstring's semantics) computed in ``compute_dtype`` on q's device.

    Returns ``(out, lse)``: out (batch, seqlen_q, heads_q, head_dim_v) and lse (batch, heads_q,
    seqlen_q), both in ``compute_dtype``; lse is the natural log of the softmax denominator.
    Differentiable with respect to q, k, v and sinks.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    scale = default_scale(head_dim) if softmax_scale is None else softmax_scale
    slopes = _slopes(alibi_slopes, batch, heads_q)
    head_map = torch.arange(heads_q, device=q.device) // (heads_q // heads_kv)
    sink_all = None if sinks is None else sinks.to(device=q.device, dtype=compute_dtype)
    # a block of heads holds its keys and values expanded to query heads, and its scores: both
    # within max_elements (one head at a time where a head's keys alone exceed it)
    heads_step = max(1, min(heads_q, max_elements // max(1, seqlen_k * max(head_dim, v.shape[-1]))))
    outs, lses = [], []
    for b in range(batch):
        out_heads, lse_heads = [], []
        for h0 in range(0, heads_q, heads_step):
            h1 = min(heads_q, h0 + heads_step)
            kb = k[b].to(compute_dtype).index_select(1, head_map[h0:h1])  # (seqlen_k, h1 - h0, head_dim)
            vb = v[b].to(compute_dtype).index_select(1, head_map[h0:h1])
            rows_step = max(1, max_elements // max(1, (h1 - h0) * seqlen_k))
            out_rows, lse_rows = [], []
            for r0 in range(0, seqlen_q, rows_step):
                r1 = min(seqlen_q, r0 + rows_step)
                rows = torch.arange(r0, r1, device=q.device)
                qb = q[b, r0:r1, h0:h1].to(compute_dtype)
                scores = torch.einsum("rhd,khd->hrk", qb, kb) * scale
                if softcap > 0:
                    scores = softcap * torch.tanh(scores / softcap)
                if slopes is not None:
                    distance = (
                        rows[:, None] + (seqlen_k - seqlen_q) - torch.arange(seqlen_k, device=q.device)
                    ).abs()
                    slope = slopes[b, h0:h1].to(device=q.device, dtype=compute_dtype)
                    scores = scores - slope[:, None, None] * distance.to(compute_dtype)
                allowed = allowed_keys(rows, seqlen_q, seqlen_k, causal, window_size)
                scores = scores.masked_fill(~allowed, -math.inf)
                sink = None if sink_all is None else sink_all[h0:h1, None].expand(h1 - h0, r1 - r0)
                p, lse = _rows_softmax(scores, sink)
                out_rows.append(torch.einsum("hrk,khd->rhd", p, vb))
                lse_rows.append(lse)
            if out_rows:
                out_heads.append(torch.cat(out_rows, 0))
                lse_heads.append(torch.cat(lse_rows, 1))
        if out_heads:
            outs.append(torch.cat(out_heads, 1))
            lses.append(torch.cat(lse_heads, 0))
    if not outs or seqlen_q == 0:
        out = torch.zeros(batch, seqlen_q, heads_q, v.shape[-1], dtype=compute_dtype, device=q.device)
        lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=compute_dtype, device=q.device)
        return out, lse
    return torch.stack(outs), torch.stack(lses)


def sequences(cu_seqlens: torch.Tensor, seqused: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """(first row, used length) of each sequence of a packed batch, read on the host: the span
    ``cu_seqlens[b] .. cu_seqlens[b + 1]``, of which the first ``seqused[b]`` rows are used (the
    whole span without ``seqused``)."""
    starts = [int(x) for x in cu_seqlens.tolist()]
    spans = [b - a for a, b in itertools.pairwise(starts)]
    if any(n < 0 for n in spans):
        raise ValueError(f"cu_seqlens is not non-decreasing: {starts}")
    used = spans if seqused is None else [int(x) for x in seqused.tolist()]
    if len(used) != len(spans):
        raise ValueError(f"seqused has {len(used)} entries for {len(spans)} sequences")
    if any(not 0 <= u <= n for u, n in zip(used, spans)):
        raise ValueError(f"seqused {used} is not within the spans {spans}")
    return list(zip(starts, used))


def used_rows(
    cu_seqlens: torch.Tensor,
    seqused: torch.Tensor | None,
    total: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean (total,): True on the rows of a packed tensor that some sequence uses."""
    used = torch.zeros(total, dtype=torch.bool)
    for start, length in sequences(cu_seqlens, seqused):
        used[start : start + length] = True
    return used.to(device if device is not None else cu_seqlens.device)


def varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    causal: bool = False,
    window_size: Window = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    max_elements: int = MAX_BLOCK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_ref` sequence by sequence over a packed batch.

    q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim); sequence ``b`` is
    the first ``seqused_q[b]`` (``seqused_k[b]``) rows from ``cu_seqlens_q[b]`` (``cu_seqlens_k[b]``),
    with its own bottom-right alignment. ``alibi_slopes`` (heads_q,) or (batch, heads_q). Returns
    ``(out, lse)``: out (total_q, heads_q, head_dim_v), lse (heads_q, total_q), in
    ``compute_dtype``; a row no sequence uses gets out 0 and lse -inf (the API leaves those rows
    unspecified: compare only :func:`used_rows`). Differentiable like :func:`attention_ref`.
    """
    seq_q = sequences(cu_seqlens_q, seqused_q)
    seq_k = sequences(cu_seqlens_k, seqused_k)
    if len(seq_q) != len(seq_k):
        raise ValueError(f"cu_seqlens_q has {len(seq_q)} sequences, cu_seqlens_k {len(seq_k)}")
    total_q, heads_q = q.shape[0], q.shape[1]
    slopes = _slopes(alibi_slopes, len(seq_q), heads_q)
    f = {"dtype": compute_dtype, "device": q.device}

    def gap(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(rows, heads_q, v.shape[-1], **f), torch.full((heads_q, rows), -math.inf, **f)

    outs, lses, row = [], [], 0
    for b, ((q0, sq), (k0, sk)) in enumerate(zip(seq_q, seq_k)):
        if q0 < row or q0 + sq > total_q or k0 + sk > k.shape[0]:
            raise ValueError(f"sequence {b}: rows {q0}..{q0 + sq} / keys {k0}..{k0 + sk} overlap or overrun")
        if q0 > row:
            pieces = gap(q0 - row)
            outs.append(pieces[0])
            lses.append(pieces[1])
        out, lse = attention_ref(
            q[q0 : q0 + sq][None], k[k0 : k0 + sk][None], v[k0 : k0 + sk][None], causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=None if slopes is None else slopes[b : b + 1],
            sinks=sinks, softmax_scale=softmax_scale, compute_dtype=compute_dtype, max_elements=max_elements,
        )  # fmt: skip
        outs.append(out[0])
        lses.append(lse[0])
        row = q0 + sq
    if row < total_q:
        pieces = gap(total_q - row)
        outs.append(pieces[0])
        lses.append(pieces[1])
    if not outs:
        return gap(0)
    return torch.cat(outs, 0), torch.cat(lses, 1)


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
