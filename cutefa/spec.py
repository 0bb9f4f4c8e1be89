"""Kernel variant specifications: the spec is the identity, its name is the key.

A :class:`VariantSpec` holds every input to code generation. Its :meth:`~VariantSpec.name` is the
generated file name, the compile-cache key, the CLI filter target and the log tag, and
:func:`parse_name` turns a name back into the spec. One function makes names, one parses them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

# Kernel families (the design a kernel uses). A family runs on any compile target at or above it.
ARCHS = ("sm80", "sm90", "sm100")
DIRECTIONS = ("fwd", "bwd")
DTYPES = ("fp16", "bf16", "e4m3")
HEAD_DIMS = (64, 96, 128, 192, 256)

# Compile targets (the GPU a cubin is built for) and the family each one can run.
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_103a")
DEFAULT_TARGET = {"sm80": "sm_80", "sm90": "sm_90a", "sm100": "sm_100a"}
_TARGET_CC = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90a": 90, "sm_100a": 100, "sm_103a": 103}
_FAMILY_CC = {"sm80": 80, "sm90": 90, "sm100": 100}
# Arch-specific families run only on the targets listed (an 'a' target's code loads only on its own
# compute capability, so each GPU needs its own compile): tcgen05 is the same on B200 (10.0) and
# B300 (10.3).
_FAMILY_TARGET_CCS = {"sm90": (90,), "sm100": (100, 103)}

# torch dtype name <-> spec dtype token
TORCH_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}

_NAME_RE = re.compile(
    r"^cutefa_(?P<arch>sm\d+)_(?P<direction>fwd|bwd)_(?P<dtype>[a-z0-9]+)_hd(?P<head_dim>\d+)"
    r"_(?P<tile_m>\d+)x(?P<tile_n>\d+)_s(?P<stages>\d+)_w(?P<warps>\d+)(?P<flags>(?:_[a-z]+)*)"
    r"(?:_emu(?P<exp_emu>\d+))?$"
)
# Boolean spec fields and the name token each one adds when true, in name order.
_FLAG_TOKENS = (
    ("causal", "causal"),
    ("overlap", "ov"),
    ("pingpong", "pp"),
    ("persistent", "persist"),
    ("early_rescale", "erescale"),
    ("pair_cvt", "pcvt"),
    ("cta_pair", "pair"),
    ("block_quant", "blockq"),
    ("dq_bulk", "dqbulk"),
    ("dq_warp", "dqw"),
    ("row_prefetch", "rpf"),
    ("dq_stage", "dqs"),
    ("lpt_grid", "lpt"),
    ("dq_quad", "dqquad"),
    ("hoist_vt", "hvt"),
    ("wide_vt", "wvt"),
    ("lazy_rescale", "lres"),
    ("dq_tile", "dqtile"),
    ("dq_pipe", "dqpipe"),
    ("sum_mma", "smma"),
    ("two_level", "tlacc"),
    ("v_mean", "vmean"),
)


@dataclass(frozen=True, order=True)
class VariantSpec:
    """One kernel variant. Every field changes the generated code, so every field is in the name."""

    arch: str  # kernel family: sm80 (FA2 design), sm90 (FA3 design), sm100 (FA4 design)
    direction: str  # fwd | bwd
    dtype: str  # fp16 | bf16 | e4m3
    head_dim: int
    tile_m: int  # query rows per CTA tile
    tile_n: int  # key/value rows per mainloop step
    stages: int  # shared-memory buffers for each of K and V
    warps: int  # warps per CTA
    causal: bool = False
    # sm90 forward: issue the next S = Q K^T before this block's softmax (intra-warpgroup overlap) /
    # make the consumer warpgroups take turns issuing MMAs (ping-pong). Name tokens _ov / _pp.
    # sm90 backward: overlap leaves a query block's dQ = dS K WGMMA in flight and issues its
    # reductions into the fp32 dQ accumulator behind the next block's S^T/dP^T WGMMAs (software
    # pipelining of dQ); at head dims 192/256 (the head-dim split) it issues each consumer's dV and
    # dK over its own queries from registers before the per-block barrier; pingpong has no
    # backward meaning (rejected).
    overlap: bool = False
    pingpong: bool = False
    # sm90: a persistent grid (one CTA per SM) walking the tiles longest-first (causal: the last
    # query blocks carry the most work). Name token _persist.
    persistent: bool = False
    # sm90 forward with the overlap schedule: each key block's O rescale (by the factor of the
    # previous block's softmax) is issued right after S = Q K^T, while that WGMMA runs and before
    # O += P V, instead of after the softmax once the previous P V has finished (FlashAttention-3/4's
    # RescaleOBeforeGemm, which they use at head dims above 128). Name token _erescale.
    early_rescale: bool = False
    # sm90 16-bit forward: P is converted from fp32 two scores per instruction (cvt.rn.bf16x2.f32 /
    # f16x2) instead of through ``tensor.to(dtype)``, which the DSL lowers to one F2FP per score plus
    # a PRMT per pair for accumulator shapes other than 64x128 (e.g. tile_n 80 or 64). Name token _pcvt.
    pair_cvt: bool = False
    # sm100: a pair of CTAs in a cluster shares each UMMA (tcgen05 cta_group::2): each CTA loads
    # half of the K/V tile. Name token _pair.
    cta_pair: bool = False
    # sm90 e4m3 forward: FP8 block quantization (FlashAttention-3): one descale per tile_m query rows
    # of q and per tile_n key rows of k and v (per batch and kv head) instead of one per (batch, kv
    # head). Name token _blockq.
    block_quant: bool = False
    # sm90 backward (tile_n 128): FlashAttention-3's dQ path. Each consumer warpgroup writes its dQ
    # piece to shared memory in the WGMMA fragment's own order and one thread adds the whole piece
    # into global memory with one bulk reduce-add (cp.reduce.async.bulk), into a tiled dq_accum
    # workspace (one contiguous chunk per query block, in fragment order) that its own postprocess
    # reads back; instead of per-thread 8-byte reductions. Name token _dqbulk.
    dq_bulk: bool = False
    # sm90 backward with dq_bulk (templates/bwd_sm90.py.j2 only): a dQ-writer warp (FlashAttention-3's
    # dQ path as FA3/FA4 run it): warp 1 of the producer warpgroup issues every bulk reduce-add of dQ
    # and waits for it, synchronized with each consumer by a "dQ full" and a "dQ empty" named
    # barrier; the consumers only stage their piece in shared memory and arrive. Name token _dqw.
    dq_warp: bool = False
    # sm90 backward (templates/bwd_sm90.py.j2 only): each query block's LSE2 and D values of a
    # thread's query columns are read from shared memory into registers ahead of the WGMMA waits
    # they follow: LSE2 before S^T/dP^T are issued (behind their operand reads it would return only
    # as dP^T ends), D before the wait for dP^T (FlashAttention-3 loads them before its waits).
    # Name token _rpf.
    row_prefetch: bool = False
    # sm90 backward, swapped-dK/dV partition (templates/bwd_sm90_swapkv.py.j2, head dim 192) with
    # dq_bulk: FlashAttention-4's shared-memory budget for that tile: a 2-stage Q ring and a 1-stage
    # dO pipeline (two TMA pipelines), one dS buffer, and a dedicated fp32 dQ staging buffer per
    # consumer (instead of staging dQ in the current Q/dO stage), so that dQ is issued before dK^T
    # and staged while dK^T runs. Name token _dqs.
    dq_stage: bool = False
    # sm90 16-bit forward, not persistent: a 1-D grid of one CTA per tile in longest-first order
    # (FlashAttention-4's causal launch order): the (head, batch) pairs in sections whose K/V fit the
    # L2 budget, inside a section the last query blocks of all its pairs first (parts.lpt_tile).
    # Name token _lpt.
    lpt_grid: bool = False
    # sm80 backward: the fp32 dQ accumulator's columns permuted (within each span of 16 x the dQ
    # warp grid's columns) so that a thread's four values of one row in a span (two adjacent
    # columns of each of its two n8 MMA atoms there) are adjacent: one 16-byte
    # red.global.add.v4.f32 adds them (sm_90 and newer; a warp's reduction covers 64 contiguous
    # bytes of each of 8 rows), and the postprocess reads the columns back through the same
    # permutation. Compiled for sm_80/86/89 the variant keeps the natural layout and element-wise
    # reductions. Name token _dqquad.
    dq_quad: bool = False
    # sm90 e4m3 forward: the producer's V transpose addresses V and Vt as a few per-thread swizzled
    # byte bases (computed once, before the key loop) plus compile-time offsets, its steps unrolled
    # (fp8.TransposeV), instead of indexing the swizzled 32-bit views per word; the same bytes land
    # in the same Vt words. Name token _hvt.
    hoist_vt: bool = False
    # sm90 e4m3 forward with hoist_vt: the V transpose with 64-bit shared-memory accesses
    # (fp8.WideTransposeV): a thread's unit is 8 keys x 8 head dims (8 LDS.64, 32 PRMT, 8 STS.64),
    # half the shared-memory instructions of the 4 x 4 unit; the same bytes land in the same Vt
    # words. Name token _wvt.
    wide_vt: bool = False
    # sm90 forward: a warp keeps its rows' running maxes (the exp2 offsets) until a key block raises
    # one of them by more than a threshold, and rescales its rows of O only then, in one
    # warp-uniform branch (cutefa/kernels/common/lazy_rescale.py): e4m3 2^4 with P shifted by 2^4
    # instead of 2^8 (below 256 either way), fp16/bf16 2^8 (the overlap schedule). Exact up to
    # rounding. Name token _lres.
    lazy_rescale: bool = False
    # sm80 backward: the fp32 dQ accumulator tiled by query blocks, each block's tile_m x head_dim
    # values in the dQ MMA's fragment order (value v * j + e of thread t at word v * (threads * j +
    # t) + e, v = 4 where the target has 16-byte reductions, sm_90 and newer, else 1), so that one
    # warp's reduction covers 32 * 4 * v contiguous bytes (FlashAttention-2's workspace); the
    # padding rows of the last block take zeros, so no reduction is predicated. The postprocess
    # reads each thread's values back in the same order. Name token _dqtile.
    dq_tile: bool = False
    # sm80 backward with dq_tile and one Q buffer: dQ = dS K computed by column chunks (one tile
    # of the dQ MMA's warp grid, 16 x warps_n columns), chunk c - 1's 16-byte reductions issued
    # between the two halves of chunk c's k-blocks and fenced by warp syncs, the last chunk's
    # after the next step's S MMAs are issued (the last step's after the loop), so that they
    # leave while MMAs run instead of in one burst at the end of the step (where ptxas puts them
    # when the GEMM is one block). Name token _dqpipe.
    dq_pipe: bool = False
    # sm90 e4m3 forward, overlap schedule: the row sums of P taken by one more WGMMA per key block,
    # P (the P V product's register operand) times a constant block of e4m3 ones in shared memory
    # (N = 8) into a fresh accumulator, added to the fp32 running sums once the block's P V is
    # done, instead of a floating-point add per probability (fp8.sum_tiled_mma). Name token _smma.
    sum_mma: bool = False
    # sm90 e4m3 forward, overlap schedule: two-level accumulation of O. The e4m3 tensor cores add
    # into their accumulator with fewer mantissa bits than fp32, which over thousands of keys
    # loses a share of O that grows with the key count (where V's columns carry a mean); every
    # fp8.PROMOTE_BLOCKS key blocks each consumer thread adds its O accumulator into an fp32 copy
    # in shared memory and restarts it from zero (fp8.promote_o). Name token _tlacc.
    two_level: bool = False
    # sm90 e4m3 forward: the kernel takes v's column means (float32 (batch, heads_kv, head_dim),
    # taken out before quantization: cutefa.center_v) after the descales and adds them in the
    # epilogue to every row that attends a key (one FFMA per output value instead of the FMUL),
    # so that flash_attn_func(v_mean=) needs no pass over O after the kernel. Name token _vmean.
    v_mean: bool = False
    # sm100: percent of the softmax exp2 evaluated by a polynomial on the FMA units instead of
    # MUFU.EX2 (name token ``_emu<N>`` when non-zero; other families take 0 only).
    exp_emu: int = 0

    def __post_init__(self) -> None:
        for field, allowed in (("arch", ARCHS), ("direction", DIRECTIONS), ("dtype", DTYPES)):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"VariantSpec.{field}={value!r} is not one of {allowed}")
        for field in ("head_dim", "tile_m", "tile_n", "stages", "warps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"VariantSpec.{field}={value!r} must be a positive int")
            if value <= 0:
                raise ValueError(f"VariantSpec.{field}={value!r} must be a positive int")
        for field, _ in _FLAG_TOKENS:
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"VariantSpec.{field}={getattr(self, field)!r} must be a bool")
        if not isinstance(self.exp_emu, int) or isinstance(self.exp_emu, bool):
            raise TypeError(f"VariantSpec.exp_emu={self.exp_emu!r} must be an int percentage")
        if not 0 <= self.exp_emu <= 100:
            raise ValueError(f"VariantSpec.exp_emu={self.exp_emu!r} must be a percentage in [0, 100]")

    @property
    def name(self) -> str:
        flags = "".join(f"_{tok}" for field, tok in _FLAG_TOKENS if getattr(self, field))
        return (
            f"cutefa_{self.arch}_{self.direction}_{self.dtype}_hd{self.head_dim}"
            f"_{self.tile_m}x{self.tile_n}_s{self.stages}_w{self.warps}{flags}"
            + (f"_emu{self.exp_emu}" if self.exp_emu else "")
        )

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def elem_bytes(self) -> int:
        return 1 if self.dtype == "e4m3" else 2

    def replace(self, **changes) -> VariantSpec:
        return dataclasses.replace(self, **changes)

    def runs_on(self, target: str) -> bool:
        """Whether this family's kernels are valid on compile target ``target`` (e.g. 'sm_90a')."""
        cc = target_cc(target)
        fam = _FAMILY_CC[self.arch]
        if self.arch == "sm80":
            return cc >= fam
        # WGMMA/setmaxnreg (sm90a) and tcgen05 (sm100a/sm103a) are arch-specific, not forward compatible.
        return cc in _FAMILY_TARGET_CCS.get(self.arch, (fam,))

    def __str__(self) -> str:
        return self.name


