"""The variant a call's mods are fused into: the family, its key-block bound and the choice of
base kernel, shared by the call path (:mod:`cutefa.mods.api`) and ``cutefa.explain``
(:mod:`cutefa.dispatch`, which :mod:`cutefa.mods.api` imports). Imports no torch and no DSL."""

from __future__ import annotations

from cutefa.model.defaults import default_spec
from cutefa.model.rules import why_invalid
from cutefa.model.spec import VariantSpec

ARCH = "sm80"  # the family whose forward fuses mods (cutefa.mods.variant.MOD_TEMPLATES)
# Key blocks of a mod kernel: a mod's reads and arithmetic per score take registers. With a
# relative-bias table read per score and document ids at head dim 128 (sm_80), the dense defaults'
# 128-key blocks spill: the forward 96 bytes of stack, the backward (64x128) 64 bytes; 64-key
# blocks spill one register in the forward (8 bytes).
MOD_TILE_N = 64


def mod_base(dtype: str, head_dim: int, causal: bool, direction: str = "fwd") -> VariantSpec | None:
    """The variant a mod kernel fuses its mods into: the family's default ``direction`` kernel, with
    key blocks of at most :data:`MOD_TILE_N`."""
    base = default_spec(ARCH, direction, dtype, head_dim, causal=causal)
    if base is None or base.tile_n <= MOD_TILE_N:
        return base
    smaller = base.replace(tile_n=MOD_TILE_N)
    return smaller if why_invalid(smaller) is None else base
