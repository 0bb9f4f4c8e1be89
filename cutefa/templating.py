"""What a kernel template sees: the jinja context of a spec.

A template reads the spec's plain fields (``spec.head_dim``, ``spec.tile_m``, ``spec.dtype``...),
its name, the flat **switches** of its family's option record (``overlap``, ``persistent``,
``dq_bulk``...; only that family's, so jinja's StrictUndefined stops a template that reads another
family's) and the numbers and choices decided in Python (:mod:`cutefa.model.policy_sm80`,
:mod:`~cutefa.model.policy_sm90`, :mod:`~cutefa.model.policy_sm100` and the budget models), so
that the template itself holds no arithmetic and makes no decision.
"""

from __future__ import annotations

from collections.abc import Callable

from cutefa.model import policy_decode, policy_mla, policy_mla_wgmma, policy_sm80, policy_sm90, policy_sm100
from cutefa.model.budgets_sm90 import (
    sm90_bwd_dq_bulk_aliases,
    sm90_bwd_dq_pieces,
    sm90_bwd_swap_do_stages,
    sm90_fwd_tile_head_dims,
)
from cutefa.model.budgets_sm100 import sm100_tmem_columns
from cutefa.model.options import (
    DqLayout,
    DqPath,
    Mask,
    OAccum,
    Options,
    Quant,
    RowSum,
    Scheduler,
    Sm80BwdOptions,
    Sm80FwdOptions,
    Sm90BwdOptions,
    Sm90Fp8FwdOptions,
    Sm90FwdOptions,
    Sm100BwdOptions,
    Sm100FwdOptions,
    VTranspose,
)
from cutefa.model.spec import VariantSpec
from cutefa.mods.context import mods_context

Context = dict[str, object]

KIB = 1024
FP32_BYTES = 4


def _sm80_fwd(o: Sm80FwdOptions) -> Context:
    return {}


def _sm80_bwd(o: Sm80BwdOptions) -> Context:
    return {
        "dq_quad": o.dq_layout is DqLayout.QUAD,
        "dq_tile": o.dq_layout is DqLayout.TILE,
        "dq_pipe": o.dq_pipe,
    }


def _sm90_fwd(o: Sm90FwdOptions) -> Context:
    return {
        "overlap": o.schedule.overlap,
        "pingpong": o.schedule.pingpong,
        "persistent": o.scheduler is Scheduler.PERSISTENT,
        "lpt_grid": o.scheduler is Scheduler.LPT,
        "hfirst_grid": o.scheduler is Scheduler.HEAVY_FIRST,
        "early_rescale": o.early_rescale,
        "pair_cvt": o.pair_cvt,
        "lazy_rescale": o.lazy_rescale,
        "exp_emu": o.exp_emu,
    }


def _sm90_fp8_fwd(o: Sm90Fp8FwdOptions) -> Context:
    return {
        "overlap": o.schedule.overlap,
        "pingpong": o.schedule.pingpong,
        "persistent": o.scheduler is Scheduler.PERSISTENT,
        "block_quant": o.quant is Quant.BLOCK,
        "hoist_vt": o.v_transpose is not VTranspose.INDEXED,
        "wide_vt": o.v_transpose is VTranspose.WIDE,
        "lazy_rescale": o.lazy_rescale,
        "sum_mma": o.row_sum is RowSum.MMA,
        "two_level": o.o_accum is OAccum.TWO_LEVEL,
        "v_mean": o.v_mean,
        "exp_emu": o.exp_emu,
    }


def _sm90_bwd(o: Sm90BwdOptions) -> Context:
    return {
        "overlap": o.overlap,
        "dq_bulk": o.dq_path is not DqPath.RED,
        "dq_warp": o.dq_path is DqPath.BULK_WARP,
        "dq_stage": o.dq_path is DqPath.BULK_STAGED,
        "row_prefetch": o.row_prefetch,
    }


def _sm100_fwd(o: Sm100FwdOptions) -> Context:
    return {"cta_pair": o.cta_pair, "exp_emu": o.exp_emu}


