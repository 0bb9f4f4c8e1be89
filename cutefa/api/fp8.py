"""The e4m3 forward: the ``cutefa::flash_fwd_fp8`` custom op, its fake implementation, its
forward-only autograd, the fp8 route of :func:`cutefa.flash_attn_func` and its call plan.

q, k and v are float8_e4m3fn with float32 descales (:mod:`cutefa.api.descales`); the output is
bf16 and the lse that of the dequantized scores. With ``v_mean`` (v centered before quantization,
:func:`cutefa.center_v`) dispatch takes the variants for centered v, and the mean goes back on the
rows that attend a key: in the kernel's epilogue where the variant takes it, else after it.
:func:`fp8_varlen_forward` runs the e4m3 forward on packed sequences (the e4m3 route of
:func:`cutefa.flash_attn_varlen_func`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from cutefa import dispatch
from cutefa.api import descales as _descales
from cutefa.api import plans as _plans
from cutefa.api.check_lengths import assert_lengths_async
from cutefa.api.launch import aligned, call_on, choose, empty_outputs, outputs
from cutefa.api.validate import (
    FP8_DTYPES,
    FP8_OUT_DTYPES,
    GRID_YZ_LIMIT,
    check_deterministic,
    check_devices,
    check_dtypes,
    check_heads,
    check_options,
    check_strides,
    check_v_mean,
    default_scale,
    validate_fp8_inputs,
)
from cutefa.api.validate_features import check_sequences
from cutefa.fp8 import add_v_mean
from cutefa.loader import get_kernel
from cutefa.model.spec import Features, VariantSpec

Descales = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def takes_v_mean(spec: VariantSpec) -> bool:
    """Whether variant ``spec`` takes v's column means and adds them in its epilogue."""
    return getattr(spec.options, "v_mean", False)


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    descales: Descales, causal: bool, softmax_scale: float, v_mean: torch.Tensor | None = None,
) -> tuple[dispatch.Choice, Callable[..., Any]] | None:  # fmt: skip
    """Dispatch (an e4m3 variant; its block-quantization variant for 3-D descales) and run the fp8
    kernel on the current stream of q's device. Returns what ran, (the dispatch choice, the kernel),
    for per-head descales (the call path a plan can repeat); None for block descales. With
    ``v_mean`` dispatch asks for centered v; a variant that takes the means adds them itself, after
    any other :func:`cutefa.fp8.add_v_mean` adds them to ``out``."""
    choice, args = _descales.kernel_args(q, k, descales, choose(q, k, causal, v_mean is not None))
    in_kernel = takes_v_mean(choice.spec)
    if in_kernel:
        args = (*args, v_mean.contiguous())  # type: ignore[union-attr]
    kernel = get_kernel(choice.spec, choice.target)
    q, k, v = aligned(q), aligned(k), aligned(v)
    call_on(q.device, kernel, q, k, v, out, lse, *args, softmax_scale)
    if v_mean is not None and not in_kernel:
        add_v_mean(out, v_mean, k.shape[1], causal)
    dispatch.log_run(choice, q.shape, k.shape, causal)
    return (choice, kernel) if all(d.dim() == 2 for d in descales) else None


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: Descales, causal: bool, softmax_scale: float,
    v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[dispatch.Choice, Callable[..., Any]] | None]:  # fmt: skip
    """:func:`_flash_fwd_fp8` on validated inputs, plus what ran: (the dispatch choice, the kernel),
    or None when nothing was launched (an empty problem, no keys, or block descales)."""
    out, lse, final = outputs(q, k, FP8_OUT_DTYPES[0])
    return out, lse, None if final else _launch(q, k, v, out, lse, descales, causal, softmax_scale, v_mean)


