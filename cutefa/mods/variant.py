"""A variant with user mods: the base variant's spec, its traced mods and whether it takes block ranges.

:class:`ModVariantSpec` is a :class:`~cutefa.model.spec.VariantSpec` (every field, rule and budget
of its base) whose name adds ``_mod<key>`` (:attr:`cutefa.mods.traced.TracedMods.short_key`) and
``_bsparse`` when the kernel visits the key blocks of a block mask: the name keys the rendered
module, the compile cache and the process's kernel memo, so the same mods never compile twice.
Its module is rendered on demand (``generated/`` holds no mod kernel) and names its base variant
(``FAKE_SPEC_NAME``) for the compile's sample arguments.

Kernel arguments of a mod variant (after the kernel's own scalars and the feature arguments of its
base, of which mods allow none today, before the stream, and before a persistent sm90 forward's SM
count):

1. block mask (``_bsparse``): ``block_ranges`` int32 (batch, heads_q, query blocks, 4): per query
   block of the kernel's tile, key blocks ``[n_first, n_last)`` hold every key it needs and
   ``[u_first, u_last)`` (inside them) need no per-element mask (:mod:`cutefa.mods.block_mask`); a
   backward's is (batch, heads_q, key blocks, 4), the same runs over query blocks (from the first
   to the last that attends the key block, and the run of those that attend all of it: no mask_mod);
2. the captured tensors ``mod_t0, mod_t1, ...`` in the order of their first read, float32 or int32
   (:meth:`cutefa.mods.traced.TracedMods.kernel_tensors`), any rank.
"""

from __future__ import annotations

from cutefa.model.options import Mask
from cutefa.model.spec import VariantSpec
from cutefa.mods.traced import TracedMods

BSPARSE_TOKEN = "bsparse"
# The families whose templates fuse mods, by (arch, direction).
MOD_TEMPLATES = frozenset({("sm80", "fwd"), ("sm80", "bwd"), ("sm90", "fwd")})


class ModVariantSpec(VariantSpec):
    """``base`` with ``mods`` fused (see the module docs); ``block_sparse``: it takes block ranges."""

    mods: TracedMods
    block_sparse: bool

    def __init__(self, base: VariantSpec, mods: TracedMods, block_sparse: bool = False) -> None:
        if isinstance(base, ModVariantSpec):
            raise TypeError("ModVariantSpec: the base is already a mod variant")
        if base.features.any or base.mask is Mask.LOCAL:
            raise NotImplementedError(
                f"{base.name}: score_mod/mask_mod with the feature axes or a window are not implemented "
                "(write them into the mods)"
            )
        if base.dtype not in ("fp16", "bf16"):
            raise NotImplementedError(f"{base.name}: score_mod/mask_mod take 16-bit inputs only")
        if (base.arch, base.direction) not in MOD_TEMPLATES:
            raise NotImplementedError(
                f"{base.name}: the {base.arch} {base.direction} template does not fuse score_mod/mask_mod yet "
                f"(only {sorted(MOD_TEMPLATES)})"
            )
        positional = [
            getattr(base, k)
            for k in ("arch", "direction", "dtype", "head_dim", "tile_m", "tile_n", "stages", "warps")
        ]
        super().__init__(
            *positional, mask=base.mask, features=base.features, options=base.options,
            head_dim_v=None if base.head_dim_v == base.head_dim else base.head_dim_v,
        )  # fmt: skip
        object.__setattr__(self, "mods", mods)
        object.__setattr__(self, "block_sparse", bool(block_sparse))

    @property
    def base(self) -> VariantSpec:
        """The variant without mods (its name is parseable: the compile's sample arguments use it)."""
        return VariantSpec(
            self.arch, self.direction, self.dtype, self.head_dim, self.tile_m, self.tile_n, self.stages,
            self.warps, mask=self.mask, features=self.features, options=self.options,
            head_dim_v=None if self.head_dim_v == self.head_dim else self.head_dim_v,
        )  # fmt: skip

    @property
    def name(self) -> str:
        tail = f"_mod{self.mods.short_key}" + (f"_{BSPARSE_TOKEN}" if self.block_sparse else "")
        return super().name + tail

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ModVariantSpec) and other.name == self.name and other.mods.key == self.mods.key
        )

    def __hash__(self) -> int:
        return hash((self.name, self.mods.key))

    def replace(self, **changes: object) -> VariantSpec:
        """A copy with ``changes`` to the base, with the same mods."""
        return ModVariantSpec(self.base.replace(**changes), self.mods, self.block_sparse)


def mod_of(spec: VariantSpec) -> ModVariantSpec | None:
    return spec if isinstance(spec, ModVariantSpec) else None
