"""Paper performance model of the sm100 (FlashAttention-4 design) forward variants on a B200.

No Blackwell GPU was available: the sm100 kernels are compiled and SASS-checked, not run. This
model is the plan they are built to: per key block and per 128-row Q tile it compares

* tensor-core time: 4 * 128 * tile_n * head_dim FLOPs (S = Q K^T and O += P V) at the dense
  16-bit UMMA rate,
* MUFU time: the exp2 of 128 * tile_n scores not emulated, at 16 ex2 per clock per SM,
* FMA-pipe time: per score the softmax's own FP32 work plus, for the emulated share, the
  polynomial exp2 (cutefa.kernels.sm100.parts.exp2_fma), at 128 FP32 lanes per clock per SM,
* memory time: Q, K, V read and O written once at HBM bandwidth (K/V re-reads hit L2),

takes the largest per-block time (the units overlap: two softmax warpgroups ping-pong against one
MMA warp), and reports the predicted TFLOP/s for a long-sequence problem. It also finds the
exp-emulation share that balances MUFU and FMA.

CTA pairs (``cta_pair``, tcgen05 cta_group::2): a second table compares each committed pair
variant with its single-CTA twin on what the pair changes, shared-memory traffic per SM (UMMA
operand reads plus TMA fills, against 128 B/clk/SM) and K/V bytes read from L2. The per-SM
tensor-core rate is the same (an M = 256 UMMA over two SMs is 128 rows per SM).

Usage: python tools/roofline.py [--seqlen 8192] [--batch-heads 128] [--markdown]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if str(Path(__file__).resolve().parent) not in sys.path:  # tools/alternatives.py, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from alternatives import all_variants

from cutefa.model.spec import VariantSpec

# B200 (published): 148 SMs, ~1.85 GHz boost under tensor load, 2.25 PFLOP/s dense FP16/BF16 with
# FP32 accumulate, 8 TB/s HBM3e. Per-SM per-clock rates follow from these.
SMS = 148
CLOCK_HZ = 1.85e9
DENSE_16BIT_FLOPS = 2.25e15
HBM_BYTES_PER_S = 8.0e12
MMA_FLOPS_PER_CLK_SM = DENSE_16BIT_FLOPS / (SMS * CLOCK_HZ)  # ~8200
MUFU_EX2_PER_CLK_SM = 16
FMA_LANES_PER_CLK_SM = 128
SMEM_BYTES_PER_CLK_SM = 128  # shared-memory bandwidth of one SM

# FMA-pipe instructions per score (issue slots of one FP32 lane), counted from the softmax code:
# the scale-and-subtract FFMA2 (0.5), the packed row-sum FADD2 (0.5), the 16-bit conversion
# (0.5, F2FP packs two), the row max (FMNMX, 1). The emulated exp2 adds clamp, round-by-shift
# (FADD, FADD), fraction (FADD) and three FFMA of the polynomial: 7 more FP32 ops (its integer
# shift/add run on the ALU pipe and are not counted).
FMA_OPS_PER_SCORE = 2.5
FMA_OPS_PER_EMULATED_EXP = 7.0


@dataclass
class Prediction:
    spec: VariantSpec
    clk_mma: float
    clk_mufu: float
    clk_fma: float
    clk_mem: float
    best_share: float

    @property
    def clk_block(self) -> float:
        return max(self.clk_mma, self.clk_mufu, self.clk_fma)

    @property
    def bound(self) -> str:
        times = {"MMA": self.clk_mma, "MUFU": self.clk_mufu, "FMA": self.clk_fma}
        return max(times, key=times.get)

    @property
    def mma_utilisation(self) -> float:
        return self.clk_mma / self.clk_block


def balanced_share() -> float:
    """The emulated share f with MUFU time == FMA time: (1 - f) / 16 = (b + c f) / 128."""
    ratio = FMA_LANES_PER_CLK_SM / MUFU_EX2_PER_CLK_SM
    return (ratio - FMA_OPS_PER_SCORE) / (ratio + FMA_OPS_PER_EMULATED_EXP)


def predict(spec: VariantSpec, seqlen: int, batch_heads: int) -> Prediction:
    scores = 128 * spec.tile_n  # per Q tile and key block
    share = spec.options.exp_emu / 100
    clk_mma = 4 * 128 * spec.tile_n * spec.head_dim / MMA_FLOPS_PER_CLK_SM
    clk_mufu = scores * (1 - share) / MUFU_EX2_PER_CLK_SM
    clk_fma = scores * (FMA_OPS_PER_SCORE + share * FMA_OPS_PER_EMULATED_EXP) / FMA_LANES_PER_CLK_SM
    # HBM bytes per 128-row Q tile and key block: Q, K, V and O cross HBM once (the K/V re-reads of
    # the seqlen / tile_m CTAs of a head are L2 hits), spread over all blocks of the problem.
    blocks = seqlen // spec.tile_n
    tiles = batch_heads * seqlen // 128
    total_bytes = batch_heads * seqlen * spec.head_dim * spec.elem_bytes * 4
    clk_mem = total_bytes / HBM_BYTES_PER_S * CLOCK_HZ * SMS / (tiles * blocks)
    return Prediction(spec, clk_mma, clk_mufu, clk_fma, clk_mem, balanced_share())


def tflops(p: Prediction, causal_factor: float = 1.0, clk_smem: float = 0.0) -> float:
    clk = max(p.clk_block, p.clk_mem, clk_smem)
    return MMA_FLOPS_PER_CLK_SM * p.clk_mma / clk * SMS * CLOCK_HZ / 1e12 * causal_factor


def smem_clk(spec: VariantSpec) -> float:
    """Shared-memory clocks of one SM per 128-row Q tile and key block. The UMMAs read Q (128 x d)
    and the SM's part of K for S = Q K^T and its part of V for O += P V (P comes from TMEM); the
    TMA fills K and V once per key block for all Q tiles of the CTA. A CTA of a pair holds and
    reads half of K (tile_n / 2 keys) and half of V (d / 2 columns). Assumes operand reads and
    TMA fills share the 128 B/clk of an SM."""
    half = 2 if spec.options.cta_pair else 1
    q_tiles = spec.tile_m // 128
    kv_bytes = 2 * spec.tile_n * spec.head_dim * spec.elem_bytes // half  # this SM's K and V of a block
    reads = 128 * spec.head_dim * spec.elem_bytes + kv_bytes
    fills = kv_bytes / q_tiles
    return (reads + fills) / SMEM_BYTES_PER_CLK_SM


def l2_kv_bytes(spec: VariantSpec, seqlen: int, batch_heads: int) -> float:
    """K and V bytes moved from L2 into SMs for a non-causal problem: every CTA (one per tile_m
    query rows) reads all of K and V of its head, a CTA of a pair half of them."""
    ctas = batch_heads * seqlen / spec.tile_m
    per_cta = 2 * seqlen * spec.head_dim * spec.elem_bytes / (2 if spec.options.cta_pair else 1)
    return ctas * per_cta


def pair_causal_waste(spec: VariantSpec, seqlen: int) -> float:
    """Extra UMMA work of a causal pair: both CTAs visit the key blocks of the pair's last row, so
    the first CTA of each pair runs ~tile_m / tile_n blocks past its own diagonal. Summed over the
    problem (seqlen_q = seqlen_k) that is tile_m / seqlen of the causal work."""
    return spec.tile_m / seqlen if spec.options.cta_pair else 0.0


def pair_rows(seqlen: int, batch_heads: int) -> list[tuple[VariantSpec, VariantSpec, dict[str, float]]]:
    """(pair variant, its single-CTA twin, numbers) for every bf16 non-causal pair variant (committed
    or a measured alternative)."""
    rows = []
    for pair in all_variants("sm100", "fwd"):
        if not pair.options.cta_pair or pair.dtype != "bf16" or pair.causal:
            continue
        single = pair.replace(cta_pair=False)
        p = predict(single, seqlen, batch_heads)
        numbers = {
            "mma": p.clk_mma,
            "smem_single": smem_clk(single),
            "smem_pair": smem_clk(pair),
            "l2_single": l2_kv_bytes(single, seqlen, batch_heads) / 1e9,
            "l2_pair": l2_kv_bytes(pair, seqlen, batch_heads) / 1e9,
            "tflops_single": tflops(p, clk_smem=smem_clk(single)),
            "tflops_pair": tflops(p, clk_smem=smem_clk(pair)),
            "causal_waste": pair_causal_waste(pair, seqlen),
        }
        rows.append((pair, single, numbers))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--batch-heads", type=int, default=128)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    specs = [s for s in all_variants("sm100", "fwd") if s.dtype == "bf16" and not s.causal]
    specs = [s for s in specs if not s.options.cta_pair]
    rows = []
    for spec in specs:
        for share in sorted({0, spec.options.exp_emu, 25, 50}):
            p = predict(spec.replace(exp_emu=share), args.seqlen, args.batch_heads)
            rows.append((spec.head_dim, f"{spec.tile_m}x{spec.tile_n}", share, p))
    head = "| hd | tile | exp_emu % | MMA clk | MUFU clk | FMA clk | mem clk | bound | MMA busy | TFLOP/s |"
    sep = "|---|---|---|---|---|---|---|---|---|---|"
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print(sep)
    for hd, tile, share, p in rows:
        line = (
            f"| {hd} | {tile} | {share} | {p.clk_mma:.0f} | {p.clk_mufu:.0f} | {p.clk_fma:.0f} | "
            f"{p.clk_mem:.0f} | {p.bound} | {p.mma_utilisation:.0%} | {tflops(p):.0f} |"
        )
        print(line if args.markdown else line.replace("|", " "))
    print(
        f"\nbalanced exp emulation share (MUFU time == FMA time): {balanced_share():.0%}; "
        f"B200 model: {MMA_FLOPS_PER_CLK_SM:.0f} MMA FLOP/clk/SM, {MUFU_EX2_PER_CLK_SM} ex2/clk/SM, "
        f"{FMA_LANES_PER_CLK_SM} FP32 lanes/clk/SM. Compiled and SASS-checked, not run."
    )
    head = (
        "| hd | tile | MMA clk | smem clk 1 CTA | smem clk pair | L2 K/V GB 1 CTA | L2 K/V GB pair "
        "| TFLOP/s 1 CTA | TFLOP/s pair | causal extra work |"
    )
    print("\nCTA pair (cta_pair) against one CTA per UMMA, with shared-memory traffic in the bound:")
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print("|---|---|---|---|---|---|---|---|---|---|")
    for pair, _, n in pair_rows(args.seqlen, args.batch_heads):
        line = (
            f"| {pair.head_dim} | {pair.tile_m}x{pair.tile_n} | {n['mma']:.0f} | {n['smem_single']:.0f} | "
            f"{n['smem_pair']:.0f} | {n['l2_single']:.1f} | {n['l2_pair']:.1f} | {n['tflops_single']:.0f} | "
            f"{n['tflops_pair']:.0f} | {n['causal_waste']:.1%} |"
        )
        print(line if args.markdown else line.replace("|", " "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
