"""The user-facing forward: input validation, the ``cutefa::flash_fwd`` custom op, autograd, the API.

Layout is (batch, seqlen, heads, head_dim) for q, k and v; k and v may have fewer heads than q
(grouped-query attention: query head ``h`` reads key/value head ``h // (heads_q // heads_kv)``).
Causal masking is aligned bottom-right: query ``i`` attends key ``j`` iff
``j <= i + seqlen_k - seqlen_q``.

Edge cases: an empty problem (batch, seqlen_q or heads_q of 0) returns empty results without a
launch. With ``seqlen_k == 0`` and ``seqlen_q > 0`` every query row attends no key: the output is
0 and the log-sum-exp is ``-inf``, again without a launch. Inputs whose strides (other than the
last) are not multiples of 16 bytes, or whose data pointer is not 16-byte aligned, are copied to a
contiguous tensor first; a last dim that is not contiguous (``stride(-1) != 1``) is an error.

``torch.compile``, autograd and dispatch modes go through the ``cutefa::flash_fwd`` op. A plain
eager call with nothing to differentiate skips the op dispatcher (tens of microseconds) and, from
its second call on, takes the *call plan* memoized for its signature (shapes of q and k, dtype,
device, causal, softmax_scale): the kernel, its dispatch choice and allocation recipes, with no
validation beyond what the key and the kernel's own argument checks already guarantee (see
:func:`_make_plan`). Kernels run on the current torch stream of the tensors' device, and nothing
on the call path synchronizes with the GPU, so calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from cutefa import backward as _backward_pass
from cutefa import dispatch, space
from cutefa import profile as _profile
from cutefa.compile import get_kernel
from cutefa.fp8 import add_v_mean
from cutefa.space import why_invalid
from cutefa.spec import HEAD_DIMS

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
)
FP8_INPUT_DTYPE = torch.float8_e4m3fn  # the fp8 format of the sm90 and sm100 fp8 forwards
FP8_OUT_DTYPES = (torch.bfloat16,)  # the fp8 forward's output dtypes (the kernel writes bf16)
# Device types the kernels run on; the validation tests widen it.
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
_ALIGN_BYTES = 16
_NAMES = ("q", "k", "v")


# ---------------------------------------------------------------------------------------------
# Validation (metadata only: also runs on fake tensors while torch.compile traces)


def _check_tensors(tensors: Sequence[object]) -> tuple[torch.Tensor, ...]:
    for name, t in zip(_NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim); got {t.dim()}-D shape {tuple(t.shape)}"
            )
    return tuple(tensors)  # type: ignore[arg-type]  # each was checked above


def _check_dtypes(tensors: Sequence[torch.Tensor], fp8: bool = False) -> None:
    """16-bit inputs, or with ``fp8`` float8_e4m3fn inputs (the only fp8 format with a kernel)."""
    for name, t in zip(_NAMES, tensors):
        if fp8:
            if t.dtype in FP8_DTYPES and t.dtype != FP8_INPUT_DTYPE:
                raise NotImplementedError(
                    f"{name} has dtype {t.dtype}: cutefa's fp8 forward takes torch.float8_e4m3fn only"
                )
            if t.dtype != FP8_INPUT_DTYPE:
                raise TypeError(
                    f"{name} has dtype {t.dtype}; an fp8 call needs q, k and v all torch.float8_e4m3fn"
                )
            continue
        if t.dtype in FP8_DTYPES:
            raise NotImplementedError(
                f"{name} has dtype {t.dtype}: fp8 inputs go through the fp8 forward (float8_e4m3fn with "
                "q_descale/k_descale/v_descale); this path takes torch.float16 or torch.bfloat16"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; cutefa accepts torch.float16 or torch.bfloat16")
    if len({t.dtype for t in tensors}) > 1:
        got = ", ".join(f"{n} {t.dtype}" for n, t in zip(_NAMES, tensors))
        raise TypeError(f"q, k and v must have one dtype; got {got}")


def _check_devices(tensors: Sequence[torch.Tensor], device_types: Sequence[str]) -> None:
    for name, t in zip(_NAMES, tensors):
        if t.device.type not in device_types:
            raise ValueError(f"cutefa runs on CUDA tensors; got {name} on {t.device}")
    if len({t.device for t in tensors}) > 1:
        got = ", ".join(f"{n} on {t.device}" for n, t in zip(_NAMES, tensors))
        raise ValueError(f"q, k and v must be on one device; got {got}")


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k has {k.shape[0]}, v has {v.shape[0]}")
    if not q.shape[3] == k.shape[3] == v.shape[3]:
        raise ValueError(
            f"head_dim differs: q has {q.shape[3]}, k has {k.shape[3]}, v has {v.shape[3]}; they must be equal"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"q's heads ({heads_q}) must be a multiple of k/v's heads ({heads_kv}) (grouped-query attention)"
        )
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim={q.shape[3]} is not supported; cutefa supports head_dim in {HEAD_DIMS}")


def _check_strides(tensors: Sequence[torch.Tensor]) -> None:
    for name, t in zip(_NAMES, tensors):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}.stride(-1) must be 1 (contiguous head_dim); got {t.stride(-1)}; pass {name}.contiguous()"
            )


def _check_options(causal: object, softmax_scale: object) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")


def validate_inputs(
    q: object,
    k: object,
    v: object,
    *,
    causal: object = False,
    softmax_scale: object = None,
    device_types: Sequence[str] | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError``/``NotImplementedError`` naming what is wrong with the inputs.

    ``device_types`` defaults to :data:`DEVICE_TYPES` (CUDA). Only metadata is read.
    """
    tensors = _check_tensors((q, k, v))
    _check_dtypes(tensors)
    _check_devices(tensors, DEVICE_TYPES if device_types is None else device_types)
    _check_shapes(*tensors)
    _check_strides(tensors)
    _check_options(causal, softmax_scale)


