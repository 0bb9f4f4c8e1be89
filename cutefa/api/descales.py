"""fp8 descales: from what the user passes to what the e4m3 kernel takes, and the block-quantization
variant that runs 3-D (block) descales.

A descale is None (1), a one-element tensor (per tensor), a (batch, heads_kv) tensor (per kv head)
or a (batch, heads_kv, blocks) tensor (one per block of rows along seqlen: FlashAttention-3's block
quantization, sm90 family only). q's blocks are the dispatched block kernel's tile_m rows and k's
and v's its tile_n rows (:func:`fp8_block_sizes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from cutefa import dispatch
from cutefa.api.launch import shapes
from cutefa.api.validate import FP8_INPUT_DTYPE, check_devices, check_options, check_tensors
from cutefa.model.committed import fp8_block_specs
from cutefa.model.options import Quant
from cutefa.model.rules import why_invalid

DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
# A float32 x is finite and positive iff clamping it to [the smallest positive float32 (a
# subnormal), the largest finite one] leaves it unchanged (NaN is unequal to anything).
_SMALLEST, _LARGEST = 2.0**-149, torch.finfo(torch.float32).max


def assert_finite_positive(names: Sequence[str], descales: Sequence[torch.Tensor]) -> None:
    """Assert, on the descales' device and without waiting for it, that every element of
    ``descales`` (float32, named ``names``) is finite and positive: one check over all of them
    (a clamp, a comparison and a reduction, then ``torch._assert_async``), nothing the host waits
    for, so calls stay capturable in a CUDA graph. On a CUDA device a bad value stops the
    assert's kernel: a device-side assert, reported as a CUDA error by the next call that
    synchronizes (the CUDA context is then unusable, as after any device-side assert). On the
    CPU it raises RuntimeError at once."""
    values = descales[0].reshape(-1) if len(descales) == 1 else torch.cat([d.reshape(-1) for d in descales])
    finite_positive = torch.eq(values.clamp(_SMALLEST, _LARGEST), values).all()
    what = names[0] if len(names) == 1 else f"one of {', '.join(names)}"
    torch._assert_async(finite_positive, f"cutefa: {what} is not finite and positive (fp8 descales must be)")


def descale(name: str, d: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A float32 (batch, heads_kv) descale on q's device from None (1), a 0-d/1-element tensor
    (per tensor) or a (batch, heads_kv) tensor; a (batch, heads_kv, blocks) block descale is
    passed on (contiguous) as it is: its block count is checked against the kernel's tiles at
    launch (:func:`kernel_args`). A given descale's values must be finite and positive
    (:func:`assert_finite_positive`: asserted on its device, without a host sync)."""
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
        assert_finite_positive((name,), (d,))
        return per_tensor(d, batch, heads_kv)
    if tuple(d.shape) != (batch, heads_kv) and not (d.dim() == 3 and tuple(d.shape[:2]) == (batch, heads_kv)):
        raise ValueError(
            f"{name} must have shape () or (batch, heads_kv) = {(batch, heads_kv)}, or (batch, heads_kv, blocks) "
            f"= {(batch, heads_kv, 'blocks')} for block quantization; got {tuple(d.shape)} (with grouped-query "
            "attention q's descale is per kv head too: quantize q with group=heads_q // heads_kv)"
        )
    assert_finite_positive((name,), (d,))
    return d if d.is_contiguous() else d.clone(memory_format=torch.contiguous_format)


def per_tensor(d: torch.Tensor, batch: int, heads_kv: int) -> torch.Tensor:
    """A one-element (per-tensor) descale as the kernel's contiguous (batch, heads_kv) one."""
    return d.reshape(1, 1).expand(batch, heads_kv).clone(memory_format=torch.contiguous_format)


