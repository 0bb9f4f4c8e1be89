"""The one validity predicate: :func:`why_invalid` decides whether a spec can be built, and
:func:`why_not_on` whether a valid one runs on a compile target. Enumeration, the CLI, code
generation and dispatch all ask them.

A spec's option record belongs to its family, so no rule has to say "this option belongs to another
family" (the record cannot hold it). The rules here relate a record's fields to each other and to
the tile (the sm90 families' in :mod:`cutefa.model.rules_sm90`), and hold each family's tile to its
templates and its resource budgets
(:mod:`cutefa.model.budgets_sm80`, :mod:`~cutefa.model.budgets_sm90`,
:mod:`~cutefa.model.budgets_sm100`). Each returns a sentence naming what is wrong, or None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cutefa.model import policy_decode, policy_mla, policy_mla_wgmma
from cutefa.model.budgets import TARGET_SMEM_LIMITS
from cutefa.model.budgets_sm80 import sm80_over_budget, sm80_registers, sm80_smem_bytes, sm80_tile_head_dim
from cutefa.model.budgets_sm90 import (
    sm90_fwd_over_budget,
    sm90_registers,
    sm90_smem_bytes,
)
from cutefa.model.budgets_sm100 import (
    SM100_BWD_TILE,
    SM100_FP8_MMA_K,
    SM100_FP8_V_MN_STEP,
    SM100_PAIR_MIN_HEAD_DIM,
    SM100_WARPS,
    sm100_over_budget,
    sm100_registers,
    sm100_smem_bytes,
)
from cutefa.model.committed import candidates, default_variants
from cutefa.model.defaults import FP8_FAMILIES
from cutefa.model.options import (
    DqLayout,
    Mask,
    Options,
    Sm80BwdOptions,
    Sm80FwdOptions,
    Sm90BwdOptions,
    Sm90Fp8FwdOptions,
    Sm90FwdOptions,
    Sm100BwdOptions,
    Sm100FwdOptions,
)
from cutefa.model.rules_sm90 import (  # the sm90 families' rules, held to the spec below
    _sm90_bwd,
    _sm90_bwd_dq_path,
    _sm90_early_rescale,
    _sm90_fp8_accumulation,
    _sm90_fp8_tile,
    _sm90_fp8_varlen,
    _sm90_fp8_wide_transpose,
    _sm90_heavy_first,
    _sm90_lazy_rescale,
    _sm90_roles,
)
from cutefa.model.spec import HEAD_DIM_V_PAIRS, HEAD_DIMS, VariantSpec, target_cc, why_not_head_dims

Rule = Callable[[VariantSpec], "str | None"]

# Kernel templates that exist, (arch, direction) -> dtypes they handle. Mirrors templates/.
IMPLEMENTED: dict[tuple[str, str], tuple[str, ...]] = {
    ("sm80", "fwd"): ("fp16", "bf16"),
    ("sm80", "bwd"): ("fp16", "bf16"),
    ("sm90", "fwd"): ("fp16", "bf16", "e4m3"),
    ("sm90", "bwd"): ("fp16", "bf16"),
    ("sm100", "fwd"): ("fp16", "bf16", "e4m3"),
    ("sm100", "bwd"): ("fp16", "bf16"),
}


# The feature axes (Features field names) and the local mask ("local") each template implements,
# (arch, direction, dtype) -> names. A spec asking for one outside its entry has no kernel.
_SCORE_FEATURES = frozenset({"local", "varlen", "softcap", "alibi", "sinks"})
FEATURES_IMPLEMENTED: dict[tuple[str, str, str], frozenset[str]] = {
    (arch, direction, dtype): _SCORE_FEATURES
    for arch, direction in (("sm80", "fwd"), ("sm80", "bwd"), ("sm90", "fwd"), ("sm100", "fwd"))
    for dtype in ("fp16", "bf16")
} | {
    # templates/bwd_sm90.py.j2 (the backward needs no sinks axis: the lse carries them)
    ("sm90", "bwd", dtype): frozenset({"local", "varlen", "softcap", "alibi"})
    for dtype in ("fp16", "bf16")
} | {
    ("sm90", "fwd", "e4m3"): frozenset({"varlen"}),  # templates/fwd_sm90_fp8.py.j2 (_sm90_fp8_varlen)
}  # fmt: skip
# The decode kernels (split_kv; templates/decode_<arch>.py.j2), (arch, direction, dtype) -> names: a
# split-KV spec of a family listed here is checked against this table instead (paged K/V, the window
# and softcap; no variable-length batch, ALiBi or sinks).
DECODE_FEATURES_IMPLEMENTED: dict[tuple[str, str, str], frozenset[str]] = {
    ("sm80", "fwd", dtype): frozenset({"split_kv", "paged_kv", "local", "softcap"})
    for dtype in ("fp16", "bf16")
}
# templates/decode_mla_sm90.py.j2 (MLA decode, head dims 576/512) is held to its own feature set,
# cutefa.model.policy_mla.FEATURES, by its own rules (why_invalid).


def smem_bytes(spec: VariantSpec) -> int:
    """Shared memory of one CTA of ``spec``, by its family's model."""
    if policy_mla_wgmma.is_wgmma(spec):
        return policy_mla_wgmma.smem_bytes(spec)
    if policy_mla.is_mla(spec):
        return policy_mla.smem_bytes(spec)
    return {"sm80": sm80_smem_bytes, "sm90": sm90_smem_bytes, "sm100": sm100_smem_bytes}[spec.arch](spec)