def parse_name(name: str) -> VariantSpec:
    """Inverse of :attr:`VariantSpec.name`. Raises ``ValueError`` naming what is wrong."""
    m = _NAME_RE.match(name)
    if not m:
        raise ValueError(
            f"not a cutefa variant name: {name!r} "
            "(expected like 'cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_causal')"
        )
    flags = [f for f in m["flags"].split("_") if f]
    known = {tok: field for field, tok in _FLAG_TOKENS}
    unknown = [f for f in flags if f not in known]
    if unknown:
        raise ValueError(f"variant name {name!r} has unknown flag(s) {unknown}; known: {sorted(known)}")
    order = [tok for _, tok in _FLAG_TOKENS]
    if flags != sorted(set(flags), key=order.index):
        raise ValueError(f"variant name {name!r}: flags must appear once each, in the order {order}")
    spec = VariantSpec(
        arch=m["arch"],
        direction=m["direction"],
        dtype=m["dtype"],
        head_dim=int(m["head_dim"]),
        tile_m=int(m["tile_m"]),
        tile_n=int(m["tile_n"]),
        stages=int(m["stages"]),
        warps=int(m["warps"]),
        exp_emu=int(m["exp_emu"] or 0),
        **{known[f]: True for f in flags},
    )
    if spec.name != name:  # e.g. leading zeros in a number
        raise ValueError(f"variant name {name!r} is not canonical; the canonical form is {spec.name!r}")
    return spec


def target_cc(target: str) -> int:
    """Compute capability number (80, 90, 100...) of a compile target like 'sm_90a'."""
    if target not in _TARGET_CC:
        raise ValueError(f"unknown compile target {target!r}; known targets: {TARGETS}")
    return _TARGET_CC[target]


def target_for_capability(major: int, minor: int) -> str:
    """The compile target cutefa uses for a GPU of compute capability (major, minor)."""
    cc = major * 10 + minor
    if cc >= 100:
        # sm_100a code does not load on a cc 10.3 GPU (B300): it gets its own target.
        return {100: "sm_100a", 103: "sm_103a"}.get(cc, f"sm_{cc}")
    if cc >= 90:
        return "sm_90a"
    if cc in (86, 87):
        return "sm_86"
    if cc >= 89:
        return "sm_89"
    if cc >= 80:
        return "sm_80"
    return f"sm_{cc}"


def families_for_target(target: str) -> list[str]:
    """Kernel families that can run on ``target``, best (newest) first."""
    target_cc(target)  # validates the name
    return [a for a in reversed(ARCHS) if VariantSpec(a, "fwd", "bf16", 128, 128, 64, 1, 4).runs_on(target)]