def block_choice(choice: dispatch.Choice) -> dispatch.Choice:
    """The block-quantization variant (``quant=Quant.BLOCK``) of the dispatched e4m3 forward
    ``choice``: its twin with block descales where that is committed, else the committed block
    variant of the head dim and mask (a tuned table may pick a tile whose block twin is not built,
    e.g. one that would spill with the block scales' registers). NotImplementedError where the
    family has no block quantization."""
    original = choice.spec
    try:
        spec = original.replace(quant=Quant.BLOCK)
    except TypeError:  # the family's options have no quantization granularity
        why_not = f"the {original.arch} e4m3 forward has no block quantization ({type(original.options).__name__})"
    else:
        reason = f"{choice.reason}; block quantization (_blockq)"
        committed = [
            s for s in fp8_block_specs(spec.arch) if (s.head_dim, s.causal) == (spec.head_dim, spec.causal)
        ]
        if committed and spec not in committed:
            spec = committed[0]
            reason = (
                f"{choice.reason}; block quantization on the committed {spec.name} ({original.name} has no "
                "block twin)"
            )
        why_not = why_invalid(spec)
    if why_not is not None:
        raise NotImplementedError(
            f"block-quantized fp8 descales (3-D) have no kernel for {original.name} on {choice.target}: "
            f"{why_not}; use per-tensor or per-head descales there"
        )
    return dataclasses.replace(choice, spec=spec, reason=reason)


def _block_descale(
    name: str, d: torch.Tensor, seqlen_name: str, seqlen: int, tile: str, rows: int, kernel_name: str
) -> torch.Tensor:
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
            f"the dispatched kernel {kernel_name} quantizes in blocks of its {tile}={rows} rows; got "
            f"{tuple(d.shape)}, {d.shape[2]} blocks for {seqlen_name}={seqlen} (blocks of about {given} rows). "
            f"Quantize with cutefa.quantize_fp8(x, 'block', block={rows}); cutefa.fp8_block_sizes(q, k, causal=...) "
            "returns the block sizes for a problem"
        )
    return d


def kernel_args(
    q: torch.Tensor, k: torch.Tensor, descales: Sequence[torch.Tensor], choice: dispatch.Choice
) -> tuple[dispatch.Choice, tuple[torch.Tensor, ...]]:
    """What the fp8 kernel takes after (q, k, v, out, lse), and the variant that takes it.

    Per-tensor/per-head descales (all (batch, heads_kv)) go to the dispatched variant unchanged.
    With any 3-D (block) descale the block-quantization variant runs (:func:`block_choice`); every
    descale is brought to its blocks (a (batch, heads_kv) one is broadcast over them) and the kernel
    takes (q_descale (batch, heads_kv, q blocks), kv_scales (batch, heads_kv, k blocks, 4),
    v_descale (batch, heads_kv)): per key block (k descale, log2 r, 1 / r, 0), r = v's block descale
    over its largest one, that largest one being v_descale (the kernel folds log2 r into the exp2
    of the block's probabilities, which then stay normal e4m3 numbers, and O is multiplied by the
    largest descale at the end; templates/fwd_sm90_fp8.py.j2). The descales are finite and positive
    (:func:`descale` asserts it).
    """
    if all(d.dim() == 2 for d in descales):
        return choice, tuple(descales)
    choice = block_choice(choice)
    spec = choice.spec
    qd, kd, vd = (
        _block_descale(name, d, seqlen_name, x.shape[1], tile, rows, spec.name)
        for name, d, seqlen_name, x, tile, rows in zip(
            DESCALE_NAMES, descales, ("seqlen_q", "seqlen_k", "seqlen_k"), (q, k, k),
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
    need, the tile_m and tile_n of the e4m3 forward that :func:`cutefa.flash_attn_func` dispatches
    for it.

    Only shapes are read, so q and k may be the tensors before quantization (any dtype):
    ``cutefa.quantize_fp8(q, "block", block=q_block, group=heads_q // heads_kv)``, and k and v with
    ``block=kv_block``. ``target`` (e.g. 'sm_90a') answers for that compile target instead of the
    GPU of q's device. Raises NotImplementedError where the dispatched family has no
    block-quantization kernel (only the sm90 family has one).
    """
    tensors = check_tensors((q, k, k))
    check_options(causal, None)
    if target is None:
        check_devices(tensors)
        target, gpu_name = dispatch.device_target(q.device)
    else:
        gpu_name = None
    if k.shape[3] != q.shape[3] or k.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have one batch size and head_dim")
    choice = dispatch.choose(target=target, dtype=FP8_INPUT_DTYPE, causal=causal, gpu_name=gpu_name, **shapes(q, k))
    spec = block_choice(choice).spec
    return spec.tile_m, spec.tile_n