def _sm100_bwd(o: Sm100BwdOptions) -> Context:
    return {}


# The switches of each family's option record (every family also has ``causal``, from the mask).
_SWITCHES: dict[type[Options], Callable[..., Context]] = {
    Sm80FwdOptions: _sm80_fwd,
    Sm80BwdOptions: _sm80_bwd,
    Sm90FwdOptions: _sm90_fwd,
    Sm90Fp8FwdOptions: _sm90_fp8_fwd,
    Sm90BwdOptions: _sm90_bwd,
    Sm100FwdOptions: _sm100_fwd,
    Sm100BwdOptions: _sm100_bwd,
}


def switches(spec: VariantSpec) -> Context:
    """The flat switches of ``spec``'s family: ``causal``, ``local`` (the sliding-window mask), the
    feature axes (``varlen``, ``paged_kv``, ``split_kv``, ``softcap``, ``alibi``, ``sinks``) and
    its option record's choices as booleans (``exp_emu`` as its percentage). The runtime values
    of the features are kernel arguments in the order of :mod:`cutefa.api.features`."""
    f = spec.features
    return {
        "causal": spec.mask is Mask.CAUSAL,
        "local": spec.mask is Mask.LOCAL,
        "varlen": f.varlen,
        "paged_kv": f.paged_kv,
        "split_kv": f.split_kv,
        "softcap": f.softcap,
        "alibi": f.alibi,
        "sinks": f.sinks,
        **_SWITCHES[type(spec.options)](spec.options),
    }


def exp_emu_per_16(spec: VariantSpec) -> int:
    """Of every 16 scores, how many take exp2 on the FMA units (the option's percentage, rounded down)."""
    return spec.options.exp_emu * 16 // 100


def _fwd_sm80(spec: VariantSpec) -> Context:
    mods = policy_sm80.score_mod_imports(spec)
    return {
        "single_stage": spec.stages == 1, **policy_sm80.head_dims(spec),
        **({"score_mod_imports": mods} if mods else {}),
        **mods_context(spec),  # a user's score_mod/mask_mod (cutefa.mods), only where the spec has them
    }


def _bwd_sm80(spec: VariantSpec) -> Context:
    return {
        # the CTA's own key blocks only (no stream-K tail): the causal, feature and mod variants
        # (and a padded head dim: cutefa.kernels.sm80.head_pad)
        "own_blocks": spec.mask is not Mask.NONE or spec.features.any or "mods" in mods_context(spec)
        or policy_sm80.head_dims(spec)["head_apart"],
        "score_mod_imports": policy_sm80.score_mod_imports(spec),
        **policy_sm80.head_dims(spec),
        "double_q": spec.stages > 1,  # the next query block's Q loads into the other buffer
        "half_warps": spec.warps // 2,
        "warp_grids": policy_sm80.bwd_warp_grids(spec),
        "heavy_first": policy_sm80.bwd_heavy_first(spec),
        **mods_context(spec),  # a user's score_mod/mask_mod (cutefa.mods), only where the spec has them
    }


def _fwd_sm90(spec: VariantSpec) -> Context:
    consumers = policy_sm90.consumers(spec)
    producer_regs, consumer_regs = policy_sm90.fwd_register_split(spec)
    return {
        "consumers": consumers,
        "last_consumer": consumers - 1,
        # ping-pong among three consumers: each passes the turn on to the next (a ring of barriers)
        "pp_ring": spec.options.schedule.pingpong and consumers > 2,
        "exp_emu_per_16": exp_emu_per_16(spec),
        "producer_regs": producer_regs,
        "consumer_regs": consumer_regs,
        "ptxas_options": policy_sm90.fwd_ptxas_options(spec),
        "hoisted_descriptors": policy_sm90.fwd_hoisted_descriptors(spec),
        "mask_select": policy_sm90.fwd_mask_select(spec),
        # the features' arguments (cutefa.api.features): the module defines its own fake_arguments
        "feature_args": policy_sm90.fwd_feature_args(spec),
        # head dims of its own: padded tile head dims, a V head dim apart (kernels/sm90/head_dims.py)
        "own_dims": policy_sm90.fwd_own_head_dims(spec),
        "tile_d": sm90_fwd_tile_head_dims(spec)[0],
        "tile_dv": sm90_fwd_tile_head_dims(spec)[1],
        "o_in_q_slab": policy_sm90.fwd_o_in_q_slab(spec),
        **mods_context(spec),  # a user's score_mod/mask_mod (cutefa.mods), only where the spec has them
    }