def tile_head_dims(spec: VariantSpec) -> tuple[int, int]:
    """The head dims of ``spec``'s tiles, (Q and K, V and O): the problem's, padded where the
    family pads them (sm80: :func:`~cutefa.model.budgets_sm80.sm80_tile_head_dim`)."""
    if spec.arch == "sm80":
        return sm80_tile_head_dim(spec.head_dim), sm80_tile_head_dim(spec.head_dim_v)
    return spec.head_dim, spec.head_dim_v


def padded_tile_note(spec: VariantSpec) -> str | None:
    """``cutefa.explain``'s line on the tile head dims of ``spec`` where they are not the problem's, or None."""
    tile_d, tile_d_v = tile_head_dims(spec)
    if (tile_d, tile_d_v) == (spec.head_dim, spec.head_dim_v):
        return None
    v = f", v head dim {spec.head_dim_v} on {tile_d_v}" if spec.head_dim_v != spec.head_dim else ""
    return (
        f"padded tile: head dim {spec.head_dim} computed on tiles {tile_d} columns wide{v} (predicated loads "
        "zero-fill the pad in shared memory; only the real columns are stored)"
    )


def est_registers(spec: VariantSpec) -> int:
    """Estimated registers per thread at the peak (sm90: per consumer thread; sm100 forward: per
    softmax thread), by its family's model."""
    return {"sm80": sm80_registers, "sm90": sm90_registers, "sm100": sm100_registers}[spec.arch](spec)


# ---------------------------------------------------------------------------------------------
# Every family


def _fp8_dtype(spec: VariantSpec) -> str | None:
    if spec.dtype == "e4m3" and (spec.arch not in FP8_FAMILIES or spec.direction != "fwd"):
        return f"e4m3 is only for sm90/sm100 forward kernels, not {spec.arch} {spec.direction}"
    return None


# The kernels that take every accepted head dim (padded to their tile head dim) and the
# (head_dim, head_dim_v) pairs of HEAD_DIM_V_PAIRS; the others take the standard HEAD_DIMS only,
# with head_dim_v equal to head_dim.
ANY_HEAD_DIM_KERNELS: frozenset[tuple[str, str, str]] = frozenset(
    (arch, direction, dtype)
    for arch, direction in (("sm80", "fwd"), ("sm80", "bwd"), ("sm90", "fwd"))
    for dtype in ("fp16", "bf16")
)
# Kernels that take head dims of their own besides the standard ones, each by its family's rule
# (the 16-bit sm90 backward: multiples of 16 up to 128, rules_sm90._sm90_bwd), head_dim_v equal.
OWN_HEAD_DIM_KERNELS: frozenset[tuple[str, str, str]] = frozenset(
    ("sm90", "bwd", dtype) for dtype in ("fp16", "bf16")
)
# Kernels that take the (head_dim, head_dim_v) pairs of HEAD_DIM_V_PAIRS besides the any-head-dim
# ones, each by its family's rule (the 16-bit sm90 backward: its swapped-dK/dV partition,
# rules_sm90._sm90_bwd_separate_v).
SEPARATE_V_KERNELS: frozenset[tuple[str, str, str]] = frozenset(
    ("sm90", "bwd", dtype) for dtype in ("fp16", "bf16")
)


