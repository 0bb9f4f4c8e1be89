"""The checks of a ``flash_attn_with_kvcache`` call (:mod:`cutefa.api.kvcache`): metadata only, so
that they also run on fake tensors while torch.compile traces (shapes, dtypes, devices, strides;
values only where reading them costs no host sync)."""

from __future__ import annotations

import torch

from cutefa.api import validate
from cutefa.api.validate import GRID_YZ_LIMIT, SUPPORTED_DTYPES, default_scale, int32_tensor, tensor_of_dims
from cutefa.api.validate_features import check_softcap, mask_options
from cutefa.fp8 import FP8_DTYPES
from cutefa.model.spec import HEAD_DIMS

_ALIGN = 16



def one_page_table(block_table: object, page_table: object) -> object:
    if block_table is not None and page_table is not None and block_table is not page_table:
        raise ValueError("pass the page table once: block_table (flash-attn 2's name) or page_table (FA3's)")
    return page_table if page_table is not None else block_table


def _cache_strides(name: str, t: torch.Tensor) -> None:
    """The kernel reads the cache where it is (it is written in place): 16-byte rows, no copy. (The
    data pointer is checked where the kernel is called: a traced tensor has none.)"""
    step = _ALIGN // t.element_size()
    if t.stride(-1) != 1 or any(s % step for s in t.stride()[:-1]):
        raise ValueError(
            f"{name} must have a contiguous head_dim and strides that are multiples of 16 bytes (it is "
            f"read and written in place); got strides {tuple(t.stride())}"
        )


def check_cache_pointers(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % _ALIGN:
            raise ValueError(f"{name}'s data pointer must be 16-byte aligned (it is read in place)")


def validate_call(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
    softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
) -> tuple[bool, int, int, float, float]:  # fmt: skip
    """Raise TypeError/ValueError/NotImplementedError naming the argument; return (causal,
    window_left, window_right, softcap, softmax_scale) as the kernel takes them."""
    if alibi_slopes is not None:
        raise NotImplementedError(
            "alibi_slopes: flash_attn_with_kvcache does not take alibi_slopes yet (pass None)"
        )
    q = tensor_of_dims("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    layout = (
        "(num_pages, page_size, heads_kv, head_dim)"
        if page_table is not None
        else "(batch, seqlen_cache, heads_kv, head_dim)"
    )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        tensor_of_dims(name, t, 4, layout)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        cache_e4m3 = name != "q" and t.dtype == torch.float8_e4m3fn  # kv_descales checks the rest
        if t.dtype in FP8_DTYPES and not cache_e4m3:
            raise NotImplementedError(
                f"{name} has dtype {t.dtype}: no fp8 kernel for it yet (q float16/bfloat16; the cache of "
                "q's dtype or torch.float8_e4m3fn)"
            )
        if t.dtype not in SUPPORTED_DTYPES and not cache_e4m3:
            raise TypeError(
                f"{name} has dtype {t.dtype}; flash_attn_with_kvcache takes torch.float16 or torch.bfloat16"
            )
        if t.device.type not in validate.DEVICE_TYPES:
            raise ValueError(f"cutefa runs on CUDA tensors; got {name} on {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    e4m3 = k_cache.dtype == torch.float8_e4m3fn
    if k_cache.dtype != v_cache.dtype or not (e4m3 or q.dtype == k_cache.dtype):
        raise TypeError(
            f"q, k_cache and v_cache must have one dtype (or k_cache and v_cache both torch.float8_e4m3fn); "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    batch, _, heads_q, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, k_cache has {k_cache.shape[3]}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; cutefa supports head_dim in {HEAD_DIMS}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"q's heads ({heads_q}) must be a multiple of the cache's heads ({heads_kv})")
    if batch > GRID_YZ_LIMIT or heads_kv > GRID_YZ_LIMIT:
        raise ValueError(
            f"batch={batch} and heads_kv={heads_kv} must each be at most {GRID_YZ_LIMIT} (the launch grid)"
        )
    if q.stride(-1) != 1:
        raise ValueError(f"q.stride(-1) must be 1 (contiguous head_dim); got {q.stride(-1)}")
    _cache_strides("k_cache", k_cache)
    _cache_strides("v_cache", v_cache)
    if page_table is not None:
        tensor_of_dims("page_table", page_table, 2, "(batch, max_pages)")
        int32_tensor("page_table", page_table, (batch, page_table.shape[1]), q, "(batch, max_pages)")
        page_size = k_cache.shape[1]
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(
                f"the paged cache's page_size (k_cache.shape[1]) must be a power of two; got {page_size}"
            )
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx is for a dense cache; a paged cache maps sequences through page_table"
            )
        if cache_leftpad is not None:
            raise ValueError(
                "cache_leftpad is for a dense cache; a paged cache starts each sequence at its first page"
            )
    else:
        if cache_batch_idx is not None:
            int32_tensor("cache_batch_idx", cache_batch_idx, (batch,), q, "(batch,)")
        elif k_cache.shape[0] != batch:
            raise ValueError(
                f"the dense cache has {k_cache.shape[0]} sequences, q has {batch}: pass cache_batch_idx to map them"
            )
        if cache_leftpad is not None:
            int32_tensor("cache_leftpad", cache_leftpad, (batch,), q, "(batch,)")
    validate.check_cache_seqlens(cache_seqlens, batch, q)
    _check_new(q, k_cache, k, v, cache_seqlens)
    _check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved)
    validate.check_split_options(num_splits, softmax_scale)
    causal, left, right = mask_options(causal, window_size)
    return causal, left, right, check_softcap(softcap), default_scale(softmax_scale, head_dim)


