"""MLA decode: DeepSeek's multi-head latent attention in its absorbed form, q of head dim 576 (512
latent + 64 rope columns) against one paged latent cache whose first 512 columns are also V.

Two spellings reach it:

- ``cutefa.flash_attn_with_kvcache(q, kv_cache, None, cache_seqlens=..., page_table=...,
  causal=..., softmax_scale=..., num_splits=..., return_softmax_lse=...)``: ``v_cache=None`` means
  "V is the first ``head_dim_v`` = 512 columns of the latent cache" (no separate V tensor);
- :func:`mla_decode` ``(q, kv_cache, page_table, cache_seqlens, head_dim_v=512, ...)``, FlashMLA's
  ``flash_mla_with_kvcache`` order (without its scheduler metadata: the split is chosen here).

q (batch, seqlen_q, heads_q, 576) fp16/bf16; kv_cache (num_pages, page_size, 1, 576) of q's dtype,
page_size a power of two (64 is DeepSeek's); page_table int32 (batch, max_pages); cache_seqlens
int32 (batch,). Returns out (batch, seqlen_q, heads_q, 512) and lse float32 (batch, heads_q,
seqlen_q). ``causal`` is bottom-right (query token i of seqlen_q sits at key position i + seqlen_k -
seqlen_q). The default softmax_scale is 1 / sqrt(576) (FlashMLA's and FA3's default; DeepSeek
passes its own).

One custom op, ``cutefa::mla_decode`` (nothing mutated; a fake implementation for torch.compile).
Graph-capturable: nothing here reads a GPU value, the split count and every allocation depend on
shapes only (the cache's capacity stands for the lengths, which the kernel clamps to it). Page ids
are not range-checked (:meth:`cutefa.paged.PagedKVCache.check` validates a table in tests).

Not yet: an e4m3 latent cache (NotImplementedError), a dense latent cache (pass a page table), GPUs
other than sm90 (H100/H200).
"""

from __future__ import annotations

import functools
import math

import torch

from cutefa import dispatch
from cutefa.api import validate
from cutefa.api.launch import aligned, call_on
from cutefa.api.plans import plain_eager
from cutefa.api.validate import int32_tensor, tensor_of_dims
from cutefa.api.validate_kvcache import capacity, sequence_lengths
from cutefa.fp8 import FP8_DTYPES
from cutefa.loader import get_kernel
from cutefa.model import policy_mla, policy_mla_wgmma
from cutefa.model.spec import TORCH_DTYPE_NAMES, VariantSpec

HEAD_DIM = policy_mla.HEAD_DIM
HEAD_DIM_V = policy_mla.HEAD_DIM_V
TARGET = "sm_90a"
_ALIGN = 16


# ---------------------------------------------------------------------------------------------
# The public functions


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor | int | None,
    head_dim_v: int = HEAD_DIM_V,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode (module docs): (out, lse). ``cache_seqlens`` an int32 tensor (batch,), an int, or
    None (every sequence fills its pages); ``num_splits`` 0 lets the heuristic choose."""
    validate_call(q, kv_cache, page_table, cache_seqlens, head_dim_v, softmax_scale, causal, num_splits)
    seqlens = sequence_lengths(cache_seqlens, q, kv_cache, page_table)
    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else float(softmax_scale)
    q = q if _rows_aligned(q) else q.contiguous()
    direct = plain_eager(q, kv_cache, page_table, seqlens)
    attn = decode if direct else mla_decode_op
    return attn(q, kv_cache, page_table.contiguous(), seqlens, scale, bool(causal), int(num_splits))


def from_kvcache(
    q, k_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
    softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`cutefa.flash_attn_with_kvcache` with ``v_cache=None`` (module docs): the arguments the
    MLA kernel has no use for must be left at their defaults."""
    unsupported = {
        "k": k, "v": v, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin, "cache_batch_idx": cache_batch_idx,
        "cache_leftpad": cache_leftpad, "alibi_slopes": alibi_slopes,
    }  # fmt: skip
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(
                f"{name}: MLA decode (v_cache=None: V is the latent cache's first {HEAD_DIM_V} columns) does not "
                f"take {name} yet (pass None)"
            )
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={window_size!r}: MLA decode takes no sliding window yet")
    if softcap:
        raise NotImplementedError(f"softcap={softcap!r}: MLA decode takes no softcap yet")
    if page_table is None:
        raise NotImplementedError(
            "MLA decode (v_cache=None) reads a paged latent cache: pass page_table (a dense latent cache is "
            "not supported yet)"
        )
    return mla_decode(
        q,
        k_cache,
        page_table,
        cache_seqlens,
        softmax_scale=softmax_scale,
        causal=causal,
        num_splits=num_splits,
    )