def _flash_fwd_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor, k_descale: torch.Tensor,
    v_descale: torch.Tensor, causal: bool, softmax_scale: float, v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fp8 attention forward: e4m3 q/k/v, float32 (batch, heads_kv) descales, or (batch, heads_kv,
    blocks) block descales for any of them (:func:`cutefa.api.descales.kernel_args`); returns (out
    bf16, lse float32 (batch, heads_q, seqlen_q)) of the dequantized problem. ``v_mean`` (float32
    (batch, heads_kv, head_dim), validated by the caller): v was centered, the mean goes back on the
    output."""
    validate_fp8_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    out, lse, _ = forward(q, k, v, (q_descale, k_descale, v_descale), causal, softmax_scale, v_mean)
    return out, lse


flash_fwd_fp8 = torch.library.custom_op("cutefa::flash_fwd_fp8", _flash_fwd_fp8, mutates_args=())


@flash_fwd_fp8.register_fake
def _flash_fwd_fp8_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor, k_descale: torch.Tensor,
    v_descale: torch.Tensor, causal: bool, softmax_scale: float, v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    validate_fp8_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return empty_outputs(q, FP8_OUT_DTYPES[0])


def _fp8_backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor) -> tuple[None, ...]:
    raise NotImplementedError(
        "cutefa has no backward for the fp8 (float8_e4m3fn) forward; train with float16/bfloat16 "
        "inputs, or call the fp8 forward on tensors that do not require grad"
    )


torch.library.register_autograd("cutefa::flash_fwd_fp8", _fp8_backward)


def call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: object, softmax_scale: object, return_lse: bool,
    deterministic: object, q_descale: object, k_descale: object, v_descale: object, out_dtype: object,
    v_mean: object = None, key: tuple[Any, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """flash_attn_func for a call with fp8 inputs or fp8 options: validate, normalise the descales,
    run ``cutefa::flash_fwd_fp8`` (directly when nothing traces or differentiates). A plain call
    that launched a kernel leaves its plan under ``key`` (:func:`make_plan`)."""
    if v_mean is not None:
        check_v_mean(v_mean, q, k, v)
    if q.dtype not in FP8_DTYPES:
        given = [n for n, d in zip(_descales.DESCALE_NAMES, (q_descale, k_descale, v_descale)) if d is not None]
        given += ["out_dtype"] if out_dtype is not None else []
        raise ValueError(
            f"{', '.join(given)} apply to fp8 (torch.float8_e4m3fn) inputs only; got q with dtype {q.dtype}"
        )
    check_options(causal, softmax_scale)
    check_deterministic(deterministic)
    if out_dtype is not None and out_dtype not in FP8_OUT_DTYPES:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None; got {out_dtype!r}")
        raise NotImplementedError(f"out_dtype={out_dtype}: the fp8 forward writes {FP8_OUT_DTYPES[0]} output only")
    validate_fp8_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    given = (q_descale, k_descale, v_descale)
    descales = tuple(_descales.descale(n, d, q, k) for n, d in zip(_descales.DESCALE_NAMES, given))
    scale = default_scale(softmax_scale, q.shape[-1])  # type: ignore[arg-type]
    tensors = (q, k, v, *descales) + ((v_mean,) if v_mean is not None else ())
    if _plans.plain_eager(*tensors):  # type: ignore[arg-type]
        since = _plans.clears()
        out, lse, launched = forward(q, k, v, descales, causal, scale, v_mean)  # type: ignore[arg-type]
        # No plan while a CUDA graph is being captured (its allocations would come from the graph's pool).
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        if launched is not None and key is not None and not capturing:
            centered = v_mean is not None
            plan = make_plan(*launched, q, k, causal, softmax_scale, scale, out_dtype, given, centered)  # type: ignore[arg-type]
            _plans.remember(_plans._FP8_PLANS, key, plan, since)
    else:
        out, lse = flash_fwd_fp8(q, k, v, *descales, causal, scale, v_mean)
    return (out, lse) if return_lse else out


def make_plan(
    choice: dispatch.Choice, kernel: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, causal: bool,
    softmax_scale: object, scale: float, out_dtype: object, descales: tuple[object, object, object],
    centered: bool = False,
) -> Callable[..., Any]:  # fmt: skip
    """The call path of one validated fp8 call signature (:func:`cutefa.api.dense.make_plan` for
    e4m3 inputs): allocate, check the given descales' values (one device-side assert, no host sync)
    and normalise them, launch, return.

    The key holds q's and k's shapes, q's dtype and device, causal, the scale, out_dtype and each
    descale's kind (None, or shape, dtype, device and contiguity), so each descale is one the
    validating way accepted: None (a ones tensor made here, which the kernel only reads), a
    one-element per-tensor descale (broadcast per call, as there) or a contiguous (batch, heads_kv)
    one (passed as it is). What the key does not fix (k's and v's dtypes, v's shape, devices,
    alignment and strides) the kernel's TVM-FFI entry checks before it launches; when it refuses,
    the call goes the validating way, which names the problem or copies misaligned inputs.
    ``centered``: the key's calls pass a v_mean (its kind is in the key too: float32 (batch,
    heads_kv, head_dim) on q's device, which the validating way accepted): the kernel takes it
    where its variant does, else it is added after the kernel.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    heads_kv = k.shape[2]
    seqlen_k = k.shape[1]
    in_kernel = centered and takes_v_mean(choice.spec)  # the variant adds the means itself
    lse_shape = (batch, heads_q, seqlen_q)
    out_proto = _plans.proto(q.device, FP8_OUT_DTYPES[0], q.shape)
    lse_proto = _plans.proto(q.device, torch.float32, lse_shape)
    scratch = _plans.scratch_lse(q.device, lse_shape)
    q_shape, k_shape = tuple(q.shape), tuple(k.shape)
    empty_like = torch.empty_like
    ones = torch.ones((batch, heads_kv), dtype=torch.float32, device=q.device)
    # Per descale, as descales.descale: None -> the ones; a contiguous (batch, heads_kv) one -> itself;
    # any other (batch, heads_kv) one -> a contiguous copy; one element (per tensor) -> broadcast.
    forms = tuple(
        "ones" if d is None else "as is" if d.shape == (batch, heads_kv) and d.is_contiguous()  # type: ignore[union-attr]
        else "copy" if d.shape == (batch, heads_kv) else "broadcast"  # type: ignore[union-attr]
        for d in descales
    )  # fmt: skip
    # The given descales' values are checked as descales.descale checks them, in one device-side
    # assert over all of them (no host sync; the ones made for None need none).
    given = tuple(i for i, f in enumerate(forms) if f != "ones")
    given_names = tuple(_descales.DESCALE_NAMES[i] for i in given)
    assert_finite_positive = _descales.assert_finite_positive

    def descale(d: torch.Tensor | None, form: str) -> torch.Tensor:
        if form == "as is":
            return d  # type: ignore[return-value]
        if form == "ones":
            return ones
        if form == "copy":
            return d.contiguous()  # type: ignore[union-attr]
        return _descales.per_tensor(d, batch, heads_kv)  # type: ignore[arg-type]

    def plan(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, v_mean: torch.Tensor | None,
        return_lse: bool,
    ) -> Any:  # fmt: skip
        out = empty_like(out_proto)
        lse = scratch if scratch is not None and not return_lse else empty_like(lse_proto)
        if given:
            passed = (q_descale, k_descale, v_descale)
            assert_finite_positive(given_names, [passed[i] for i in given])  # type: ignore[misc]
        qd, kd, vd = (descale(d, f) for d, f in zip((q_descale, k_descale, v_descale), forms))
        try:
            if in_kernel:
                kernel(q, k, v, out, lse, qd, kd, vd, v_mean.contiguous(), scale)  # type: ignore[union-attr]
            else:
                kernel(q, k, v, out, lse, qd, kd, vd, scale)
        except (ValueError, TypeError):  # refused before launching: see above
            return call(
                q, k, v, causal, softmax_scale, return_lse, False, q_descale, k_descale, v_descale, out_dtype, v_mean
            )
        if centered and not in_kernel:
            add_v_mean(out, v_mean, seqlen_k, causal)  # type: ignore[arg-type]
        if dispatch._LOG_RUNS:
            dispatch.log_run(choice, q_shape, k_shape, causal)
        return (out, lse) if return_lse else out

    return plan


