"""Attention of new query tokens against a KV cache: :func:`flash_attn_with_kvcache` (decode,
speculative decoding, chunked prefill), a dense or paged cache, new keys and values appended in
place, rotary embedding on q and the new keys.

Custom ops carry it (graph-capturable: nothing here reads a GPU value, and every
allocation depends on shapes only):

- ``cutefa::kvcache_append`` (mutates ``k_cache`` and ``v_cache``): the new ``k``/``v`` written at
  positions ``cache_seqlens[b] + i``, into the right pages of a paged cache, the new keys rotated
  first. A torch implementation for now (index arithmetic, gathers and one ``index_put_`` per
  cache on the device); fusing it, and the rotation, into a kernel is a later step.
- ``cutefa::kvcache_rotary``: q rotated at its positions (torch, like the append).
- ``cutefa::kvcache_attn`` (no mutation): the decode kernel (templates/decode_sm80.py.j2, the
  sm80-family FlashAttention-2 design that runs on sm80 and newer GPUs): the query heads of a kv
  head and the new tokens packed into one tile, the keys split across CTAs by
  :mod:`cutefa.model.policy_decode` (``num_splits=0``) or as asked, and a combine kernel in the
  same launch when there is more than one split.

Limits. ``cache_seqlens`` (plus the new tokens) past the cache's capacity are clamped to it by the
kernel; an append past the capacity, a page id past ``max_pages`` or a rotary position past
``rotary_cos`` fail the torch indexing on the device (an asynchronous device-side error, no host
sync). Page ids themselves are not range-checked (that costs launches on every decode step):
:meth:`cutefa.paged.PagedKVCache.check` validates a table in tests and debugging.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from cutefa import dispatch
from cutefa.api import validate
from cutefa.api.features import UNBOUNDED
from cutefa.api.launch import aligned, call_on
from cutefa.api.plans import plain_eager
from cutefa.api.validate import GRID_YZ_LIMIT, SUPPORTED_DTYPES, default_scale
from cutefa.api.validate_features import check_softcap, mask_options
from cutefa.fp8 import FP8_DTYPES
from cutefa.loader import get_kernel
from cutefa.model import policy_decode
from cutefa.model.options import Mask
from cutefa.model.spec import HEAD_DIMS, TORCH_DTYPE_NAMES, VariantSpec

MAX_SPLITS = 256  # num_splits asked for: the fp32 workspace grows with it
_ALIGN = 16


# ---------------------------------------------------------------------------------------------
# The public function


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    page_table: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` (batch, seqlen_q, heads_q, head_dim) against a KV cache, flash-attn 2's
    positional order (its callers run unchanged; FA3's ``page_table`` and ``return_lse`` are
    keywords).

    Cache: dense ``k_cache``/``v_cache`` (batch_cache, seqlen_cache, heads_kv, head_dim), or paged
    (num_pages, page_size, heads_kv, head_dim) with ``page_table`` (or ``block_table``) int32
    (batch, max_pages): key ``j`` of sequence ``b`` is row ``j % page_size`` of page
    ``page_table[b, j // page_size]``; page_size a power of two (16 is vLLM's). ``cache_seqlens``
    int32 (batch,) (or an int): the keys each sequence has in the cache before this call (None: the
    whole cache). ``cache_batch_idx`` int32 (batch,): the dense cache row of each sequence.

    ``k``, ``v`` (batch, seqlen_new, heads_kv, head_dim): new tokens written into the cache in place
    at ``cache_seqlens[b] + i`` (torch ops for now: see the module docs), then attended to: the
    sequence has ``cache_seqlens[b] + seqlen_new`` keys. ``cache_seqlens`` itself is not updated.
    ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2): the new keys are rotated at their
    positions, and q at ``cache_seqlens[b] + i`` when causal or windowed, else all at
    ``cache_seqlens[b]`` (flash-attn's rule); ``rotary_interleaved``: pairs (0, 1), (2, 3)... else
    GPT-NeoX halves. Rotary embedding needs ``k``.

    ``causal`` and ``window_size`` are aligned bottom-right (query token ``i`` of ``seqlen_q`` sits
    at key position ``i + seqlen_k - seqlen_q``); ``softcap`` as in :func:`cutefa.flash_attn_func`.
    ``num_splits``: 0 lets the split heuristic choose (from shapes and the GPU's SM count), N >= 1
    forces N splits of the keys (1: no combine). Returns ``out`` (like q), and with
    ``return_softmax_lse`` or ``return_lse`` also ``lse`` float32 (batch, heads_q, seqlen_q). A row
    with no key gets out 0 and lse -inf.

    Not yet: ``cache_leftpad``, ``alibi_slopes``, an fp8 cache (each a NotImplementedError).
    """
    page_table = _one_page_table(block_table, page_table)
    call = _validate(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        page_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
    )  # fmt: skip
    causal, window_left, window_right, softcap, scale = call
    seqlens = _seqlens(cache_seqlens, q, k_cache, page_table)
    tensors = [
        t for t in (k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, page_table) if t is not None
    ]
    # a plain eager call (inference, CUDA-graph capture) runs the ops' implementations directly:
    # the same work without the op dispatcher's overhead, which a decode step feels
    direct = plain_eager(q, k_cache, v_cache, *tensors)
    rotary_op, append_op, attn_op = (_rotary_q, append_kv, decode) if direct else ops()
    seqlen_new = 0
    if k is not None:
        seqlen_new = k.shape[1]
        if rotary_cos is not None:
            windowed = (window_left, window_right) != (-1, -1)
            q = rotary_op(q, rotary_cos, rotary_sin, seqlens, causal or windowed, rotary_interleaved)
        append_op(
            k_cache,
            v_cache,
            k,
            v,
            seqlens,
            cache_batch_idx,
            page_table,
            rotary_cos,
            rotary_sin,
            rotary_interleaved,
        )
    out, lse = attn_op(
        q, k_cache, v_cache, seqlens, cache_batch_idx, page_table, seqlen_new, scale, causal, window_left,
        window_right, softcap, int(num_splits),
    )  # fmt: skip
    return (out, lse) if return_softmax_lse or return_lse else out


