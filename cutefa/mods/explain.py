"""What ``cutefa.explain`` says of a call with user mods: the traced mods, the forward and backward
kernels they are fused into on the target (:mod:`cutefa.mods.base`), or why there is none."""

from __future__ import annotations

from typing import Any

from cutefa.model.rules import padded_tile_note, why_not_on
from cutefa.model.spec import DIRECTIONS, families_for_target
from cutefa.mods.base import mod_arch, mod_base, mod_tile_n
from cutefa.mods.block_mask import BlockMask
from cutefa.mods.traced import trace_mods
from cutefa.mods.variant import MOD_TEMPLATES, ModVariantSpec


def explain_mods(p: Any, score_mod: Any, mask_mod: Any, block_mask: Any) -> list[str]:
    """:func:`cutefa.dispatch.explain_problem`'s lines for a call with user mods: the traced mods (their key names
    the kernels), the forward and backward kernels they are fused into on the target
    (:mod:`cutefa.mods.api`), or why there is none. A mod that cannot be traced raises as the call would."""
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must come from cutefa.create_block_mask, got {type(block_mask).__name__}"
        )
    mods = trace_mods(score_mod, block_mask.mask_mod if mask_mod is None and block_mask else mask_mod)
    lines = [mods.describe()]
    if p.local or p.features.any or p.dtype not in ("fp16", "bf16"):
        why = "score_mod/mask_mod take 16-bit inputs without window_size, softcap, alibi_slopes, sinks or "
        return [*lines, f"no kernel: {why}packed sequences yet (write those into the mods)"]
    per_score = mods.reads_per_score()
    arch = mod_arch(p.target, "fwd")
    for direction in DIRECTIONS:
        family = mod_arch(p.target, direction)
        base = mod_base(p.target, p.dtype, p.head_dim, p.causal, direction, reads_per_score=per_score)
        why = f"no {family} {direction} kernel for {p.dtype} head_dim {p.head_dim}" if base is None else None
        why = why or why_not_on(base, p.target)
        if why is not None:
            lines.append(f"no kernel: {why}" if direction == "fwd" else f"  backward: none ({why})")
            continue
        spec = ModVariantSpec(base, mods, block_mask is not None)
        if direction == "bwd":
            lines.append(f"  backward: {spec.name} (family {family})")
            continue
        lines.append(f"chosen: {spec.name} (family {family}, compiled for {p.target})")
        bound = mod_tile_n(family, per_score)
        read = ", a captured tensor read per score" if per_score else ""
        lines.append(
            f"  why: the {family} family's template fuses score_mod/mask_mod on {p.target}: its default "
            f"{spec.tile_m}x{spec.tile_n} forward (key blocks of at most {bound} with these mods{read}) "
            "with the traced mods"
        )
        if block_mask is not None:
            lines.append("  block mask: key blocks the mask_mod empties are skipped, full ones run unmasked")
        padded = padded_tile_note(spec)
        lines += [f"  {padded}"] if padded else []
    others = [
        f"  {a}: the {arch} forward fuses the mods on {p.target}" if (a, "fwd") in MOD_TEMPLATES
        else f"  {a}: no {a} forward template fuses score_mod/mask_mod yet"
        for a in families_for_target(p.target) if a != arch
    ]  # fmt: skip
    return lines + (["rejected:", *others] if others else [])