# ---------------------------------------------------------------------------------------------
# The custom op


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernel's 16-byte row/pointer alignment holds, else a contiguous copy."""
    step = _ALIGN_BYTES // t.element_size()
    if t.data_ptr() % _ALIGN_BYTES == 0 and all(s % step == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _choose(q: torch.Tensor, k: torch.Tensor, causal: bool, v_centered: bool = False) -> dispatch.Choice:
    with _profile.phase("device query"):
        target, gpu_name = dispatch.device_target(q.device)
    batch, seqlen_q, heads_q, head_dim = q.shape
    with _profile.phase("dispatch (tuned tables)"):
        return dispatch.choose(
            target=target, dtype=q.dtype, head_dim=head_dim, causal=causal, seqlen_q=seqlen_q,
            seqlen_k=k.shape[1], batch=batch, heads_q=heads_q, heads_kv=k.shape[2], gpu_name=gpu_name,
            v_centered=v_centered,
        )  # fmt: skip


# Kernels (by id; they are memoized for the process) whose first call was profiled.
_PROFILED_KERNELS: set[int] = set()


def _first_call_phase(kernel: Callable[..., Any]) -> Any:
    """With profiling on, a phase around the first call of ``kernel`` (where the CUDA module of
    its cubin is loaded); else a no-op context."""
    if not _profile.ENABLED or id(kernel) in _PROFILED_KERNELS:
        return _profile.OFF
    _PROFILED_KERNELS.add(id(kernel))
    return _profile.phase("first kernel call (module load, launch)")


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, softmax_scale: float,
) -> tuple[dispatch.Choice, Callable[..., Any]]:  # fmt: skip
    """Dispatch and run the kernel on the current stream of q's device, writing ``out`` and ``lse``.

    Returns what ran: (the dispatch choice, the kernel)."""
    choice = _choose(q, k, causal)
    kernel = get_kernel(choice.spec, choice.target)
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    with _first_call_phase(kernel):
        if q.device.index == torch.cuda.current_device():
            kernel(q, k, v, out, lse, softmax_scale)
        else:
            with torch.cuda.device(q.device):
                kernel(q, k, v, out, lse, softmax_scale)
    dispatch.log_run(choice, q.shape, k.shape, causal)
    return choice, kernel


def _empty_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)


def _flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention forward: returns (out like q, lse float32 (batch, heads_q, seqlen_q)).
    ``deterministic`` only selects the backward's mode (saved for autograd)."""
    out, lse, _ = _forward(q, k, v, causal, softmax_scale)
    return out, lse


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[dispatch.Choice, Callable[..., Any]] | None]:
    """Validate, allocate and launch: (out, lse, what ran or None when nothing was launched)."""
    validate_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    out, lse = _empty_outputs(q)
    if out.numel() == 0:
        return out, lse, None
    if k.shape[1] == 0:  # no keys: every row attends nothing
        return out.zero_(), lse.fill_(-math.inf), None
    launched = _launch(q, k, v, out, lse, causal, softmax_scale)
    return out, lse, launched


flash_fwd = torch.library.custom_op("cutefa::flash_fwd", _flash_fwd, mutates_args=())


@flash_fwd.register_fake
def _flash_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    validate_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return _empty_outputs(q)


# Gradients of out and lse (return_lse=True) come from cutefa::flash_bwd (cutefa/backward.py).
torch.library.register_autograd(
    "cutefa::flash_fwd", _backward_pass.backward, setup_context=_backward_pass.setup_context
)


# ---------------------------------------------------------------------------------------------
# The fp8 (e4m3) forward: ``cutefa::flash_fwd_fp8``