# ---------------------------------------------------------------------------------------------
# Checks (metadata only: they also run on fake tensors while torch.compile traces)


def _one_page_table(block_table: object, page_table: object) -> object:
    if block_table is not None and page_table is not None and block_table is not page_table:
        raise ValueError("pass the page table once: block_table (flash-attn 2's name) or page_table (FA3's)")
    return page_table if page_table is not None else block_table


def _tensor(name: str, t: object, dims: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {what}; got {t.dim()}-D shape {tuple(t.shape)}")
    return t


def _int32(name: str, t: object, shape: tuple[int, ...], q: torch.Tensor, what: str) -> None:
    _tensor(name, t, len(shape), what)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32; got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {what}; got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def _cache_strides(name: str, t: torch.Tensor) -> None:
    """The kernel reads the cache where it is (it is written in place): 16-byte rows, no copy. (The
    data pointer is checked where the kernel is called: a traced tensor has none.)"""
    step = _ALIGN // t.element_size()
    if t.stride(-1) != 1 or any(s % step for s in t.stride()[:-1]):
        raise ValueError(
            f"{name} must have a contiguous head_dim and strides that are multiples of 16 bytes (it is "
            f"read and written in place); got strides {tuple(t.stride())}"
        )


def _cache_pointers(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % _ALIGN:
            raise ValueError(f"{name}'s data pointer must be 16-byte aligned (it is read in place)")


def _validate(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
    softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
) -> tuple[bool, int, int, float, float]:  # fmt: skip
    """Raise TypeError/ValueError/NotImplementedError naming the argument; return (causal,
    window_left, window_right, softcap, softmax_scale) as the kernel takes them."""
    for name, value in (("cache_leftpad", cache_leftpad), ("alibi_slopes", alibi_slopes)):
        if value is not None:
            raise NotImplementedError(f"{name}: flash_attn_with_kvcache does not take {name} yet (pass None)")
    q = _tensor("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    layout = (
        "(num_pages, page_size, heads_kv, head_dim)"
        if page_table is not None
        else "(batch, seqlen_cache, heads_kv, head_dim)"
    )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4, layout)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype in FP8_DTYPES:
            raise NotImplementedError(
                f"{name} has dtype {t.dtype}: no fp8 KV-cache kernel yet (float16/bfloat16)"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; flash_attn_with_kvcache takes torch.float16 or torch.bfloat16"
            )
        if t.device.type not in validate.DEVICE_TYPES:
            raise ValueError(f"cutefa runs on CUDA tensors; got {name} on {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(
            f"q, k_cache and v_cache must have one dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
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
        _tensor("page_table", page_table, 2, "(batch, max_pages)")
        _int32("page_table", page_table, (batch, page_table.shape[1]), q, "(batch, max_pages)")
        page_size = k_cache.shape[1]
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(
                f"the paged cache's page_size (k_cache.shape[1]) must be a power of two; got {page_size}"
            )
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx is for a dense cache; a paged cache maps sequences through page_table"
            )
    else:
        if cache_batch_idx is not None:
            _int32("cache_batch_idx", cache_batch_idx, (batch,), q, "(batch,)")
        elif k_cache.shape[0] != batch:
            raise ValueError(
                f"the dense cache has {k_cache.shape[0]} sequences, q has {batch}: pass cache_batch_idx to map them"
            )
    if isinstance(cache_seqlens, torch.Tensor):
        _int32("cache_seqlens", cache_seqlens, (batch,), q, "(batch,)")
    elif cache_seqlens is not None and (
        isinstance(cache_seqlens, bool)
        or not isinstance(cache_seqlens, numbers.Integral)
        or cache_seqlens < 0
    ):
        raise TypeError(
            f"cache_seqlens must be an int32 tensor (batch,), an int >= 0 or None; got {cache_seqlens!r}"
        )
    _check_new(q, k_cache, k, v, cache_seqlens)
    _check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int (0: chosen by the heuristic); got {num_splits!r}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(
            f"num_splits must be in [0, {MAX_SPLITS}] (0: chosen by the heuristic); got {num_splits}"
        )
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real)
        or not (math.isfinite(softmax_scale) and softmax_scale > 0)
    ):
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")
    causal, left, right = mask_options(causal, window_size)
    return causal, left, right, check_softcap(softcap), default_scale(softmax_scale, head_dim)