# ---------------------------------------------------------------------------------------------
# Packed sequences (varlen)


def validate_fp8_varlen(
    q: object, k: object, v: object, cu_seqlens_q: object, cu_seqlens_k: object, max_seqlen_q: object,
    max_seqlen_k: object, seqused_q: object, seqused_k: object, causal: object, softmax_scale: object,
) -> int:  # fmt: skip
    """Packed float8_e4m3fn q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim)
    and their sequences' metadata (as :func:`cutefa.flash_attn_varlen_func` takes them); returns
    the number of sequences."""
    for name, t in zip(("q", "k", "v"), (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, head_dim); got shape {tuple(t.shape)}")
    tensors: tuple[torch.Tensor, ...] = (q, k, v)  # type: ignore[assignment]
    check_dtypes(tensors, fp8=True)
    check_devices(tensors)
    check_heads(*tensors, standard_only=True)
    if tensors[0].shape[1] > GRID_YZ_LIMIT:
        raise ValueError(
            f"heads_q={tensors[0].shape[1]} is over cutefa's limit of {GRID_YZ_LIMIT} (the launch grid's y)"
        )
    check_strides(tensors)
    check_options(causal, softmax_scale)
    batch = check_sequences(
        tensors[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k
    )
    return batch


def varlen_descale(name: str, d: object, device: torch.device, batch: int, heads_kv: int) -> torch.Tensor:
    """A float32 (batch, heads_kv) descale, one per (sequence, kv head), from None (1), a
    one-element (per-tensor) tensor or a (batch, heads_kv) one; a given one's values are asserted
    finite and positive on the device (no host sync). Block descales have no packed-batch kernel."""
    if d is None:
        return torch.ones((batch, heads_kv), dtype=torch.float32, device=device)
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{name} must be a float32 torch.Tensor or None; got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise TypeError(f"{name} must be float32; got dtype {d.dtype}")
    if d.device != device:
        raise ValueError(f"{name} must be on q's device {device}; got {d.device}")
    if d.dim() == 3:
        raise NotImplementedError(
            f"{name} of shape {tuple(d.shape)}: block-quantized descales have no packed-sequence (varlen) "
            "e4m3 kernel; pass one descale per (sequence, kv head) or per tensor"
        )
    if d.numel() == 1 and d.dim() <= 2:
        _descales.assert_finite_positive((name,), (d,))
        return _descales.per_tensor(d, batch, heads_kv)
    if tuple(d.shape) != (batch, heads_kv):
        raise ValueError(
            f"{name} must have shape () or (batch, heads_kv) = {(batch, heads_kv)} (one per sequence and kv "
            f"head); got {tuple(d.shape)}"
        )
    _descales.assert_finite_positive((name,), (d,))
    return d.contiguous()


def choose_varlen(
    q: torch.Tensor, k: torch.Tensor, causal: bool, batch: int, max_seqlen_q: int, max_seqlen_k: int
) -> dispatch.Choice:  # fmt: skip
    """The e4m3 forward variant dispatch picks for a packed batch on q's device."""
    target, gpu_name = dispatch.device_target(q.device)
    return dispatch.choose(
        target=target, dtype=q.dtype, causal=causal, gpu_name=gpu_name, features=Features(varlen=True),
        head_dim=q.shape[-1], seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, batch=batch, heads_q=q.shape[1],
        heads_kv=k.shape[1],
    )  # fmt: skip


def fp8_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, softmax_scale: float | None = None,
    seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The e4m3 forward on packed sequences: q (total_q, heads_q, head_dim), k and v (total_k,
    heads_kv, head_dim) float8_e4m3fn; sequence ``b`` holds ``seqused_q[b]`` rows (else its span)
    of q from row ``cu_seqlens_q[b]``, likewise of k and v. Descales float32: None, per tensor, or
    (batch, heads_kv), one per sequence and kv head (q's per kv head too with GQA). Causal is
    aligned bottom-right per sequence.

    Returns ``out`` bf16 (total_q, heads_q, head_dim), or ``(out, lse)`` (lse float32 (heads_q,
    total_q), of the dequantized scores) with ``return_lse``. Packed rows of no sequence are 0 with
    lse ``-inf``. No backward. The lengths are never read on the host (CUDA-graph safe); their
    consistency is asserted on the device (:func:`cutefa.api.check_lengths.assert_lengths_async`).
    """
    batch = validate_fp8_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, causal,
        softmax_scale,
    )  # fmt: skip
    if not torch.compiler.is_compiling() and q.is_cuda:  # on the device, no host sync
        assert_lengths_async(cu_seqlens_q, seqused_q, q.shape[0], max_seqlen_q, "q")
        assert_lengths_async(cu_seqlens_k, seqused_k, k.shape[0], max_seqlen_k, "k")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    descales = tuple(
        varlen_descale(n, d, q.device, batch, heads_kv)
        for n, d in zip(_descales.DESCALE_NAMES, (q_descale, k_descale, v_descale))
    )  # fmt: skip
    scale = default_scale(softmax_scale, q.shape[-1])
    # The kernel's module writes every row, those of no sequence (out 0, lse -inf) by a fill kernel.
    out = torch.empty(q.shape, dtype=FP8_OUT_DTYPES[0], device=q.device)
    lse = torch.empty((heads_q, q.shape[0]), dtype=torch.float32, device=q.device)
    if not (out.numel() and k.shape[0] and batch):  # no kernel runs: no query row or no key anywhere
        out.zero_()
        lse.fill_(-math.inf)
    else:
        used_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1] if seqused_q is None else seqused_q.contiguous()
        used_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1] if seqused_k is None else seqused_k.contiguous()
        choice = choose_varlen(q, k, causal, batch, int(max_seqlen_q), int(max_seqlen_k))
        kernel = get_kernel(choice.spec, choice.target)
        q, k, v = aligned(q), aligned(k), aligned(v)
        call_on(
            q.device, kernel, q, k, v, out, lse, *descales, scale, cu_seqlens_q.contiguous(),
            cu_seqlens_k.contiguous(), used_q, used_k, int(max_seqlen_q),
        )  # fmt: skip
        extra = f"varlen: {batch} sequences, max_seqlen_q={max_seqlen_q} max_seqlen_k={max_seqlen_k}"
        dispatch.log_run(choice, q.shape, k.shape, causal, extra)
    return (out, lse) if return_lse else out
