"""Attention of new query tokens against a KV cache: :func:`flash_attn_with_kvcache` (decode,
speculative decoding, chunked prefill), a dense or paged cache, new keys and values appended in
place, rotary embedding on q and the new keys.

One custom op carries it, ``cutefa::kvcache_attn`` (mutates ``k_cache`` and ``v_cache``;
graph-capturable: nothing here reads a GPU value, and every allocation depends on shapes only): the
decode kernel (templates/decode_sm80.py.j2, the sm80-family FlashAttention-2 design that runs on
sm80 and newer GPUs) in one host call of up to three launches:

- the append (with new ``k``/``v``, or rotary tables): the new keys and values written at cache
  index ``cache_seqlens[b] + i`` (into the right pages of a paged cache), the new keys rotated on
  the way, and q rotated into a new tensor (cutefa/kernels/sm80/decode_append.py; the torch
  reference is :mod:`cutefa.api.kvcache_reference`);
- the attention: the query heads of a kv head and the new tokens packed into one tile, the keys
  split across CTAs by :mod:`cutefa.model.policy_decode` (``num_splits=0``) or as asked;
- a combine kernel when there is more than one split.

The decode tile's schedule (:class:`cutefa.model.policy_decode.DecodeSchedule`: one warp per 16-row
slab, or warps splitting the keys of a 16-row tile) is ROWS unless the environment variable
``CUTEFA_DECODE_SCHEDULE`` says ``keys`` (read at each call, so that a benchmark compares both in
one process). Likewise its K/V copy layout (:class:`cutefa.model.policy_decode.DecodeCopy`: a
32-byte sector per thread pair, or a 128-byte line per 8 threads) is the policy's per call
(:func:`cutefa.model.policy_decode.default_copy`: LINES, SECTORS for a small paged cache) unless
``CUTEFA_DECODE_COPY`` says ``sectors`` or ``lines``; and a paged cache's page lookups
(:class:`cutefa.model.policy_decode.DecodePages`) are one per 16 keys with line copies and pages of
at least 16 keys, else one per row; ``CUTEFA_DECODE_PAGES=rows`` asks for a row's each always.

An e4m3 cache (q 16-bit, ``k_descale``/``v_descale``; :mod:`cutefa.api.kvcache_e4m3`) takes its own
op, ``cutefa::kvcache_attn_e4m3`` (it mutates the cache too: the append quantizes the new tokens with
the descales), and the decode variant with the e4m3 cache option (sm_90a and newer).

Limits. ``cache_seqlens`` (plus the new tokens) past the cache's capacity are clamped to it by the
kernel, and the new tokens past it are not written; a rotary position past ``rotary_cos``'s rows
takes its last row. Page ids are not range-checked (that costs launches on every decode step):
:meth:`cutefa.paged.PagedKVCache.check` validates a table in tests and debugging.
"""

from __future__ import annotations

import enum
import functools
import os

import torch

from cutefa import dispatch
from cutefa.api import mla
from cutefa.api.features import UNBOUNDED
from cutefa.api.kvcache_e4m3 import kv_descales
from cutefa.api.launch import aligned, call_on
from cutefa.api.plans import plain_eager
from cutefa.api.validate_kvcache import (
    capacity,
    check_cache_pointers,
    one_page_table,
    sequence_lengths,
    validate_call,
)
from cutefa.loader import get_kernel
from cutefa.model import policy_decode
from cutefa.model.options import CacheDtype, Mask
from cutefa.model.rules import why_invalid, why_not_on
from cutefa.model.spec import TORCH_DTYPE_NAMES, VariantSpec

SCHEDULE_ENV = "CUTEFA_DECODE_SCHEDULE"
COPY_ENV = "CUTEFA_DECODE_COPY"
PAGES_ENV = "CUTEFA_DECODE_PAGES"