def _check_new(q: torch.Tensor, k_cache: torch.Tensor, k: object, v: object, cache_seqlens: object) -> None:
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    if k is None:
        return
    shape = (
        q.shape[0],
        _tensor("k", k, 4, "(batch, seqlen_new, heads_kv, head_dim)").shape[1],
        *k_cache.shape[2:],
    )
    for name, t in (("k", k), ("v", v)):
        _tensor(name, t, 4, "(batch, seqlen_new, heads_kv, head_dim)")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape (batch, seqlen_new, heads_kv, head_dim) = {shape}; got {tuple(t.shape)}"
            )
        if t.dtype != k_cache.dtype or t.device != q.device:
            raise TypeError(
                f"{name} must be {k_cache.dtype} on {q.device} like the cache; got {t.dtype} on {t.device}"
            )
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
        _tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
        if not t.is_floating_point() or t.device != q.device:
            raise TypeError(f"{name} must be a float tensor on {q.device}; got {t.dtype} on {t.device}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"rotary_cos and rotary_sin must have one shape; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if not 0 < 2 * cos.shape[1] <= q.shape[-1]:
        raise ValueError(
            f"rotary_cos has {cos.shape[1]} columns: rotary_dim = 2 x that must be in (0, head_dim={q.shape[-1]}]"
        )


def _seqlens(
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


# ---------------------------------------------------------------------------------------------
# Rotary embedding and the append (torch)


def query_positions(seqlens: torch.Tensor, seqlen_q: int, per_token: bool) -> torch.Tensor:
    """Positions (batch, seqlen_q or 1) of the query tokens: cache_seqlens + i per token, or every
    token at cache_seqlens (flash-attn's rule when neither causal nor windowed)."""
    if not per_token:
        return seqlens.long().unsqueeze(1)
    return seqlens.long().unsqueeze(1) + torch.arange(seqlen_q, device=seqlens.device)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, heads, head_dim) at ``positions`` (batch, seqlen or 1)
    on its first 2 * cos.shape[1] dims, computed in float32: interleaved pairs (2i, 2i + 1) or the
    GPT-NeoX halves (i, i + rotary_dim / 2)."""
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


def _rotary_q(
    q: torch.Tensor, rotary_cos: torch.Tensor, rotary_sin: torch.Tensor, cache_seqlens: torch.Tensor, per_token: bool,
    rotary_interleaved: bool,
) -> torch.Tensor:  # fmt: skip
    """q rotated at :func:`query_positions` (a new tensor)."""
    return rotate(
        q, rotary_cos, rotary_sin, query_positions(cache_seqlens, q.shape[1], per_token), rotary_interleaved
    )


kvcache_rotary = torch.library.custom_op("cutefa::kvcache_rotary", _rotary_q, mutates_args=())


@kvcache_rotary.register_fake
def _rotary_fake(q, rotary_cos, rotary_sin, cache_seqlens, per_token, rotary_interleaved) -> torch.Tensor:
    return torch.empty_like(q)


def append_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None, page_table: torch.Tensor | None, rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None, rotary_interleaved: bool,
) -> None:  # fmt: skip
    """Write k, v (batch, n, heads_kv, head_dim) into the caches at positions cache_seqlens[b] + i
    (through page_table for a paged cache), k rotated first when rotary_cos is given. Only those
    slots change."""
    positions = cache_seqlens.long().unsqueeze(1) + torch.arange(k.shape[1], device=k.device)
    if rotary_cos is not None:
        k = rotate(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
    if page_table is not None:
        page_size = k_cache.shape[1]
        rows = page_table.long().gather(1, positions // page_size)
        slots = positions % page_size
    else:
        seq = torch.arange(k.shape[0], device=k.device) if cache_batch_idx is None else cache_batch_idx.long()
        rows, slots = seq.unsqueeze(1).expand_as(positions), positions
    k_cache.index_put_((rows, slots), k)
    v_cache.index_put_((rows, slots), v)


kvcache_append = torch.library.custom_op(
    "cutefa::kvcache_append", append_kv, mutates_args=("k_cache", "v_cache")
)


@kvcache_append.register_fake
def _append_fake(
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens,
    cache_batch_idx,
    page_table,
    rotary_cos,
    rotary_sin,
    rotary_interleaved,
) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# The attention op


def decode_spec(
    q: torch.Tensor, k_cache: torch.Tensor, paged: bool, causal: bool, windowed: bool, softcap: float
) -> VariantSpec:
    """The decode variant for the call (:func:`cutefa.model.policy_decode.decode_spec`)."""
    mask = Mask.LOCAL if windowed else Mask.CAUSAL if causal else Mask.NONE
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    return policy_decode.decode_spec(
        TORCH_DTYPE_NAMES[str(q.dtype).removeprefix("torch.")], q.shape[3], rows, mask=mask, paged=paged,
        softcap=softcap != 0.0,
    )  # fmt: skip


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device (memoized)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(
    spec: VariantSpec, q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor | None, target: str
) -> int:
    """The heuristic's split count for the call (shapes only: the cache's capacity stands for the
    lengths, which the kernel clamps to it)."""
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    return policy_decode.num_splits(
        batch=q.shape[0], heads_kv=k_cache.shape[2], row_tiles=policy_decode.row_tiles(spec, rows),
        seqlen_k=capacity(k_cache, page_table), tile_n=spec.tile_n, sm_count=sm_count(q.device),
        ctas_per_sm=policy_decode.ctas_per_sm(spec, target),
    )  # fmt: skip


def workspaces(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_partial (splits, batch, seqlen_q, heads_q, head_dim), lse_partial (splits, batch,
    heads_q, seqlen_q)) float32 for more than one split; one split: 1-element placeholders the
    kernel never reads (memoized per device and head dim)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    if splits == 1:
        return _placeholders(q.device, head_dim)
    o = torch.empty((splits, batch, seqlen_q, heads_q, head_dim), dtype=torch.float32, device=q.device)
    return o, torch.empty((splits, batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)


@functools.cache
def _placeholders(device: torch.device, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros((1, 1, 1, 1, head_dim), dtype=torch.float32, device=device),
        torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device),
    )


@functools.cache
def _no_batch_idx(device: torch.device) -> torch.Tensor:
    return torch.zeros((0,), dtype=torch.int32, device=device)


def window_bounds(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """The kernel's (left, right): -1 becomes UNBOUNDED; causal caps right at 0."""
    left = UNBOUNDED if window_left < 0 else window_left
    right = UNBOUNDED if window_right < 0 else window_right
    return left, min(right, 0) if causal else right


