"""The KV-cache append and rotary embedding in torch operations: what the decode kernel's append
launch (cutefa/kernels/sm80/decode_append.py) computes, as a reference for the tests, and the
append of :meth:`cutefa.paged.PagedKVCache.append` (a write with no attention after it).

Positions are flash-attn's: new token ``i`` of sequence ``b`` lands at cache index
``cache_seqlens[b] + i`` and is rotated at ``cache_seqlens[b] - cache_leftpad[b] + i``; q is rotated
at the same positions per token under a causal or local mask, else every token at
``cache_seqlens[b] - cache_leftpad[b]``.
"""

from __future__ import annotations

import torch


def rotary_start(cache_seqlens: torch.Tensor, cache_leftpad: torch.Tensor | None) -> torch.Tensor:
    """The rotary position of each sequence's first new token (batch,), int64."""
    start = cache_seqlens.long()
    return start if cache_leftpad is None else start - cache_leftpad.long()


def query_positions(start: torch.Tensor, seqlen_q: int, per_token: bool) -> torch.Tensor:
    """Positions (batch, seqlen_q or 1) of the query tokens from :func:`rotary_start`: start + i per
    token, or every token at start."""
    if not per_token:
        return start.unsqueeze(1)
    return start.unsqueeze(1) + torch.arange(seqlen_q, device=start.device)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, heads, head_dim) at ``positions`` (batch, seqlen or 1)
    on its first 2 * cos.shape[1] dims, computed in float32 and rounded once: interleaved pairs
    (2i, 2i + 1) or the GPT-NeoX halves (i, i + rotary_dim / 2)."""
    half = cos.shape[1]
    c = cos.float().index_select(0, positions.reshape(-1)).reshape(*positions.shape, 1, half)
    s = sin.float().index_select(0, positions.reshape(-1)).reshape(*positions.shape, 1, half)
    head = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = head[..., :half], head[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half :]), dim=-1)


def append_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True,
    cache_leftpad: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write k, v (batch, n, heads_kv, head_dim) into the caches at cache index cache_seqlens[b] + i
    (through page_table for a paged cache), k rotated first when rotary_cos is given. Only those
    slots change; an index past the cache fails the indexing."""
    slots = cache_seqlens.long().unsqueeze(1) + torch.arange(k.shape[1], device=k.device)
    if rotary_cos is not None:
        positions = query_positions(rotary_start(cache_seqlens, cache_leftpad), k.shape[1], True)
        k = rotate(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
    if page_table is not None:
        page_size = k_cache.shape[1]
        rows = page_table.long().gather(1, slots // page_size)
        slots = slots % page_size
    else:
        seq = torch.arange(k.shape[0], device=k.device) if cache_batch_idx is None else cache_batch_idx.long()
        rows = seq.unsqueeze(1).expand_as(slots)
    k_cache.index_put_((rows, slots), k)
    v_cache.index_put_((rows, slots), v)