def _check_new(q: torch.Tensor, k_cache: torch.Tensor, k: object, v: object, cache_seqlens: object) -> None:
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    if k is None:
        return
    shape = (
        q.shape[0],
        tensor_of_dims("k", k, 4, "(batch, seqlen_new, heads_kv, head_dim)").shape[1],
        *k_cache.shape[2:],
    )
    for name, t in (("k", k), ("v", v)):
        tensor_of_dims(name, t, 4, "(batch, seqlen_new, heads_kv, head_dim)")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape (batch, seqlen_new, heads_kv, head_dim) = {shape}; got {tuple(t.shape)}"
            )
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must be {q.dtype} on {q.device} like q; got {t.dtype} on {t.device}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens must be given with k and v: it says where the new tokens go")


def _check_rotary(q: torch.Tensor, k: object, cos: object, sin: object, interleaved: object) -> None:
    if not isinstance(interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool; got {interleaved!r}")
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if cos is None:
        return
    if k is None:
        raise ValueError("rotary_cos/rotary_sin rotate the new keys: they need k and v")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        tensor_of_dims(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
        if not t.is_floating_point() or t.device != q.device:
            raise TypeError(f"{name} must be a float tensor on {q.device}; got {t.dtype} on {t.device}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"rotary_cos and rotary_sin must have one shape; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.shape[0] < 1:
        raise ValueError(
            "rotary_cos has no rows: it needs one per rotary position (seqlen_ro, rotary_dim / 2)"
        )
    if not 0 < 2 * cos.shape[1] <= q.shape[-1]:
        raise ValueError(
            f"rotary_cos has {cos.shape[1]} columns: rotary_dim = 2 x that must be in (0, head_dim={q.shape[-1]}]"
        )


def sequence_lengths(
    cache_seqlens: object, q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor | None
) -> torch.Tensor:
    """cache_seqlens as an int32 tensor (batch,) on q's device (an int or None: filled in)."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens.contiguous()
    length = capacity(k_cache, page_table) if cache_seqlens is None else int(cache_seqlens)
    return torch.full((q.shape[0],), length, dtype=torch.int32, device=q.device)


def capacity(k_cache: torch.Tensor, page_table: torch.Tensor | None) -> int:
    """The most keys a sequence can have: seqlen_cache, or max_pages * page_size."""
    return k_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