def kernel_args(
    spec: VariantSpec, q, k_cache, v_cache, out, lse, o_part, lse_part, seqlens, cache_batch_idx, page_table,
    scale, seqlen_new, causal, window_left, window_right, softcap,
) -> tuple:  # fmt: skip
    """The decode kernel's arguments in its order (templates/decode_sm80.py.j2's fake_arguments)."""
    cache_map = page_table.contiguous() if spec.features.paged_kv else (
        _no_batch_idx(q.device) if cache_batch_idx is None else cache_batch_idx.contiguous()
    )  # fmt: skip
    args = [
        q,
        k_cache,
        v_cache,
        out,
        lse,
        o_part,
        lse_part,
        seqlens,
        cache_map,
        float(scale),
        int(seqlen_new),
    ]
    if spec.mask is Mask.LOCAL:
        args += list(window_bounds(causal, window_left, window_right))
    if spec.features.softcap:
        args.append(float(softcap))
    return tuple(args)


def _launch(kernel, device: torch.device, *args) -> None:
    """Call the kernel on ``device`` (the tests put a CPU emulation here)."""
    call_on(device, kernel, *args)


def decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None, page_table: torch.Tensor | None, seqlen_new: int, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, num_splits: int,
    spec: VariantSpec | None = None, target: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The attention of :func:`flash_attn_with_kvcache` (its inputs validated): (out, lse).
    ``spec``/``target``: another decode variant or target than the policy's (tests, benchmarks)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    windowed = (window_left, window_right) != (-1, -1)
    if spec is None:
        spec = decode_spec(q, k_cache, page_table is not None, causal, windowed, softcap)
    if target is None:
        target = dispatch.device_target(q.device)[0]
    splits = num_splits or splits_for(spec, q, k_cache, page_table, target)
    o_part, lse_part = workspaces(q, splits)
    _cache_pointers(k_cache, v_cache)
    kernel = get_kernel(spec, target)
    q = aligned(q)
    args = kernel_args(
        spec, q, k_cache, v_cache, out, lse, o_part, lse_part, seqlens, cache_batch_idx, page_table, softmax_scale,
        seqlen_new, causal, window_left, window_right, softcap,
    )  # fmt: skip
    _launch(kernel, q.device, *args)
    dispatch.log_run(
        dispatch.Choice(spec, target, "decode policy"), q.shape, k_cache.shape, causal, f"num_splits={splits}"
    )
    return out, lse


def _attn(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None, page_table: torch.Tensor | None, seqlen_new: int, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return decode(
        q, k_cache, v_cache, cache_seqlens, cache_batch_idx, page_table, seqlen_new, softmax_scale, causal,
        window_left, window_right, softcap, num_splits,
    )  # fmt: skip


kvcache_attn = torch.library.custom_op("cutefa::kvcache_attn", _attn, mutates_args=())


def ops() -> tuple:
    """(rotary, append, attention): the custom ops (torch.compile, autograd and dispatch modes)."""
    return kvcache_rotary, kvcache_append, kvcache_attn


@kvcache_attn.register_fake
def _attn_fake(
    q, k_cache, v_cache, cache_seqlens, cache_batch_idx, page_table, seqlen_new, softmax_scale, causal, window_left,
    window_right, softcap, num_splits,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