def _fwd_sm90_fp8(spec: VariantSpec) -> Context:
    producer_regs, consumer_regs = policy_sm90.fwd_register_split(spec)
    return {
        "consumers": policy_sm90.consumers(spec),
        "exp_emu_per_16": exp_emu_per_16(spec),
        "producer_regs": producer_regs,
        "consumer_regs": consumer_regs,
        "ptxas_options": policy_sm90.fwd_ptxas_options(spec),
        "mask_select": policy_sm90.fwd_mask_select(spec),
        "lpt_single_section": policy_sm90.fwd_lpt_single_section(spec),
    }


def _sm90_bwd_common(spec: VariantSpec) -> Context:
    producer_regs, consumer_regs = policy_sm90.bwd_register_split(spec)
    return {
        "producer_regs": producer_regs,
        "consumer_regs": consumer_regs,
        "dq_pieces": sm90_bwd_dq_pieces(spec),
    }


def _bwd_sm90(spec: VariantSpec) -> Context:
    return {
        **_sm90_bwd_common(spec),
        "early_dv": policy_sm90.bwd_early_dv(spec),
        "dq_swap": policy_sm90.bwd_dq_transposed(spec),
    }


def _bwd_sm90_hsplit(spec: VariantSpec) -> Context:
    return {
        **_sm90_bwd_common(spec),
        "dq_alias": sm90_bwd_dq_bulk_aliases(spec),
        "half_d": spec.head_dim // 2,  # head-dim columns of dK, dV and dQ per consumer
        "half_m": spec.tile_m // 2,  # queries of S^T and dP^T per consumer
        "dq_kib": FP32_BYTES * spec.tile_m * spec.head_dim // KIB,  # fp32 dQ of a query block
    }


def _bwd_sm90_swapkv(spec: VariantSpec) -> Context:
    common = _sm90_bwd_common(spec)
    keys_wg = spec.tile_n // 2
    dq_cols = common["dq_pieces"][1][1]
    return {
        **common,
        "keys_wg": keys_wg,  # keys per consumer
        "dq_cols": dq_cols,  # head-dim columns of dQ per consumer
        # registers of dK^T and dV^T per thread
        "dkv_regs": (spec.head_dim + spec.head_dim_v) * keys_wg // 128,
        "dkv64_regs": (spec.head_dim + spec.head_dim_v) * policy_sm90.WG_ROWS // 128,  # the same of 64 keys
        "dq_piece_kib": FP32_BYTES * policy_sm90.WG_ROWS * dq_cols // KIB,  # one consumer's fp32 dQ piece
        "dq_kib": FP32_BYTES * spec.tile_m * spec.head_dim // KIB,  # fp32 dQ of a query block
        # v of a head dim of its own: V, dO and dV^T tiles of that head dim (policy_sm90.bwd_separate_v)
        "split_v": policy_sm90.bwd_separate_v(spec),
        "do_stages": sm90_bwd_swap_do_stages(spec),  # the dO pipeline's stages (dq_stage)
        "do_barriers": 2 * sm90_bwd_swap_do_stages(spec),  # its full and empty mbarriers
    }


