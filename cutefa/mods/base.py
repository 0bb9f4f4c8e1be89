"""The variant a call's mods are fused into: the family per target and direction, its key-block
bound and the choice of base kernel, shared by the call path (:mod:`cutefa.mods.api`) and
``cutefa.explain`` (:mod:`cutefa.dispatch`, which :mod:`cutefa.mods.api` imports). Imports no torch
and no DSL."""

from __future__ import annotations

from cutefa.model.defaults import default_spec
from cutefa.model.rules import why_invalid
from cutefa.model.spec import VariantSpec

# The family that runs on every GPU from sm_80 on (cutefa.mods.variant.MOD_TEMPLATES).
PORTABLE_ARCH = "sm80"
# Targets whose own family fuses mods into a direction; the rest run the portable family (the
# sm90 backward does not fuse mods: a call on sm_90a pairs the sm90 forward with the sm80
# backward, both with natural-log lse of the modified scores).
OWN_ARCH = {("sm_90a", "fwd"): "sm90"}
# Key blocks of a mod kernel: (bound, bound when a captured tensor is read once per score:
# TracedMods.reads_per_score). A mod's reads and arithmetic per score take registers.
# sm80 (sm_80, head dim 128): with a relative-bias table read per score and document ids, the dense
# defaults' 128-key blocks spill (forward 96 bytes of stack, backward 64x128 64 bytes); 64-key
# blocks spill one register in the forward (8 bytes).
# sm90 (sm_90a, 128xN forward, two consumer warpgroups at 240 registers, head dim 128): the
# relative-bias table read per score spills at 128-key blocks (104 bytes of stack alone, 400 with
# document ids, causal) and at 96 (72 bytes), none at 64; document ids (reads per row and per
# key) and softcap with prefix-LM (a block mask) spill nothing at 128, the dense default. Head dim
# 64 with the table and document ids spills nothing at 64; head dim 256 (dense default 64) spills
# 40 bytes at 64.
MOD_TILE_N = {"sm80": (64, 64), "sm90": (128, 64)}


def mod_arch(target: str, direction: str = "fwd") -> str:
    """The family whose ``direction`` kernel fuses a call's mods on ``target`` (e.g. ``"sm_90a"``)."""
    return OWN_ARCH.get((target, direction), PORTABLE_ARCH)


def mod_tile_n(arch: str, reads_per_score: bool = True) -> int:
    """The most keys per block of ``arch``'s mod kernels (:data:`MOD_TILE_N`)."""
    return MOD_TILE_N[arch][1 if reads_per_score else 0]


def mod_base(
    target: str,
    dtype: str,
    head_dim: int,
    causal: bool,
    direction: str = "fwd",
    *,
    reads_per_score: bool = True,
) -> VariantSpec | None:
    """The variant a mod kernel for ``target`` fuses its mods into: its family's (:func:`mod_arch`)
    default ``direction`` kernel, with key blocks of at most :func:`mod_tile_n` (``reads_per_score``:
    :meth:`cutefa.mods.traced.TracedMods.reads_per_score` of the mods)."""
    arch = mod_arch(target, direction)
    bound = mod_tile_n(arch, reads_per_score)
    base = default_spec(arch, direction, dtype, head_dim, causal=causal)
    if base is None or base.tile_n <= bound:
        return base
    smaller = base.replace(tile_n=bound)
    return smaller if why_invalid(smaller) is None else base