# ---------------------------------------------------------------------------------------------
# The public function


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
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
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
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

    ``cache_leftpad`` int32 (batch,), dense cache only: sequence ``b``'s keys start at cache index
    ``cache_leftpad[b]`` (flash-attn's): it has ``cache_seqlens[b] - cache_leftpad[b]`` keys.

    ``k``, ``v`` (batch, seqlen_new, heads_kv, head_dim): new tokens written into the cache in place
    at ``cache_seqlens[b] + i`` (by the kernel's append launch), then attended to: the sequence has
    ``cache_seqlens[b] + seqlen_new`` keys. ``cache_seqlens`` itself is not updated.
    ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2) (q's dtype; others are converted):
    the new keys are rotated at their positions ``cache_seqlens[b] - cache_leftpad[b] + i``, and q
    at the same per token when causal or windowed, else all at ``cache_seqlens[b] -
    cache_leftpad[b]`` (flash-attn's rule); ``rotary_interleaved``: pairs (0, 1), (2, 3)... else
    GPT-NeoX halves. Rotary embedding needs ``k``.

    ``causal`` and ``window_size`` are aligned bottom-right (query token ``i`` of ``seqlen_q`` sits
    at key position ``i + seqlen_k - seqlen_q``); ``softcap`` as in :func:`cutefa.flash_attn_func`.
    ``num_splits``: 0 lets the split heuristic choose (from shapes and the GPU's SM count), N >= 1
    forces N splits of the keys (1: no combine). Returns ``out`` (like q), and with
    ``return_softmax_lse`` or ``return_lse`` also ``lse`` float32 (batch, heads_q, seqlen_q). A row
    with no key gets out 0 and lse -inf.

    ``v_cache=None``: MLA decode (:mod:`cutefa.api.mla`): ``k_cache`` is a paged latent cache
    (num_pages, page_size, 1, 576) whose first 512 columns are V; q (batch, seqlen_q, heads_q, 576),
    out of head dim 512.

    e4m3 cache (FA3's spelling): ``k_cache``/``v_cache`` of torch.float8_e4m3fn with q 16-bit, and
    ``k_descale``/``v_descale`` float32 (batch, heads_kv) (None: 1): the cache's values are
    ``descale * stored``. The descales must be finite and positive (checked on the GPU, without a
    host sync, by an asynchronous assert). Needs an sm_90a or newer GPU. New ``k``/``v`` (q's dtype)
    are appended quantized with the descales of their (batch, kv head), after the rotation (rounded to
    q's dtype): ``(x.float() / descale).clamp(-448, 448).to(torch.float8_e4m3fn)`` (round to nearest
    even, NaN kept). The descales are fixed, not updated: a token outside their range saturates at
    +-448.

    Not yet: ``alibi_slopes``, an e5m2 cache (each a NotImplementedError).
    """
    page_table = one_page_table(block_table, page_table)
    if v_cache is None:  # MLA: V is the latent cache's first 512 columns
        if k_descale is not None or v_descale is not None:
            raise NotImplementedError("k_descale/v_descale: the MLA decode has no e4m3 latent cache yet")
        out, lse = mla.from_kvcache(
            q, k_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
            softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
        )  # fmt: skip
        return (out, lse) if return_softmax_lse or return_lse else out
    call = validate_call(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        page_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
    )  # fmt: skip
    causal, window_left, window_right, softcap, scale = call
    descales = kv_descales(q, k_cache, k_descale, v_descale)
    seqlens = sequence_lengths(cache_seqlens, q, k_cache, page_table)
    if k is not None:
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    if rotary_cos is not None:
        rotary_cos, rotary_sin = (t.to(q.dtype).contiguous() for t in (rotary_cos, rotary_sin))
    tensors = [
        t
        for t in (
            k,
            v,
            rotary_cos,
            rotary_sin,
            seqlens,
            cache_batch_idx,
            cache_leftpad,
            page_table,
            *descales,
        )
        if t is not None
    ]
    # a plain eager call (inference, CUDA-graph capture) runs the op's implementation directly:
    # the same work without the op dispatcher's overhead, which a decode step feels
    direct = plain_eager(q, k_cache, v_cache, *tensors)
    if descales:
        attn_op = decode_e4m3 if direct else kvcache_attn_e4m3
        out, lse = attn_op(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad, page_table,
            *descales, scale, causal, window_left, window_right, softcap, rotary_interleaved, int(num_splits),
        )  # fmt: skip
        return (out, lse) if return_softmax_lse or return_lse else out
    attn_op = decode if direct else kvcache_attn
    out, lse = attn_op(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad, page_table, scale,
        causal, window_left, window_right, softcap, rotary_interleaved, int(num_splits),
    )  # fmt: skip
    return (out, lse) if return_softmax_lse or return_lse else out


# ---------------------------------------------------------------------------------------------
# The attention op


def _env_choice(name: str, kind: type[enum.Enum], default: enum.Enum | None, what: str):
    """The member of ``kind`` that environment variable ``name`` asks for (by value, any case), or
    ``default`` where it is unset or empty; a ValueError naming the known values otherwise."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(m.value for m in kind)
        raise ValueError(f"{name}={value!r} is not a {what}; known: {known}") from None


def decode_schedule() -> policy_decode.DecodeSchedule:
    """The decode schedule :data:`SCHEDULE_ENV` asks for (``rows``, the default, or ``keys``)."""
    return _env_choice(
        SCHEDULE_ENV, policy_decode.DecodeSchedule, policy_decode.DecodeSchedule.ROWS, "decode schedule"
    )


def decode_copy() -> policy_decode.DecodeCopy | None:
    """The decode copy layout :data:`COPY_ENV` asks for (``sectors`` or ``lines``), or None where it
    is unset or empty: the policy's per call (:func:`cutefa.model.policy_decode.default_copy`)."""
    return _env_choice(COPY_ENV, policy_decode.DecodeCopy, None, "decode copy layout")


def decode_pages() -> policy_decode.DecodePages:
    """How a paged decode finds its rows' pages, as :data:`PAGES_ENV` asks (``chunks``, the default:
    one page-table read per 16 keys where line copies and pages of at least 16 keys allow it, else per
    row; or ``rows``: per row)."""
    return _env_choice(
        PAGES_ENV, policy_decode.DecodePages, policy_decode.DecodePages.CHUNKS, "decode page lookup"
    )


def decode_spec(
    q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor | None, causal: bool, windowed: bool,
    softcap: float,
) -> VariantSpec:
    """The decode variant for the call (:func:`cutefa.model.policy_decode.decode_spec` with
    :func:`decode_schedule`, :func:`decode_copy` and :func:`decode_pages`; an e4m3 ``k_cache`` takes
    the e4m3-cache variant)."""
    mask = Mask.LOCAL if windowed else Mask.CAUSAL if causal else Mask.NONE
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    cache_dtype = CacheDtype.E4M3 if k_cache.dtype == torch.float8_e4m3fn else CacheDtype.SAME
    return policy_decode.decode_spec(
        TORCH_DTYPE_NAMES[str(q.dtype).removeprefix("torch.")], q.shape[3], rows, mask=mask,
        paged=page_table is not None, softcap=softcap != 0.0, cache_dtype=cache_dtype, schedule=decode_schedule(),
        copy=decode_copy(), kv_bytes=cache_bytes(q.shape[0], k_cache, page_table), pages=decode_pages(),
        page_size=None if page_table is None else k_cache.shape[1],
    )  # fmt: skip


def cache_bytes(batch: int, k_cache: torch.Tensor, page_table: torch.Tensor | None) -> int:
    """The K and V bytes a call's cache holds for its ``batch`` sequences at capacity (shapes only)."""
    per_token = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return 2 * batch * capacity(k_cache, page_table) * per_token


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
        ctas_per_sm=policy_decode.ctas_per_sm(spec, target), min_blocks=policy_decode.min_blocks_per_split(spec),
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
def _no_rows(device: torch.device) -> torch.Tensor:
    """An int32 tensor of 0 entries: no cache_batch_idx, no cache_leftpad."""
    return torch.zeros((0,), dtype=torch.int32, device=device)


@functools.cache
def _no_new_tokens(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_new with 0 tokens (1, 0, 1, head_dim), rotary table with 0 columns (1, 0)): no append, no
    rotation (memoized per device, dtype and head dim)."""
    return torch.zeros((1, 0, 1, head_dim), dtype=dtype, device=device), torch.zeros(
        (1, 0), dtype=dtype, device=device
    )


def window_bounds(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """The kernel's (left, right): -1 becomes UNBOUNDED; causal caps right at 0."""
    left = UNBOUNDED if window_left < 0 else window_left
    right = UNBOUNDED if window_right < 0 else window_right
    return left, min(right, 0) if causal else right


def kernel_args(
    spec: VariantSpec, q_in, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, out, lse, o_part, lse_part, seqlens,
    cache_batch_idx, cache_leftpad, page_table, scale, rotary_interleaved, causal, window_left, window_right, softcap,
    descales=(),
) -> tuple:  # fmt: skip
    """The decode kernel's arguments in its order (templates/decode_sm80.py.j2's fake_arguments):
    ``q_in`` the caller's q, ``q`` the tensor the attention reads (q_in itself without rotary
    embedding, else a new tensor the append launch writes); None for k, v, rotary_cos, rotary_sin,
    cache_batch_idx, cache_leftpad where absent; ``descales``: (k_descale, v_descale) of an e4m3
    cache."""
    no_new, no_table = _no_new_tokens(q.device, q.dtype, q.shape[3])
    if spec.features.paged_kv:
        cache_map = [page_table.contiguous()]
    else:
        cache_map = [
            _no_rows(q.device) if t is None else t.contiguous() for t in (cache_batch_idx, cache_leftpad)
        ]
    args = [
        q_in,
        q,
        k_cache,
        v_cache,
        no_new if k is None else k,
        no_new if v is None else v,
        no_table if rotary_cos is None else rotary_cos,
        no_table if rotary_sin is None else rotary_sin,
        out,
        lse,
        o_part,
        lse_part,
        seqlens,
        *cache_map,
        *descales,
        float(scale),
        int(bool(rotary_interleaved)),
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
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None, seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None, page_table: torch.Tensor | None,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
    num_splits: int, spec: VariantSpec | None = None, target: str | None = None, descales: tuple = (),
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The work of :func:`flash_attn_with_kvcache` (its inputs validated; ``rotary_cos``/``sin`` in
    q's dtype, ``k``/``v`` with a contiguous head dim): the append into ``k_cache``/``v_cache`` and
    the attention, (out, lse). ``spec``/``target``: another decode variant or target than the
    policy's (tests, benchmarks); ``descales``: (k_descale, v_descale) of an e4m3 cache."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        if k is not None and k.numel() > 0:
            raise ValueError("q has no query rows: the new k and v are appended by the attention's launch")
        return out, lse
    windowed = (window_left, window_right) != (-1, -1)
    if spec is None:
        spec = decode_spec(q, k_cache, page_table, causal, windowed, softcap)
    if target is None:
        target = dispatch.device_target(q.device)[0]
    if descales and (reason := why_invalid(spec) or why_not_on(spec, target)) is not None:
        raise NotImplementedError(f"k_cache of dtype {k_cache.dtype}: {reason}")
    splits = num_splits or splits_for(spec, q, k_cache, page_table, target)
    o_part, lse_part = workspaces(q, splits)
    check_cache_pointers(k_cache, v_cache)
    kernel = get_kernel(spec, target)
    q_in = aligned(q)
    # with rotary embedding the append launch writes the rotated q here, and the attention reads it
    q_attn = q_in if rotary_cos is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    args = kernel_args(
        spec, q_in, q_attn, k_cache, v_cache, k, v, rotary_cos, rotary_sin, out, lse, o_part, lse_part, seqlens,
        cache_batch_idx, cache_leftpad, page_table, softmax_scale, rotary_interleaved, causal, window_left,
        window_right, softcap, descales,
    )  # fmt: skip
    _launch(kernel, q.device, *args)
    dispatch.log_run(
        dispatch.Choice(spec, target, "decode policy"), q.shape, k_cache.shape, causal, f"num_splits={splits}"
    )
    return out, lse


def _attn(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None, cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None, page_table: torch.Tensor | None,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return decode(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
        softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits,
    )  # fmt: skip


kvcache_attn = torch.library.custom_op("cutefa::kvcache_attn", _attn, mutates_args=("k_cache", "v_cache"))


@kvcache_attn.register_fake
def _attn_fake(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
    softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)


def decode_e4m3(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None, cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None, page_table: torch.Tensor | None,
    k_descale: torch.Tensor, v_descale: torch.Tensor, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, rotary_interleaved: bool, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`decode` on an e4m3 cache with its descales (validated by :func:`kv_descales`): the
    append of ``k``/``v`` quantized, and the attention."""
    return decode(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
        softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits,
        descales=(k_descale, v_descale),
    )  # fmt: skip


kvcache_attn_e4m3 = torch.library.custom_op(
    "cutefa::kvcache_attn_e4m3", decode_e4m3, mutates_args=("k_cache", "v_cache")
)


@kvcache_attn_e4m3.register_fake
def _attn_e4m3_fake(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
    k_descale, v_descale, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