def _fwd_sm100(spec: VariantSpec) -> Context:
    fp8 = spec.dtype == "e4m3"
    reg_softmax, reg_correction, reg_other = policy_sm100.fwd_register_split(spec)
    q_tiles = policy_sm100.q_tiles(spec)
    p_per_column = 4 if fp8 else 2  # P values packed per 32-bit TMEM column
    return {
        "fp8": fp8,
        # a feature axis or the local mask: the kernel takes the feature calling convention
        "featured": policy_sm100.fwd_featured(spec),
        "q_tiles": q_tiles,
        "one_q_tile": q_tiles == 1,
        "tmem_used": sm100_tmem_columns(spec),
        "tmem_alloc": policy_sm100.fwd_tmem_alloc(spec),
        "tmem_s": policy_sm100.fwd_tmem_s(spec),
        "tmem_o": policy_sm100.fwd_tmem_o(spec),
        "exp_emu_per_16": exp_emu_per_16(spec),
        "rescale_threshold": policy_sm100.fwd_rescale_threshold(spec),
        "p_shift": policy_sm100.fwd_p_shift(spec),
        "o_chunk": policy_sm100.O_CHUNK,
        "reg_softmax": reg_softmax,
        "reg_correction": reg_correction,
        "reg_other": reg_other,
        "p_per_column": p_per_column,
        "p_columns": spec.tile_n // p_per_column,  # of P inside S
        "pair_rows": 2 * spec.tile_m,  # query rows of a CTA pair's tile
        "half_keys": spec.tile_n // 2,  # keys of a K block one CTA of a pair loads
        "half_dim": spec.head_dim // 2,  # columns of a V block one CTA of a pair loads
    }


def _decode_sm80(spec: VariantSpec) -> Context:
    return {
        "features": spec.features.tokens,  # the docstring's list
        "combine_warps": policy_decode.COMBINE_WARPS,
        "copy_threads_per_row": policy_decode.copy_threads_per_row(spec),
        # a paged cache's page reads per chunk of keys (policy_decode.DecodePages.CHUNKS): the rows
        # between a thread's rows; None: a read per row
        "page_row_step": policy_decode.chunk_row_step(spec) if spec.options.page_chunks else None,
        # the KEYS schedule (policy_decode.DecodeSchedule): warps splitting each key block
        "key_split": policy_decode.key_warps(spec) > 1,
        "key_warps": policy_decode.key_warps(spec),
        "warp_keys": policy_decode.warp_keys(spec),
    }


def _decode_mla_sm90(spec: VariantSpec) -> Context:
    return {"features": spec.features.tokens, **policy_mla.template_numbers(spec)}


def _decode_mla_wgmma_sm90(spec: VariantSpec) -> Context:
    return {"features": spec.features.tokens, **policy_mla_wgmma.template_numbers(spec)}


def _bwd_sm100(spec: VariantSpec) -> Context:
    tmem_dp, tmem_dv, tmem_dk, tmem_end = policy_sm100.bwd_tmem_columns(spec)
    return {"tmem_dp": tmem_dp, "tmem_dv": tmem_dv, "tmem_dk": tmem_dk, "tmem_end": tmem_end}


# The numbers and choices each template reads, by template file name.
_NUMBERS: dict[str, Callable[[VariantSpec], Context]] = {
    "fwd_sm80.py.j2": _fwd_sm80,
    "bwd_sm80.py.j2": _bwd_sm80,
    "fwd_sm90.py.j2": _fwd_sm90,
    "fwd_sm90_fp8.py.j2": _fwd_sm90_fp8,
    "bwd_sm90.py.j2": _bwd_sm90,
    "bwd_sm90_hsplit.py.j2": _bwd_sm90_hsplit,
    "bwd_sm90_swapkv.py.j2": _bwd_sm90_swapkv,
    "fwd_sm100.py.j2": _fwd_sm100,
    "bwd_sm100.py.j2": _bwd_sm100,
    "decode_sm80.py.j2": _decode_sm80,
    "decode_mla_sm90.py.j2": _decode_mla_sm90,
    "decode_mla_wgmma_sm90.py.j2": _decode_mla_wgmma_sm90,
}


def template_context(spec: VariantSpec, template: str) -> Context:
    """The jinja context of ``spec`` rendered by ``template`` (a file name in templates/): the
    spec, its name, its family's :func:`switches` and the numbers that template reads. A
    template of another name (a test's) gets the spec, the name and the switches."""
    numbers = _NUMBERS.get(template)
    return {"spec": spec, "name": spec.name, **switches(spec), **(numbers(spec) if numbers else {})}