def _head_dim(spec: VariantSpec) -> str | None:
    reason = why_not_head_dims(spec.head_dim, spec.head_dim_v)
    if reason is not None:
        return reason
    standard = spec.head_dim in HEAD_DIMS and spec.head_dim_v == spec.head_dim
    if standard or (spec.arch, spec.direction, spec.dtype) in ANY_HEAD_DIM_KERNELS:
        return None
    family = (spec.arch, spec.direction, spec.dtype)
    own = spec.head_dim_v == spec.head_dim and family in OWN_HEAD_DIM_KERNELS
    pair = spec.head_dim_v != spec.head_dim and family in SEPARATE_V_KERNELS  # (a pair: why_not_head_dims)
    if own or pair:
        return None
    pairs = ", ".join(f"({d}, {dv})" for d, dv in HEAD_DIM_V_PAIRS)
    which = f"head_dim={spec.head_dim}" + (
        f", head_dim_v={spec.head_dim_v}" if spec.head_dim_v != spec.head_dim else ""
    )
    return (
        f"{which}: the {spec.dtype} {spec.arch} {spec.direction} kernels take head_dim in {HEAD_DIMS} with "
        f"head_dim_v equal to head_dim; other multiples of 8 up to 256 and (head_dim, head_dim_v) in {pairs} "
        "run on the 16-bit sm80 family and the 16-bit sm90 forward (the pairs also on the 16-bit sm90 backward)"
    )


def why_no_kernel(spec: VariantSpec) -> str | None:
    """Why no template exists yet for this spec (its family, direction and dtype; its mask kind;
    its feature axes; a separate V head dim), or None."""
    where = f"{spec.arch} {spec.direction}"
    dtypes = IMPLEMENTED.get((spec.arch, spec.direction))
    if dtypes is None:
        return f"no {where} kernel exists yet"
    if spec.dtype not in dtypes:
        return f"no {spec.dtype} {where} kernel exists yet"
    family = (spec.arch, spec.direction, spec.dtype)
    decode = spec.features.split_kv and family in DECODE_FEATURES_IMPLEMENTED
    table = DECODE_FEATURES_IMPLEMENTED if decode else FEATURES_IMPLEMENTED
    implemented = table.get(family, frozenset())
    if spec.mask is Mask.LOCAL and "local" not in implemented:
        return f"no {spec.dtype} {where} kernel implements the local (sliding-window) mask yet"
    missing = [
        f.metadata["token"] for f in dataclasses.fields(spec.features)
        if getattr(spec.features, f.name) and f.name not in implemented
    ]  # fmt: skip
    if missing:
        return f"no {spec.dtype} {where} kernel implements the {' + '.join(missing)} feature(s) yet"
    return None


def _exp_emu_share(spec: VariantSpec) -> str | None:
    emu = spec.options.exp_emu
    if emu * 16 % 100:
        return f"exp_emu={emu} must be a multiple of 6.25% (whole scores of every 16): 0, 25, 50, 75 or 100"
    return None


# ---------------------------------------------------------------------------------------------
# sm80 (templates/fwd_sm80.py.j2, bwd_sm80.py.j2)


def _sm80_dq_layout(spec: VariantSpec) -> str | None:
    o = spec.options
    tile_d = sm80_tile_head_dim(spec.head_dim)  # a chunk's width: the tile head dim (padded)
    words = spec.tile_m * tile_d
    if o.dq_layout is DqLayout.TILE and words % (4 * spec.threads):
        padded = f", head_dim padded to {tile_d}" if tile_d != spec.head_dim else ""
        return (
            f"dq_layout=TILE needs tile_m * head_dim ({words}{padded}) to be a multiple of 4 x the "
            f"{spec.threads} threads (whole 16-byte vectors per thread)"
        )
    if o.dq_pipe and o.dq_layout is not DqLayout.TILE:
        return "dq_pipe without dq_layout=TILE: the dQ chunks add into the fragment-order accumulator"
    if o.dq_pipe and spec.stages != 1:
        return (
            "dq_pipe with stages > 1: the double-buffered order already spreads its dQ reductions "
            "between the dK MMAs"
        )
    return None


