"""Policy of the WGMMA MLA decode kernel for sm_90a (templates/decode_mla_wgmma_sm90.py.j2), an
opt-in variant beside the mma.sync kernel (:mod:`cutefa.model.policy_mla`, the default).

The variant is the MLA spec (head dims 576/512, the ``split_kv`` + ``paged_kv`` axes, one latent
head) with a tile of :data:`TILE_M` = 64 packed query rows (one warpgroup MMA's M: query heads x
new tokens) and :data:`WARPS` = 8 (two warpgroups). A step takes :data:`TILE_N` = 64 latent rows
(72 KiB) through the page table by cp.async into a 128-byte-swizzled stage that serves both
products: S = Q K^T reads all 576 columns as a K-major B operand, O += P V the first 512 columns
of the same bytes as an MN-major B operand (the two canonical layouts agree on those bytes). The
first warpgroup computes S (64 x 64, Q resident in shared memory), the online softmax in
registers, and its half of O (columns 0-255) with P from registers (the RS form); it hands P
(bf16/fp16, 8 KiB) and the rows' rescale factors to the second warpgroup through shared memory,
which computes columns 256-511 with P from shared memory. A 64 x 256 fp32 accumulator is 128
registers a thread. Q (72 KiB) + two stages (144 KiB) + P (8 KiB) + one exchange (1 KiB) =
225 KiB: one CTA per SM; the keys are split (the decode heuristic at one CTA per SM) and merged by
the decode kernel's combine. The spec is selected explicitly (:func:`mla_spec` passed to
:func:`cutefa.api.mla.decode`): the API's default stays the mma.sync kernel.
"""

from __future__ import annotations

from cutefa.model import policy_decode, policy_mla
from cutefa.model.options import Mask, Sm90FwdOptions
from cutefa.model.spec import VariantSpec

TILE_M = 64  # packed query rows: one warpgroup MMA's M
TILE_N = 64  # latent rows a stage (72 KiB)
STAGES = 2
WARPS = 8  # two warpgroups: S and O's columns 0-255; O's columns 256-511
WARPGROUPS = 2
EXCHANGE_COLS = 2  # the cross-warpgroup exchange: (rescale factor | 1 / row sum, lse) per row
COPY_THREADS_PER_ROW = 8  # threads side by side on a latent row in the cp.async copies (128 bytes)


def is_wgmma(spec: VariantSpec) -> bool:
    """Whether ``spec`` is the WGMMA MLA decode variant (an MLA spec with this module's tile)."""
    return policy_mla.is_mla(spec) and (spec.tile_m, spec.warps) == (TILE_M, WARPS)


def mla_spec(dtype: str, *, causal: bool = False) -> VariantSpec:
    """The WGMMA MLA decode variant (any number of packed rows: ceil(rows / 64) row tiles)."""
    return VariantSpec(
        "sm90", "fwd", dtype, policy_mla.HEAD_DIM, TILE_M, TILE_N, STAGES, WARPS,
        mask=Mask.CAUSAL if causal else Mask.NONE, features=policy_mla.FEATURES,
        head_dim_v=policy_mla.HEAD_DIM_V,
    )  # fmt: skip


def smem_bytes(spec: VariantSpec) -> int:
    """Shared memory of one CTA: Q, the latent stages, P and the exchange, each 1 KiB aligned."""
    exchange = spec.tile_m * EXCHANGE_COLS * policy_mla.FP32_BYTES
    return policy_mla.tile_smem_bytes(spec) + policy_mla.smem_aligned(exchange)


def why_invalid(spec: VariantSpec) -> str | None:
    """Why ``spec`` (an :func:`is_wgmma` one) has no kernel; None when it has."""
    what = "the WGMMA MLA decode kernel (templates/decode_mla_wgmma_sm90.py.j2)"
    if (spec.arch, spec.direction) != ("sm90", "fwd"):
        return f"{what} is an sm90 forward kernel; got {spec.arch} {spec.direction}"
    if spec.dtype not in policy_mla.DTYPES:
        return f"{what} takes dtype in {policy_mla.DTYPES}; got {spec.dtype}"
    if spec.features != policy_mla.FEATURES:
        return f"{what} implements the split_kv + paged_kv axes exactly; got {spec.features.tokens or 'none'}"
    if spec.mask not in (Mask.NONE, Mask.CAUSAL):
        return f"{what} takes no mask or the causal mask; got {spec.mask.name.lower()}"
    if spec.options != Sm90FwdOptions():
        return f"{what} takes the default sm90 forward options; got {spec.options}"
    if (spec.tile_n, spec.stages) != (TILE_N, STAGES):
        return f"{what} takes tile_n={TILE_N}, stages={STAGES}; got {spec.tile_n}, {spec.stages}"
    return None


def template_numbers(spec: VariantSpec) -> dict[str, object]:
    """What templates/decode_mla_wgmma_sm90.py.j2 reads besides the spec and its switches."""
    return {
        "warpgroups": WARPGROUPS,
        "wg_cols": spec.head_dim_v // WARPGROUPS,  # O columns of one warpgroup
        "exchange_cols": EXCHANGE_COLS,
        "combine_warps": policy_decode.COMBINE_WARPS,
        "copy_threads_per_row": COPY_THREADS_PER_ROW,
    }