_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def _fp8_descale(name: str, d: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A float32 (batch, heads_kv) descale on q's device from None (1), a 0-d/1-element tensor
    (per tensor) or a (batch, heads_kv) tensor; a (batch, heads_kv, blocks) block descale is
    passed on (contiguous) as it is: its block count is checked against the kernel's tiles at
    launch (:func:`_fp8_kernel_args`)."""
    batch, heads_kv = q.shape[0], k.shape[2]
    if d is None:
        return torch.ones((batch, heads_kv), dtype=torch.float32, device=q.device)
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{name} must be a float32 torch.Tensor or None; got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise TypeError(f"{name} must be float32; got dtype {d.dtype}")
    if d.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}; got {d.device}")
    if d.numel() == 1 and d.dim() <= 2:
        return _per_tensor(d, batch, heads_kv)
    if tuple(d.shape) != (batch, heads_kv) and not (d.dim() == 3 and tuple(d.shape[:2]) == (batch, heads_kv)):
        raise ValueError(
            f"{name} must have shape () or (batch, heads_kv) = {(batch, heads_kv)}, or (batch, heads_kv, blocks) "
            f"= {(batch, heads_kv, 'blocks')} for block quantization; got {tuple(d.shape)} (with grouped-query "
            "attention q's descale is per kv head too: quantize q with group=heads_q // heads_kv)"
        )
    return d if d.is_contiguous() else d.clone(memory_format=torch.contiguous_format)


def _per_tensor(d: torch.Tensor, batch: int, heads_kv: int) -> torch.Tensor:
    """A one-element (per-tensor) descale as the kernel's contiguous (batch, heads_kv) one."""
    return d.reshape(1, 1).expand(batch, heads_kv).clone(memory_format=torch.contiguous_format)


def _block_choice(choice: dispatch.Choice) -> dispatch.Choice:
    """The block-quantization variant (``block_quant``) of the dispatched e4m3 forward ``choice``:
    its twin with the flag where that is committed, else the committed block variant of the head
    dim and mask (a tuned table may pick a tile whose block twin is not built, e.g. one that would
    spill with the block scales' registers)."""
    spec = choice.spec.replace(block_quant=True)
    reason = f"{choice.reason}; block quantization (_blockq)"
    committed = [
        s for s in space.fp8_block_specs(spec.arch) if (s.head_dim, s.causal) == (spec.head_dim, spec.causal)
    ]
    if committed and spec not in committed:
        spec = committed[0]
        reason = f"{choice.reason}; block quantization on the committed {spec.name} ({choice.spec.name} has no block twin)"
    why_not = why_invalid(spec)
    if why_not is not None:
        raise NotImplementedError(
            f"block-quantized fp8 descales (3-D) have no kernel for {choice.spec.name} on {choice.target}: "
            f"{why_not}; use per-tensor or per-head descales there"
        )
    return dataclasses.replace(choice, spec=spec, reason=reason)


def _block_descale(name: str, d: torch.Tensor, seqlen_name: str, seqlen: int, tile: str, rows: int, spec: Any
) -> torch.Tensor:  # fmt: skip
    """``d`` (batch, heads_kv) or (batch, heads_kv, blocks) as the (batch, heads_kv, ceil(seqlen /
    rows)) descale of the block kernel, whose ``tile`` is ``rows`` rows; a block count that does not
    fit is a ValueError naming both block sizes."""
    blocks = -(-seqlen // rows)
    if d.dim() == 2:
        return d[:, :, None].expand(*d.shape, blocks)
    if d.shape[2] != blocks:
        given = -(-seqlen // d.shape[2])
        raise ValueError(
            f"{name} must have shape (batch, heads_kv, ceil({seqlen_name} / {rows})) = {(*d.shape[:2], blocks)}: "
            f"the dispatched kernel {spec.name} quantizes in blocks of its {tile}={rows} rows; got "
            f"{tuple(d.shape)}, {d.shape[2]} blocks for {seqlen_name}={seqlen} (blocks of about {given} rows). "
            f"Quantize with cutefa.quantize_fp8(x, 'block', block={rows}); cutefa.fp8_block_sizes(q, k, causal=...) "
            "returns the block sizes for a problem"
        )
    return d


def _fp8_kernel_args(
    q: torch.Tensor, k: torch.Tensor, descales: Sequence[torch.Tensor], choice: dispatch.Choice
) -> tuple[dispatch.Choice, tuple[torch.Tensor, ...]]:
    """What the fp8 kernel takes after (q, k, v, out, lse), and the variant that takes it.

    Per-tensor/per-head descales (all (batch, heads_kv)) go to the dispatched variant unchanged.
    With any 3-D (block) descale the block-quantization variant runs (:func:`_block_choice`); every
    descale is brought to its blocks (a (batch, heads_kv) one is broadcast over them) and the kernel
    takes (q_descale (batch, heads_kv, q blocks), kv_scales (batch, heads_kv, k blocks, 4),
    v_descale (batch, heads_kv)): per key block (k descale, log2 r, 1 / r, 0), r = v's block descale
    over its largest one, that largest one being v_descale (the kernel folds log2 r into the exp2
    of the block's probabilities, which then stay normal e4m3 numbers, and O is multiplied by the
    largest descale at the end; templates/fwd_sm90_fp8.py.j2). Descales must be positive.
    """
    if all(d.dim() == 2 for d in descales):
        return choice, tuple(descales)
    choice = _block_choice(choice)
    spec = choice.spec
    qd, kd, vd = (
        _block_descale(name, d, seqlen_name, x.shape[1], tile, rows, spec)
        for name, d, seqlen_name, x, tile, rows in zip(
            _DESCALE_NAMES, descales, ("seqlen_q", "seqlen_k", "seqlen_k"), (q, k, k),
            ("tile_m", "tile_n", "tile_n"), (spec.tile_m, spec.tile_n, spec.tile_n),
        )
    )  # fmt: skip
    v_max = vd.amax(dim=2)
    ratio = vd / v_max[:, :, None]
    kv_scales = torch.stack((kd, torch.log2(ratio), 1.0 / ratio, torch.zeros_like(kd)), dim=-1).contiguous()
    return choice, (qd.contiguous(), kv_scales, v_max.contiguous())


def fp8_block_sizes(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, target: str | None = None
) -> tuple[int, int]:
    """``(q_block, kv_block)``: the rows per descale that block-quantized fp8 inputs of this problem
    need, the tile_m and tile_n of the e4m3 forward that :func:`flash_attn_func` dispatches for it.

    Only shapes are read, so q and k may be the tensors before quantization (any dtype):
    ``cutefa.quantize_fp8(q, "block", block=q_block, group=heads_q // heads_kv)``, and k and v with
    ``block=kv_block``. ``target`` (e.g. 'sm_90a') answers for that compile target instead of the
    GPU of q's device. Raises NotImplementedError where the dispatched family has no
    block-quantization kernel (only the sm90 family has one).
    """
    tensors = _check_tensors((q, k, k))
    _check_options(causal, None)
    if target is None:
        _check_devices(tensors, DEVICE_TYPES)
        target, gpu_name = dispatch.device_target(q.device)
    else:
        gpu_name = None
    batch, seqlen_q, heads_q, head_dim = q.shape
    if k.shape[3] != head_dim or k.shape[0] != batch:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have one batch size and head_dim")
    choice = dispatch.choose(
        target=target, dtype=FP8_INPUT_DTYPE, head_dim=head_dim, causal=causal, seqlen_q=seqlen_q,
        seqlen_k=k.shape[1], batch=batch, heads_q=heads_q, heads_kv=k.shape[2], gpu_name=gpu_name,
    )  # fmt: skip
    spec = _block_choice(choice).spec
    return spec.tile_m, spec.tile_n


def validate_fp8_inputs(
    q: object, k: object, v: object, *, causal: object = False, softmax_scale: object = None,
    device_types: Sequence[str] | None = None,
) -> None:  # fmt: skip
    """:func:`validate_inputs` for an fp8 call: q, k and v all float8_e4m3fn."""
    tensors = _check_tensors((q, k, v))
    _check_dtypes(tensors, fp8=True)
    _check_devices(tensors, DEVICE_TYPES if device_types is None else device_types)
    _check_shapes(*tensors)
    _check_strides(tensors)
    _check_options(causal, softmax_scale)


def _fp8_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty(q.shape, dtype=FP8_OUT_DTYPES[0], device=q.device)
    return out, torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)


def _flash_fwd_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor, k_descale: torch.Tensor,
    v_descale: torch.Tensor, causal: bool, softmax_scale: float, v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fp8 attention forward: e4m3 q/k/v, float32 (batch, heads_kv) descales, or (batch, heads_kv,
    blocks) block descales for any of them (:func:`_fp8_kernel_args`); returns (out bf16, lse
    float32 (batch, heads_q, seqlen_q)) of the dequantized problem. ``v_mean`` (float32 (batch,
    heads_kv, head_dim), validated by the caller): v was centered, the mean goes back on the output."""
    validate_fp8_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    out, lse, _ = _fp8_forward(q, k, v, (q_descale, k_descale, v_descale), causal, softmax_scale, v_mean)
    return out, lse


def _fp8_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    causal: bool, softmax_scale: float, v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[dispatch.Choice, Callable[..., Any]] | None]:  # fmt: skip
    """:func:`_flash_fwd_fp8` on validated inputs, plus what ran: (the dispatch choice, the kernel),
    or None when nothing was launched (an empty problem, no keys, or block descales). With
    ``v_mean`` dispatch takes the variants for centered v (``v_centered``) and the mean goes back on
    the rows that attend a key (:func:`_launch_fp8`: in the kernel or after it)."""
    out, lse = _fp8_outputs(q)
    if out.numel() == 0:
        return out, lse, None
    if k.shape[1] == 0:  # no keys: every row attends nothing
        return out.zero_(), lse.fill_(-math.inf), None
    launched = _launch_fp8(q, k, v, out, lse, descales, causal, softmax_scale, v_mean)
    return out, lse, launched


def _launch_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor], causal: bool, softmax_scale: float,
    v_mean: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Dispatch (an e4m3 variant; its block-quantization variant for 3-D descales) and run the fp8
    kernel on the current stream of q's device. Returns what ran, (the dispatch choice, the kernel),
    for per-head descales (the call path a plan can repeat); None for block descales. With
    ``v_mean`` dispatch asks for centered v; a variant with the ``v_mean`` flag takes the means and
    adds them itself, after any other :func:`cutefa.fp8.add_v_mean` adds them to ``out``."""
    choice, args = _fp8_kernel_args(q, k, descales, _choose(q, k, causal, v_mean is not None))
    if choice.spec.v_mean:
        args = (*args, v_mean.contiguous())  # type: ignore[union-attr]
    kernel = get_kernel(choice.spec, choice.target)
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    with _first_call_phase(kernel):
        if q.device.index == torch.cuda.current_device():
            kernel(q, k, v, out, lse, *args, softmax_scale)
        else:
            with torch.cuda.device(q.device):
                kernel(q, k, v, out, lse, *args, softmax_scale)
    if v_mean is not None and not choice.spec.v_mean:
        add_v_mean(out, v_mean, k.shape[1], causal)
    dispatch.log_run(choice, q.shape, k.shape, causal)
    return (choice, kernel) if all(d.dim() == 2 for d in descales) else None


flash_fwd_fp8 = torch.library.custom_op("cutefa::flash_fwd_fp8", _flash_fwd_fp8, mutates_args=())


@flash_fwd_fp8.register_fake
def _flash_fwd_fp8_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor, k_descale: torch.Tensor,
    v_descale: torch.Tensor, causal: bool, softmax_scale: float, v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    validate_fp8_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return _fp8_outputs(q)


def _fp8_backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor) -> tuple[None, ...]:
    raise NotImplementedError(
        "cutefa has no backward for the fp8 (float8_e4m3fn) forward; train with float16/bfloat16 "
        "inputs, or call the fp8 forward on tensors that do not require grad"
    )


torch.library.register_autograd("cutefa::flash_fwd_fp8", _fp8_backward)


def _fp8_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: object, softmax_scale: object, return_lse: bool,
    deterministic: object, q_descale: object, k_descale: object, v_descale: object, out_dtype: object,
    v_mean: object = None, key: tuple[Any, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """flash_attn_func for a call with fp8 inputs or fp8 options: validate, normalise the descales,
    run ``cutefa::flash_fwd_fp8`` (directly when nothing traces or differentiates). A plain call
    that launched a kernel leaves its plan under ``key`` (:func:`_make_fp8_plan`)."""
    if v_mean is not None:
        _check_v_mean(v_mean, q, k, v)
    if q.dtype not in FP8_DTYPES:
        given = [n for n, d in zip(_DESCALE_NAMES, (q_descale, k_descale, v_descale)) if d is not None]
        given += ["out_dtype"] if out_dtype is not None else []
        raise ValueError(
            f"{', '.join(given)} apply to fp8 (torch.float8_e4m3fn) inputs only; got q with dtype {q.dtype}"
        )
    _check_options(causal, softmax_scale)
    _check_deterministic(deterministic)
    if out_dtype is not None and out_dtype not in FP8_OUT_DTYPES:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None; got {out_dtype!r}")
        raise NotImplementedError(f"out_dtype={out_dtype}: the fp8 forward writes {FP8_OUT_DTYPES[0]} output only")
    validate_fp8_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    descales = [_fp8_descale(n, d, q, k) for n, d in zip(_DESCALE_NAMES, (q_descale, k_descale, v_descale))]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    tensors = (q, k, v, *descales) + ((v_mean,) if v_mean is not None else ())
    plain = all(type(t) is _Tensor for t in tensors) and not _is_compiling() and not _dispatch_modes()
    if plain and not (_grad_enabled() and any(t.requires_grad for t in tensors)):  # type: ignore[attr-defined]
        out, lse, launched = _fp8_forward(q, k, v, tuple(descales), causal, scale, v_mean)  # type: ignore[arg-type]
        # No plan while a CUDA graph is being captured (its allocations would come from the graph's pool).
        if launched is not None and key is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            given = (q_descale, k_descale, v_descale)
            plan = _make_fp8_plan(*launched, q, k, causal, softmax_scale, scale, out_dtype, given, v_mean is not None)  # type: ignore[arg-type]
            _remember(_FP8_PLANS, key, plan)
    else:
        out, lse = flash_fwd_fp8(q, k, v, *descales, causal, scale, v_mean)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# The eager call path: one memoized plan per call signature

# (q.shape, k.shape, q.dtype, q.is_cuda, q.get_device(), causal, softmax_scale) -> plan(q, k, v,
# return_lse). The device is keyed by (is_cuda, index): hashing and comparing a torch.device costs
# several times more. Only CUDA tensors get plans outside tests; a tensor of another device type
# with a colliding key gets its outputs on the plan's device, which the kernel refuses, so it
# takes the validating way like any refused call.
_PLANS: dict[tuple[Any, ...], Callable[..., Any]] = {}
MAX_PLANS = 1024  # the oldest plan is dropped beyond this (e.g. a new seqlen on every call)
# Per device: float32 buffers the kernel writes an unwanted lse into (return_lse=False). Never
# freed, so a kernel still writing one on any stream never writes memory handed out again.
_SCRATCH: dict[torch.device, list[torch.Tensor]] = {}
MAX_SCRATCH_ELEMENTS = 1 << 22  # 16 MiB of lse; larger problems allocate their lse per call
# Per (device, dtype): a one-element tensor; expanded views of it are allocation templates.
_PROTOS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_PLAN_LOCK = threading.Lock()
# fp8 calls: (the 16-bit key, the kind of each descale (_descale_kind), out_dtype, the kind of
# v_mean) -> plan(q, k, v, q_descale, k_descale, v_descale, v_mean, return_lse). Calls with block
# descales (3-D) have no plan.
_FP8_PLANS: dict[tuple[Any, ...], Callable[..., Any]] = {}


def clear_plans() -> None:
    """Forget the memoized call plans (:func:`cutefa.dispatch.clear_caches` does it too)."""
    _PLANS.clear()
    _FP8_PLANS.clear()


def _remember(plans: dict[tuple[Any, ...], Callable[..., Any]], key: tuple[Any, ...], plan: Callable[..., Any]) -> None:
    """``plans[key] = plan``, dropping the oldest plans beyond :data:`MAX_PLANS`."""
    with _PLAN_LOCK:
        while len(plans) >= MAX_PLANS:
            plans.pop(next(iter(plans)))
        plans[key] = plan


def _descale_kind(d: object) -> tuple[Any, ...] | None:
    """What an fp8 plan's key records of a descale: None, or a plain tensor's shape, dtype, device
    and contiguity. Anything else (not a tensor, or a tensor subclass) gives _NO_PLAN: such a call
    goes the validating way and leaves no plan."""
    if d is None:
        return None
    if d.__class__ is not _Tensor:
        return _NO_PLAN
    return (d.shape, d.dtype, d.is_cuda, d.get_device(), d.is_contiguous())


_NO_PLAN = ("no plan",)


def _make_fp8_plan(
    choice: dispatch.Choice, kernel: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, causal: bool,
    softmax_scale: object, scale: float, out_dtype: object, descales: tuple[object, object, object],
    centered: bool = False,
) -> Callable[..., Any]:  # fmt: skip
    """The call path of one validated fp8 call signature (:func:`_make_plan` for e4m3 inputs):
    allocate, normalise the descales, launch, return.

    The key holds q's and k's shapes, q's dtype and device, causal, the scale, out_dtype and each
    descale's kind (None, or shape, dtype, device and contiguity), so each descale is one the
    validating way accepted: None (a ones tensor made here, which the kernel only reads), a
    one-element per-tensor descale (broadcast per call, as there) or a contiguous (batch, heads_kv)
    one (passed as it is). What the key does not fix (k's and v's dtypes, v's shape, devices,
    alignment and strides) the kernel's TVM-FFI entry checks before it launches; when it refuses,
    the call goes the validating way, which names the problem or copies misaligned inputs.
    ``centered``: the key's calls pass a v_mean (its kind is in the key too: float32 (batch,
    heads_kv, head_dim) on q's device, which the validating way accepted): the kernel takes it
    where its variant has the ``v_mean`` flag, else it is added after the kernel.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    heads_kv = k.shape[2]
    seqlen_k = k.shape[1]
    in_kernel = centered and choice.spec.v_mean  # the variant adds the means itself
    lse_shape = (batch, heads_q, seqlen_q)
    out_proto = _proto(q.device, FP8_OUT_DTYPES[0], q.shape)
    lse_proto = _proto(q.device, torch.float32, lse_shape)
    scratch = _scratch_lse(q.device, lse_shape)
    q_shape, k_shape = tuple(q.shape), tuple(k.shape)
    empty_like = torch.empty_like
    ones = torch.ones((batch, heads_kv), dtype=torch.float32, device=q.device)
    # Per descale, as _fp8_descale: None -> the ones; a contiguous (batch, heads_kv) one -> itself;
    # any other (batch, heads_kv) one -> a contiguous copy; one element (per tensor) -> broadcast.
    forms = tuple(
        "ones" if d is None else "as is" if d.shape == (batch, heads_kv) and d.is_contiguous()  # type: ignore[union-attr]
        else "copy" if d.shape == (batch, heads_kv) else "broadcast"  # type: ignore[union-attr]
        for d in descales
    )  # fmt: skip

    def descale(d: torch.Tensor | None, form: str) -> torch.Tensor:
        if form == "as is":
            return d  # type: ignore[return-value]
        if form == "ones":
            return ones
        if form == "copy":
            return d.contiguous()  # type: ignore[union-attr]
        return _per_tensor(d, batch, heads_kv)  # type: ignore[arg-type]

    def plan(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, v_mean: torch.Tensor | None,
        return_lse: bool,
    ) -> Any:  # fmt: skip
        out = empty_like(out_proto)
        lse = scratch if scratch is not None and not return_lse else empty_like(lse_proto)
        qd, kd, vd = (descale(d, f) for d, f in zip((q_descale, k_descale, v_descale), forms))
        try:
            if in_kernel:
                kernel(q, k, v, out, lse, qd, kd, vd, v_mean.contiguous(), scale)  # type: ignore[union-attr]
            else:
                kernel(q, k, v, out, lse, qd, kd, vd, scale)
        except (ValueError, TypeError):  # refused before launching: see above
            return _fp8_call(
                q, k, v, causal, softmax_scale, return_lse, False, q_descale, k_descale, v_descale, out_dtype, v_mean
            )
        if centered and not in_kernel:
            add_v_mean(out, v_mean, seqlen_k, causal)  # type: ignore[arg-type]
        if dispatch._LOG_RUNS:
            dispatch.log_run(choice, q_shape, k_shape, causal)
        return (out, lse) if return_lse else out

    return plan


def _proto(device: torch.device, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A zero-stride view of ``shape``: ``torch.empty_like`` of it allocates a fresh contiguous
    tensor of that shape, dtype and device at less host cost than ``torch.empty(shape, ...)``."""
    one = _PROTOS.get((device, dtype))
    if one is None:
        one = _PROTOS.setdefault((device, dtype), torch.empty((), dtype=dtype, device=device))
    return one.expand(*shape)


def _scratch_lse(device: torch.device, shape: tuple[int, int, int]) -> torch.Tensor | None:
    """A (batch, heads_q, seqlen_q) float32 view of the device's scratch buffer, or None when too big."""
    n = math.prod(shape)
    if n > MAX_SCRATCH_ELEMENTS:
        return None
    with _PLAN_LOCK:
        buffers = _SCRATCH.setdefault(device, [])
        if not buffers or buffers[-1].numel() < n:
            size = min(MAX_SCRATCH_ELEMENTS, max(n, 2 * buffers[-1].numel() if buffers else 4096))
            buffers.append(torch.empty(size, dtype=torch.float32, device=device))
        return buffers[-1][:n].view(shape)


def _make_plan(
    choice: dispatch.Choice, kernel: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, causal: bool,
    softmax_scale: float,
) -> Callable[..., Any]:  # fmt: skip
    """The call path of one validated call signature: allocate, launch, return.

    Safe without per-call validation because every call that reaches the plan has the key's
    shapes of q and k (so its head counts divide and head_dim is supported), dtype of q, device of
    q, causal and scale, and plain tensors with nothing to differentiate; everything else the
    kernel's TVM-FFI entry checks before it launches anything: v's shape against k's, the dtypes
    of k and v, that all tensors are on q's device (it switches to that device itself), 16-byte
    aligned data pointers and row strides, contiguous last dims. When it refuses, the call goes the
    validating way, which names the problem or copies misaligned inputs.

    Contiguous q, k, v take the kernel's bound launcher (:meth:`cutefa.ffi.Function.bind`): the
    argument buffer is laid out once for the key's shapes and each call writes only the five data
    pointers, after the checks the kernel would make on the fields it no longer reads (v's shape,
    the dtypes and devices of k and v). Other strides go through the kernel's full call.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    lse_shape = (batch, heads_q, seqlen_q)
    out_proto = _proto(q.device, q.dtype, q.shape)
    lse_proto = _proto(q.device, torch.float32, lse_shape)
    scratch = _scratch_lse(q.device, lse_shape)
    q_shape, k_shape = tuple(q.shape), tuple(k.shape)
    empty_like = torch.empty_like
    fast = _bind(kernel, q, k, lse_shape, softmax_scale)
    dtype, device = q.dtype, q.get_device()

    def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool) -> Any:
        out = empty_like(out_proto)
        lse = scratch if scratch is not None and not return_lse else empty_like(lse_proto)
        try:
            # The bound launcher takes contiguous q/k/v of the key's layout (v like k) on q's device.
            if not (
                fast is not None
                and q.is_contiguous()
                and k.is_contiguous()
                and v.is_contiguous()
                and k.dtype is dtype
                and v.dtype is dtype
                and v.shape == k_shape
                and k.get_device() == device
                and v.get_device() == device
                and fast(q, k, v, out, lse)
            ):
                kernel(q, k, v, out, lse, softmax_scale)
        except (ValueError, TypeError):  # refused before launching: see above
            out, lse, _ = _forward(q, k, v, causal, softmax_scale)
        else:
            if dispatch._LOG_RUNS:
                dispatch.log_run(choice, q_shape, k_shape, causal)
        return (out, lse) if return_lse else out

    return plan


def _bind(
    kernel: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, lse_shape: tuple[int, int, int], softmax_scale: float
) -> Callable[..., bool] | None:  # fmt: skip
    """The kernel's launcher for contiguous q, k, v, out, lse of these shapes on q's CUDA device
    (:meth:`cutefa.ffi.Function.bind`), or None when the kernel cannot bind (kept in memory)."""
    binder = getattr(kernel, "bind", None)
    if binder is None or not q.is_cuda:
        return None
    from cutefa.ffi import TensorLayout

    device = q.get_device()
    layouts = [
        TensorLayout(q.shape, q.dtype, device),
        TensorLayout(k.shape, q.dtype, device),
        TensorLayout(k.shape, q.dtype, device),
        TensorLayout(q.shape, q.dtype, device),
        TensorLayout(lse_shape, torch.float32, device),
    ]
    try:
        return binder([*layouts, softmax_scale], (0, 1, 2, 3, 4))
    except AttributeError:
        return None


def _eager(
    q: object, k: object, v: object, causal: object, softmax_scale: object, return_lse: bool,
    deterministic: object, key: tuple[Any, ...] | None, *fp8_options: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A plain eager call without a plan yet: validate, run, and memoize the plan under ``key``.
    fp8 inputs or options (q_descale, k_descale, v_descale, out_dtype) go to :func:`_fp8_call`."""
    q, k, v = _check_tensors((q, k, v))
    if q.dtype in FP8_DTYPES or any(o is not None for o in fp8_options):
        fp8_key = key if q.dtype in FP8_DTYPES else None  # (flash_attn_func made it the fp8 plan key)
        return _fp8_call(q, k, v, causal, softmax_scale, return_lse, deterministic, *fp8_options, fp8_key)
    _check_options(causal, softmax_scale)
    _check_deterministic(deterministic)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse, launched = _forward(q, k, v, causal, scale)
    # No plan is made while a CUDA graph is being captured: its allocations would come from the
    # graph's private pool (warm up before capturing; then the plan exists already).
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if launched is not None and key is not None and not capturing:
        _remember(_PLANS, key, _make_plan(*launched, q, k, causal, scale))
    return (out, lse) if return_lse else out


def _check_deterministic(deterministic: object) -> None:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool; got {deterministic!r}")


# ---------------------------------------------------------------------------------------------
# Public API


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    v_mean: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on CUDA tensors of shape (batch, seqlen, heads, head_dim).

    ``softmax_scale`` defaults to ``1/sqrt(head_dim)``. Returns ``out`` (like q), or ``(out, lse)``
    with ``return_lse``: lse is float32 (batch, heads_q, seqlen_q), the natural-log sum of
    exp(scaled scores) per query row. See the module docstring for masking and edge cases.
    Differentiable (out and lse); ``deterministic=True`` makes the backward bitwise reproducible.

    fp8: q, k and v of dtype torch.float8_e4m3fn (see :func:`cutefa.quantize_fp8`) with float32
    ``q_descale``, ``k_descale``, ``v_descale`` of shape () or (batch, heads_kv) (None: 1) attend
    the dequantized inputs ``x * descale``; the output is ``out_dtype`` (None or torch.bfloat16)
    and the lse that of the dequantized scores. Forward only: its backward raises
    NotImplementedError. Runs on the sm90 (Hopper) family, and on the sm100 (Blackwell) family
    (compiled, not hardware-tested). Block quantization (sm90 family only): any descale may be
    (batch, heads_kv, blocks), one per block of rows along seqlen (``quantize_fp8(x, "block",
    block=...)``); q's blocks are the dispatched kernel's tile_m rows and k's and v's its tile_n
    rows, which :func:`cutefa.fp8_block_sizes` returns (another block count is a ValueError);
    block descales must be positive. ``v_mean`` (fp8 only): float32 (batch, heads_kv, head_dim),
    the mean over seqlen that v had taken out before quantization (:func:`cutefa.center_v`), added
    back to the output of every row that attends a key: on long rows this keeps the e4m3 tensor
    cores' accumulation from losing the part of the output that V's column means carry. Such calls
    dispatch among the variants tuned for centered v (a tuned table's ``v_centered`` entries: no
    two-level accumulation, which centered v does not need; the ``_vmean`` kernels take the mean and
    add it in their epilogue, after any other kernel it is added in one pass over the output).
    """
    if _plain_eager(q, k, v):
        key = (q.shape, k.shape, q.dtype, q.is_cuda, q.get_device(), causal, softmax_scale)
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable softmax_scale: validation names it
            plan = key = None
        # fp8 inputs never have a plan here (the dtype is in the key): theirs are in _FP8_PLANS.
        if (
            plan is not None
            and _plan_options(causal, softmax_scale, deterministic)
            and q_descale is None
            and k_descale is None
            and v_descale is None
            and out_dtype is None
            and v_mean is None
        ):
            return plan(q, k, v, return_lse)
        if key is not None and q.dtype in FP8_DTYPES:
            kinds = (_descale_kind(q_descale), _descale_kind(k_descale), _descale_kind(v_descale))
            mean_kind = _descale_kind(v_mean)
            key = None if _NO_PLAN in kinds or mean_kind is _NO_PLAN else (key, *kinds, out_dtype, mean_kind)
            try:
                plan = _FP8_PLANS.get(key)
            except TypeError:  # an unhashable out_dtype: validation names it
                plan = key = None
            if plan is not None and _plan_options(causal, softmax_scale, deterministic):
                return plan(q, k, v, q_descale, k_descale, v_descale, v_mean, return_lse)
        return _eager(
            q, k, v, causal, softmax_scale, return_lse, deterministic, key, q_descale, k_descale, v_descale, out_dtype,
            v_mean,
        )  # fmt: skip
    _check_tensors((q, k, v))  # the op validates the rest; these are needed to call it at all
    fp8_options = (q_descale, k_descale, v_descale, out_dtype, v_mean)
    if q.dtype in FP8_DTYPES or any(o is not None for o in fp8_options):
        return _fp8_call(q, k, v, causal, softmax_scale, return_lse, deterministic, *fp8_options)
    _check_options(causal, softmax_scale)
    _check_deterministic(deterministic)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = flash_fwd(q, k, v, causal, scale, deterministic)
    return (out, lse) if return_lse else out


def _check_v_mean(v_mean: object, q: object, k: object, v: object) -> None:
    """``v_mean`` fits an fp8 call: a float32 tensor (batch, heads_kv, head_dim) on v's device."""
    _check_tensors((q, k, v))
    if q.dtype not in FP8_DTYPES:  # type: ignore[attr-defined]
        raise ValueError(
            f"v_mean applies to fp8 (torch.float8_e4m3fn) inputs only; got q with dtype {q.dtype}"  # type: ignore[attr-defined]
        )
    if not isinstance(v_mean, torch.Tensor):
        raise TypeError(f"v_mean must be a torch.Tensor or None; got {type(v_mean).__name__}")
    batch, _, heads_kv, head_dim = v.shape  # type: ignore[attr-defined]
    if v_mean.dtype != torch.float32 or tuple(v_mean.shape) != (batch, heads_kv, head_dim):
        raise ValueError(
            f"v_mean must be float32 of shape (batch, heads_kv, head_dim) = {(batch, heads_kv, head_dim)}; "
            f"got {v_mean.dtype} {tuple(v_mean.shape)} (cutefa.center_v returns it)"
        )
    if v_mean.device != v.device:  # type: ignore[attr-defined]
        raise ValueError(f"v_mean is on {v_mean.device}, v on {v.device}")  # type: ignore[attr-defined]


_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling


# Non-zero while a dispatch mode is active: the length of the stack whose top
# _get_current_dispatch_mode returns (one C call instead of a Python one around it).
_dispatch_modes: Callable[[], Any] = getattr(torch._C, "_len_torch_dispatch_stack", None) or (
    lambda: _get_current_dispatch_mode() is not None
)


def _plan_options(causal: object, softmax_scale: object, deterministic: object) -> bool:
    """Whether options that equal a plan key's are also of the types validation accepts (a key
    equal to a validated one can still hold causal=1 or softmax_scale=True, which no plan takes)."""
    return causal.__class__ is bool and softmax_scale.__class__ is not bool and deterministic.__class__ is bool


def _plain_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether calling the implementation directly is the same as calling the op, minus the op's
    dispatch overhead: plain tensors, no gradient to track, no tracing and no dispatch mode."""
    if not (type(q) is type(k) is type(v) is _Tensor):
        return False
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return not _is_compiling() and not _dispatch_modes()


def explain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, target: str | None = None,
    v_centered: bool = False,
) -> str:  # fmt: skip
    """Which variant :func:`flash_attn_func` would run for these inputs, why, and what was rejected.

    ``target`` (e.g. 'sm_90a') explains for that compile target instead of the tensors' GPU, so
    the inputs may then be CPU or meta tensors. ``v_centered`` (fp8): for a call with ``v_mean=``.
    """
    device_types = None if target is None else (q.device.type,)
    if isinstance(q, torch.Tensor) and q.dtype in FP8_DTYPES:
        validate_fp8_inputs(q, k, v, causal=causal, device_types=device_types)
    else:
        validate_inputs(q, k, v, causal=causal, device_types=device_types)
    gpu_name = None
    if target is None:
        target, gpu_name = dispatch.device_target(q.device)
    batch, seqlen_q, heads_q, head_dim = q.shape
    return dispatch.explain_problem(
        target=target, dtype=q.dtype, head_dim=head_dim, causal=causal, seqlen_q=seqlen_q,
        seqlen_k=k.shape[1], batch=batch, heads_q=heads_q, heads_kv=k.shape[2], gpu_name=gpu_name,
    )  # fmt: skip