def _sm80_cache_dtype(spec: VariantSpec) -> str | None:
    if spec.options.kv_e4m3 and (spec.direction != "fwd" or not spec.features.split_kv):
        return "cache_dtype=E4M3 is an option of the decode kernel (the split_kv axis): an e4m3 KV cache"
    if spec.options.kv_e4m3:
        # 16-byte copies of e4m3 rows, max(2, threads / tile_n) threads side by side on a row
        # (cutefa.model.policy_decode.copy_threads_per_row)
        per_row = max(2, spec.threads // spec.tile_n)
        if spec.head_dim % 16 or (spec.head_dim // 16) % per_row:
            return (
                f"an e4m3 cache of head_dim={spec.head_dim} does not split into 16-byte copies of "
                f"{per_row} threads a row ({spec.warps} warps, tile_n={spec.tile_n})"
            )
    return None


def _sm80_line_copy(spec: VariantSpec) -> str | None:
    """The decode kernel's line-wide K/V copies (cutefa.model.policy_decode.copy_threads_per_row):
    8 threads of 16 bytes on a 128-byte line of a 16-bit row, one warp per 16-row slab."""
    if not spec.options.line_copy:
        return None
    if spec.direction != "fwd" or not spec.features.split_kv:
        return "line_copy is an option of the decode kernel (the split_kv axis): its K/V copies"
    if spec.options.kv_e4m3:
        return "line_copy with cache_dtype=E4M3: the e4m3 cache keeps its own byte copies"
    if spec.warps * 16 > spec.tile_m:
        return "line_copy with warps splitting the keys: each warp copies its own 16-key slice"
    if spec.head_dim % 64:
        return f"line_copy needs whole 128-byte lines a row: head_dim a multiple of 64, got {spec.head_dim}"
    return None


def _sm80_page_chunks(spec: VariantSpec) -> str | None:
    """Page-table reads per chunk of 16 keys (cutefa.kernels.sm80.decode_paged.load_page_rows):
    the paged decode kernel with line copies, whose copy instructions span at most a chunk's rows."""
    if not spec.options.page_chunks:
        return None
    if spec.direction != "fwd" or not (spec.features.split_kv and spec.features.paged_kv):
        return "page_chunks is an option of the paged decode kernel (the split_kv and paged_kv axes)"
    if not spec.options.line_copy:
        return "page_chunks needs line_copy: with sector copies each row of a thread is in a chunk of its own"
    span = policy_decode.chunk_row_step(spec)  # rows of one copy instruction
    if policy_decode.PAGE_CHUNK_KEYS % span:
        return (
            f"page_chunks with {spec.warps} warps: a copy instruction's {span} rows do not divide "
            f"{policy_decode.PAGE_CHUNK_KEYS}"
        )
    return None


# The e4m3 KV cache is converted on chip by cvt.f16x2.e4m3x2 (sm_89 and newer; measured on Hopper).
KV_E4M3_MIN_CC = 90


def _sm80_decode_key_warps(spec: VariantSpec) -> str | None:
    """A decode tile of one 16-row slab with more warps: they split each key block, 16 keys a
    warp (cutefa.model.policy_decode, the KEYS schedule)."""
    if spec.tile_m != 16 or spec.warps not in (2, 4, 8):
        return (
            f"tile_m={spec.tile_m} with {spec.warps} warps: warps split the keys of 16-row decode tiles only"
        )
    if spec.tile_n != 16 * spec.warps:
        return f"tile_n={spec.tile_n}: the {spec.warps} warps splitting the keys take 16 each (tile_n = {16 * spec.warps})"
    if spec.options.kv_e4m3:
        return "cache_dtype=E4M3 with warps splitting the keys: the e4m3 cache is read by the one-warp-per-slab tile"
    if spec.head_dim not in (64, 128):
        return (
            f"head_dim={spec.head_dim} with warps splitting the keys: head dims 64 and 128 only (Q and O in "
            "registers; a warp's 16-byte copies of the Q tile)"
        )
    return None


def _sm80_warps(spec: VariantSpec) -> str | None:
    if spec.direction == "fwd" and spec.features.split_kv and spec.warps * 16 > spec.tile_m:
        return _sm80_decode_key_warps(spec)
    if spec.direction == "fwd":
        rows = 16 * spec.warps
        if spec.tile_m % rows:
            return (
                f"tile_m={spec.tile_m} is not a multiple of 16*warps={rows} "
                f"(each of the {spec.warps} warps owns 16-row MMA slabs)"
            )
        return None
    # Warp grids (2, warps/2) over (tile_m, tile_n) for S and dP, (warps/2, 2) over (tile_n, d)
    # for dK/dV and over (tile_m, d) for dQ, or (2, warps/2) there where it is valid and reads
    # less (bwd_parts.warp_grid); each warp owns 16-row by 16-column pieces.
    if spec.warps not in (4, 8):
        return f"warps={spec.warps}: the sm80 backward runs 4 or 8 warps"
    if spec.stages not in (1, 2):
        return (
            f"stages={spec.stages}: the sm80 backward loads K and V once per CTA and has 1 or 2 "
            "buffers for Q (stages=1 or 2)"
        )
    for what, value in (("tile_m", spec.tile_m), ("tile_n", spec.tile_n)):
        if value % (8 * spec.warps) or value % 32:
            return (
                f"{what}={value} is not a multiple of {max(32, 8 * spec.warps)} "
                f"(the backward's warp grids of {spec.warps} warps)"
            )
    return None


def _sm80_shapes(spec: VariantSpec) -> str | None:
    """The tiles in shared memory are tile_head_dim wide (the head dim padded to the narrowest
    swizzled atom, :func:`~cutefa.model.budgets_sm80.sm80_tile_head_dim`)."""
    if spec.tile_n % 16:
        return f"tile_n={spec.tile_n} is not a multiple of 16 (the k-step of the P@V MMA)"
    d, d_v = sm80_tile_head_dim(spec.head_dim), sm80_tile_head_dim(spec.head_dim_v)
    per_round = spec.threads * (16 // spec.elem_bytes)  # one 128-bit copy per thread
    for operand, rows, cols in (("Q", spec.tile_m, d), ("K", spec.tile_n, d), ("V", spec.tile_n, d_v)):
        if rows * cols % per_round:
            return (
                f"the {operand} tile ({rows}x{cols}) does not split into 128-bit copies "
                f"over {spec.threads} threads ({per_round} elements per round)"
            )
    return None


def _sm80_bwd_head_dims(spec: VariantSpec) -> str | None:
    """The sm80 backward takes every accepted head dim, padded to its 32-column shared-memory atoms
    (:func:`~cutefa.model.budgets_sm80.sm80_tile_head_dim`; a padded one with the tiled dQ
    accumulator, DqLayout.TILE, and without dq_pipe: the only dQ path whose reductions and
    postprocess take the padded width); a V head dim of its own, (192, 128), with DqLayout.TILE too."""
    tile_d = sm80_tile_head_dim(spec.head_dim)
    if tile_d != spec.head_dim and (spec.options.dq_layout is not DqLayout.TILE or spec.options.dq_pipe):
        return (
            f"head_dim={spec.head_dim} (padded to {tile_d} columns) with dq_layout={spec.options.dq_layout.name}"
            f"{', dq_pipe' if spec.options.dq_pipe else ''}: the padded sm80 backward takes dq_layout=TILE "
            "without dq_pipe"
        )
    if spec.head_dim_v != spec.head_dim and spec.options.dq_layout is not DqLayout.TILE:
        return (
            f"head_dim_v={spec.head_dim_v} with head_dim={spec.head_dim} and "
            f"dq_layout={spec.options.dq_layout.name}: the sm80 backward takes a V head dim of its own with "
            "dq_layout=TILE (whose preprocess reads head_dim_v columns of O and dO and zeroes dq_accum's "
            "head_dim columns apart)"
        )
    threads = 32 * spec.warps
    if spec.options.dq_layout is DqLayout.TILE and spec.stages >= 2 and (4 * tile_d) % threads:
        return (
            f"head_dim={spec.head_dim} with a double-buffered Q (stages={spec.stages}) and dq_layout=TILE: "
            f"the dQ reductions (4 words each on sm_90) are shared out between dK's {spec.tile_m // 16} "
            f"k-blocks, which needs 4 * the tile head dim ({tile_d}) to be a multiple of the {threads} threads; "
            "take stages=1"
        )
    return None


# ---------------------------------------------------------------------------------------------
# sm100 (templates/fwd_sm100.py.j2, bwd_sm100.py.j2)


def _sm100_fwd(spec: VariantSpec) -> str | None:
    if spec.warps != SM100_WARPS:
        return (
            f"warps={spec.warps} must be {SM100_WARPS} (softmax x2, correction, MMA/load/epilogue warpgroups)"
        )
    if spec.tile_m not in (128, 256):
        return f"tile_m={spec.tile_m} must be 128 or 256 (one or two 128-row Q tiles in flight)"
    return _sm100_fp8(spec)


def _sm100_fp8(spec: VariantSpec) -> str | None:
    """The e4m3 forward's own limits (tcgen05 kind::f8f6f4, P as four e4m3 per TMEM column)."""
    if spec.dtype != "e4m3":
        return None
    if spec.options.cta_pair:
        return (
            "cta_pair: the sm100 e4m3 forward is single-CTA only (no CTA-pair, 2-SM e4m3 UMMA variant "
            "is built)"
        )
    if spec.tile_n % SM100_FP8_MMA_K:
        return (
            f"tile_n={spec.tile_n} is not a multiple of {SM100_FP8_MMA_K} (the k of an e4m3 UMMA: P V "
            "steps over keys 32 at a time, and each 32-score chunk of P fills 8 TMEM columns)"
        )
    if spec.head_dim % SM100_FP8_V_MN_STEP:
        return (
            f"head_dim={spec.head_dim} is not a multiple of {SM100_FP8_V_MN_STEP} (the N step of an e4m3 "
            "UMMA whose B operand, V, is MN-major)"
        )
    return None


def _sm100_tile_n(spec: VariantSpec) -> str | None:
    if spec.tile_n not in (64, 128):
        return f"tile_n={spec.tile_n} must be 64 or 128 (UMMA N of S = Q K^T, a multiple of the 32-score P chunk)"
    if spec.stages < 2:
        return f"stages={spec.stages}: the K/V TMA ring needs at least 2 stages"
    return None


def _sm100_pair(spec: VariantSpec) -> str | None:
    """The CTA pair (tcgen05 cta_group::2) splits every V tile by head-dim columns between its
    two CTAs and every K tile by keys; the UMMAs are M = 256 (128 rows per CTA)."""
    if not spec.options.cta_pair:
        return None
    if spec.head_dim < SM100_PAIR_MIN_HEAD_DIM:
        return (
            f"head_dim={spec.head_dim}: cta_pair is for head_dim >= {SM100_PAIR_MIN_HEAD_DIM}: each CTA would load "
            f"{spec.head_dim // 2} columns of V, under one 128-byte swizzle row (64 elements), and at this head dim "
            "the K/V traffic the pair halves is small beside its Q and O traffic"
        )
    if spec.tile_n == 128 and spec.options.exp_emu == 0 and (spec.tile_m, spec.head_dim) != (128, 128):
        # Calibrated on compiled SASS (sm_100a, DSL 4.8.1), causal or not: hd128 256x128, hd192 and
        # hd256 128x128 spill 8-48 B (second softmax and correction warpgroups) with every exp2 on
        # MUFU, none with exp_emu=25; hd128 128x128 compiles clean either way. The single-CTA
        # twins spill the same.
        return (
            f"tile_n=128 with exp_emu=0 spills registers in the pair's softmax/correction warps at "
            f"head_dim={spec.head_dim}, tile_m={spec.tile_m} (compiled SASS); exp_emu=25 does not"
        )
    return None


def _sm100_bwd(spec: VariantSpec) -> str | None:
    if (spec.tile_m, spec.tile_n, spec.stages, spec.warps) != SM100_BWD_TILE:
        tile_m, tile_n, stages, warps = SM100_BWD_TILE
        return (
            f"the sm100 backward runs tile_m={tile_m} tile_n={tile_n} stages={stages} warps={warps} "
            "(128-row UMMAs, one TMEM lane per thread)"
        )
    if spec.head_dim % 64:
        return (
            f"head_dim={spec.head_dim}: the sm100 backward reads Q, dO and K both K-major and MN-major "
            "from one 128-byte-swizzled buffer, which needs a multiple of 64"
        )
    return sm100_over_budget(spec)


# ---------------------------------------------------------------------------------------------
# The predicate

# Per option record: the rules relating its fields (run before the kernel check, as a misuse of an
# option is the first thing to say), then those holding the tile to the templates and the budgets.
_OPTION_RULES: dict[type[Options], tuple[Rule, ...]] = {
    Sm80FwdOptions: (_sm80_cache_dtype, _sm80_line_copy, _sm80_page_chunks),
    Sm80BwdOptions: (_sm80_dq_layout,),
    Sm90FwdOptions: (_sm90_early_rescale, _sm90_lazy_rescale, _sm90_heavy_first),
    Sm90Fp8FwdOptions: (_sm90_fp8_wide_transpose, _sm90_fp8_accumulation),
    Sm90BwdOptions: (_sm90_bwd_dq_path,),
}
_TILE_RULES: dict[type[Options], tuple[Rule, ...]] = {
    Sm80FwdOptions: (_sm80_warps, _sm80_shapes, sm80_over_budget),
    Sm80BwdOptions: (_sm80_bwd_head_dims, _sm80_warps, _sm80_shapes, sm80_over_budget),
    Sm90FwdOptions: (_sm90_roles, sm90_fwd_over_budget, _exp_emu_share),
    Sm90Fp8FwdOptions: (_sm90_roles, _sm90_fp8_tile, _sm90_fp8_varlen, sm90_fwd_over_budget, _exp_emu_share),
    Sm90BwdOptions: (_sm90_bwd,),
    Sm100FwdOptions: (_sm100_fwd, _sm100_tile_n, _exp_emu_share, _sm100_pair, sm100_over_budget),
    Sm100BwdOptions: (_sm100_bwd,),
}


def why_invalid(spec: VariantSpec) -> str | None:
    """The first rule ``spec`` breaks, as a sentence naming it; None when the spec can be built."""
    kind = type(spec.options)
    if policy_mla_wgmma.is_wgmma(spec):  # the WGMMA MLA decode variant (cutefa.model.policy_mla_wgmma)
        return policy_mla_wgmma.why_invalid(spec)
    if policy_mla.is_mla(spec):  # MLA decode: its own rules (cutefa.model.policy_mla)
        return policy_mla.why_invalid(spec)
    for rule in (_fp8_dtype, *_OPTION_RULES.get(kind, ()), _head_dim, why_no_kernel, *_TILE_RULES[kind]):
        reason = rule(spec)
        if reason is not None:
            return reason
    return None


def valid_variants(arch: str, direction: str = "fwd") -> list[VariantSpec]:
    """The candidates of ``arch``'s ``direction`` kernel that pass :func:`why_invalid`."""
    return [spec for spec in candidates(arch, direction) if why_invalid(spec) is None]


def why_not_on(spec: VariantSpec, target: str) -> str | None:
    """Why a valid ``spec`` cannot run on compile target ``target`` (its family does not run there,
    or its shared memory is over the per-block opt-in limit of the target's GPUs,
    :data:`~cutefa.model.budgets.TARGET_SMEM_LIMITS`), or None when it can."""
    if not spec.runs_on(target):
        return f"family {spec.arch} does not run on {target}"
    if (
        isinstance(spec.options, Sm80FwdOptions)
        and spec.options.kv_e4m3
        and target_cc(target) < KV_E4M3_MIN_CC
    ):
        return f"an e4m3 KV cache needs an sm_90a or newer target (its cvt from e4m3); got {target}"
    needed, limit = smem_bytes(spec), TARGET_SMEM_LIMITS[target]
    if needed > limit:
        return (
            f"needs {needed / 1024:.1f} KiB of shared memory, over the {limit // 1024} KiB "
            f"per-block opt-in limit of {target} GPUs"
        )
    return None


def fitting_variant(spec: VariantSpec, target: str) -> VariantSpec | None:
    """``spec`` where it runs on ``target`` (:func:`why_not_on`); else the committed variant like it
    (same family, direction, dtype, head dim, mask and options, another tile) with the most shared
    memory among those that run there: the largest tile the target's GPUs hold (FlashAttention-2's
    rule on GPUs with less shared memory). None when no committed variant like it runs there."""
    if why_not_on(spec, target) is None:
        return spec
    tile = {"tile_m": spec.tile_m, "tile_n": spec.tile_n, "stages": spec.stages, "warps": spec.warps}
    alike = [
        s for s in default_variants(spec.arch, spec.direction)
        if s.replace(**tile) == spec and why_not_on(s, target) is None
    ]  # fmt: skip
    return max(alike, key=smem_bytes, default=None)