# ---------------------------------------------------------------------------------------------
# Checks (metadata only: they also run on fake tensors while torch.compile traces)


def _rows_aligned(t: torch.Tensor) -> bool:
    step = _ALIGN // t.element_size()
    return t.stride(-1) == 1 and all(s % step == 0 for s in t.stride()[:-1])


def validate_call(
    q: object, kv_cache: object, page_table: object, cache_seqlens: object, head_dim_v: object,
    softmax_scale: object, causal: object, num_splits: object,
) -> None:  # fmt: skip
    """Raise TypeError/ValueError/NotImplementedError naming the argument."""
    q = tensor_of_dims("q", q, 4, f"(batch, seqlen_q, heads_q, {HEAD_DIM})")
    kv_cache = tensor_of_dims("kv_cache", kv_cache, 4, f"(num_pages, page_size, 1, {HEAD_DIM})")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.dtype in FP8_DTYPES:
            raise NotImplementedError(
                f"{name} has dtype {t.dtype}: MLA decode with an e4m3 latent cache is not implemented yet "
                "(float16/bfloat16)"
            )
        if t.dtype not in validate.SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; MLA decode takes torch.float16 or torch.bfloat16")
        if t.device.type not in validate.DEVICE_TYPES:
            raise ValueError(f"cutefa runs on CUDA tensors; got {name} on {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if q.dtype != kv_cache.dtype:
        raise TypeError(f"q and kv_cache must have one dtype; got {q.dtype} and {kv_cache.dtype}")
    batch, _, heads_q, head_dim = q.shape
    if head_dim != HEAD_DIM:
        raise ValueError(
            f"q's head_dim={head_dim}: MLA decode takes q of head dim {HEAD_DIM} (512 latent + 64 rope columns)"
        )
    if kv_cache.shape[3] != HEAD_DIM or kv_cache.shape[2] != 1:
        raise ValueError(
            f"kv_cache must be (num_pages, page_size, 1, {HEAD_DIM}) (one latent head); got {tuple(kv_cache.shape)}"
        )
    if isinstance(head_dim_v, bool) or head_dim_v != HEAD_DIM_V:
        raise ValueError(f"head_dim_v={head_dim_v!r}: MLA decode takes head_dim_v={HEAD_DIM_V} only")
    if heads_q < 1 or batch > validate.GRID_YZ_LIMIT:
        raise ValueError(
            f"q must have at least one head and batch <= {validate.GRID_YZ_LIMIT}; got {tuple(q.shape)}"
        )
    if q.stride(-1) != 1:
        raise ValueError(f"q.stride(-1) must be 1 (contiguous head_dim); got {q.stride(-1)}")
    if not _rows_aligned(kv_cache):
        raise ValueError(
            "kv_cache must have a contiguous head_dim and strides that are multiples of 16 bytes (it is read in "
            f"place); got strides {tuple(kv_cache.stride())}"
        )
    if page_table is None:
        raise NotImplementedError("MLA decode reads a paged latent cache: pass page_table")
    tensor_of_dims("page_table", page_table, 2, "(batch, max_pages)")
    int32_tensor("page_table", page_table, (batch, page_table.shape[1]), q, "(batch, max_pages)")
    page_size = kv_cache.shape[1]
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(
            f"the latent cache's page_size (kv_cache.shape[1]) must be a power of two; got {page_size}"
        )
    validate.check_cache_seqlens(cache_seqlens, batch, q)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    validate.check_split_options(num_splits, softmax_scale)


# ---------------------------------------------------------------------------------------------
# The op


def spec_for(q: torch.Tensor, causal: bool) -> VariantSpec:
    """The MLA decode variant of the call: the WGMMA kernel (:func:`cutefa.model.policy_mla_wgmma.mla_spec`)
    at every row count. H100, page 64, bf16, microseconds mma.sync / WGMMA: batch 64 x 8k at 16 / 64 /
    128 query heads 235 / 240, 414 / 287, 809 / 383; batch 1 x 32k 54 / 40, 62 / 44, 144 / 68; batch
    16 x 16k 134 / 137, 220 / 173, 401 / 210 (the mma.sync kernel, :func:`cutefa.model.policy_mla.mla_spec`,
    stays a variant: within 2% at 16 heads, never ahead by more)."""
    dtype = TORCH_DTYPE_NAMES[str(q.dtype).removeprefix("torch.")]
    return policy_mla_wgmma.mla_spec(dtype, causal=causal)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device (memoized)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(spec: VariantSpec, q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor) -> int:
    """The heuristic's split count (shapes only)."""
    return policy_mla.num_splits(
        batch=q.shape[0], row_tiles=policy_mla.row_tiles(spec, q.shape[1] * q.shape[2]),
        seqlen_k=capacity(kv_cache, page_table), sm_count=sm_count(q.device),
    )  # fmt: skip


def workspaces(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_partial (splits, batch, seqlen_q, heads_q, 512), lse_partial (splits, batch, heads_q,
    seqlen_q)) float32; one split: 1-element placeholders the kernel never reads."""
    batch, seqlen_q, heads_q, _ = q.shape
    if splits == 1:
        return _placeholders(q.device)
    o = torch.empty((splits, batch, seqlen_q, heads_q, HEAD_DIM_V), dtype=torch.float32, device=q.device)
    return o, torch.empty((splits, batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)


@functools.cache
def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros((1, 1, 1, 1, HEAD_DIM_V), dtype=torch.float32, device=device),
        torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device),
    )


def kernel_args(q, kv_cache, out, lse, o_part, lse_part, seqlens, page_table, scale) -> tuple:
    """The kernel's arguments in its order (templates/decode_mla_sm90.py.j2's fake_arguments)."""
    return (q, kv_cache, out, lse, o_part, lse_part, seqlens, page_table, float(scale))


def _launch(kernel, device: torch.device, *args) -> None:
    """Call the kernel on ``device`` (the tests put a CPU emulation here)."""
    call_on(device, kernel, *args)


def _outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty((batch, seqlen_q, heads_q, HEAD_DIM_V), dtype=q.dtype, device=q.device)
    return out, torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)


def decode(
    q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seqlens: torch.Tensor, softmax_scale: float,
    causal: bool, num_splits: int, spec: VariantSpec | None = None, target: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The work of :func:`mla_decode` (inputs validated): (out, lse). ``spec``/``target``: another
    variant or target than the policy's (tests, benchmarks)."""
    out, lse = _outputs(q)
    if out.numel() == 0:
        return out, lse
    if spec is None:
        spec = spec_for(q, causal)
    if target is None:
        target = dispatch.device_target(q.device)[0]
        if target != TARGET:
            raise NotImplementedError(
                f"MLA decode runs on sm90 GPUs (H100/H200, target {TARGET}) only; this GPU is {target}"
            )
    splits = num_splits or splits_for(spec, q, kv_cache, page_table)
    o_part, lse_part = workspaces(q, splits)
    if kv_cache.data_ptr() % _ALIGN:
        raise ValueError("kv_cache's data pointer must be 16-byte aligned (it is read in place)")
    kernel = get_kernel(spec, target)
    args = kernel_args(aligned(q), kv_cache, out, lse, o_part, lse_part, seqlens, page_table, softmax_scale)
    _launch(kernel, q.device, *args)
    dispatch.log_run(
        dispatch.Choice(spec, target, "MLA decode policy"),
        q.shape,
        kv_cache.shape,
        causal,
        f"num_splits={splits}",
    )
    return out, lse


def _op(
    q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, cache_seqlens: torch.Tensor,
    softmax_scale: float, causal: bool, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return decode(q, kv_cache, page_table, cache_seqlens, softmax_scale, causal, num_splits)


mla_decode_op = torch.library.custom_op("cutefa::mla_decode", _op, mutates_args=())


@mla_decode_op.register_fake
def _op_fake(q, kv_cache, page_table, cache_seqlens, softmax_scale, causal, num_splits):
    return _outputs(q)
