"""The sm90 backward of q/k of head dim 192 against v of 128 (DeepSeek's prefill, spec.HEAD_DIM_V_PAIRS)
on this CPU: templates/bwd_sm90_swapkv.py.j2's swapped-dK/dV partition (96 keys per CTA, 48 per
consumer warpgroup) with the dQ staging of its own (DqPath.BULK_STAGED), V, dO and dV^T 128 columns
wide, and a second dO stage in the room they free.

What the model says (rules, budgets, defaults, dispatch, explain, the committed set), what the
generated module holds (and that hd192's modules render as before), and, compiled for sm_90a, what
the SASS shows: the WGMMAs of S (K = 192) and dP (K = 128), dK^T (M = 192) and dV^T (M = 128), dQ
(N = 96 columns over the 96 keys), the TMA boxes of each operand's width, dK and dV stored by TMA
through K's and V's bytes, one bulk reduce-add of dQ, the consumers within their 240 registers and
no spill. Correctness on hardware: tests/gpu/test_bwd_sm90_dv_gpu.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cpu_support import compile_in_child

from cutefa import codegen, sass
from cutefa.api import attention, backward
from cutefa.model import committed, rules
from cutefa.model.budgets import bwd_dq_accum_shape
from cutefa.model.budgets_sm90 import (
    SM90_CONSUMER_REGS,
    SM90_SMEM_LIMIT,
    sm90_bwd_dkv_accum_shape,
    sm90_bwd_registers,
    sm90_bwd_smem_bytes,
    sm90_bwd_swap_do_stages,
    sm90_bwd_swapped,
)
from cutefa.model.defaults import SEPARATE_V_BWD_FAMILIES, default_spec
from cutefa.model.options import DqPath, Mask
from cutefa.model.spec import Features, VariantSpec

D, DV = 192, 128
# the committed variants: both dtypes, causal and not
SPECS = [
    default_spec("sm90", "bwd", dt, D, causal=c, head_dim_v=DV)
    for dt in ("bf16", "fp16")
    for c in (False, True)
]
# compiled: bf16 both masks, fp16 causal (fp16 and bf16 differ only in the operand type)
CHECKED = [s for s in SPECS if s.dtype == "bf16" or s.causal]


def test_the_default_is_the_swapped_tile_with_its_own_dq_staging():
    for spec in SPECS:
        assert (
            spec.name
            == f"cutefa_sm90_bwd_{spec.dtype}_hd192v128_64x96_s2_w12{'_causal' if spec.causal else ''}_dqbulk_dqs"
        )
        assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == (64, 96, 2, 12)
        assert spec.options.dq_path is DqPath.BULK_STAGED and sm90_bwd_swapped(spec)
        assert rules.why_invalid(spec) is None and rules.why_not_on(spec, "sm_90a") is None
        assert codegen.template_name(spec) == "bwd_sm90_swapkv.py.j2"
        # hd192's tile and options, v of its own head dim
        assert spec.replace(head_dim_v=D) == default_spec("sm90", "bwd", spec.dtype, D, causal=spec.causal)
    assert (
        set(SPECS)
        == set(committed.separate_v_bwd_specs("sm90"))
        <= set(committed.default_variants("sm90", "bwd"))
    )
    assert SEPARATE_V_BWD_FAMILIES == ("sm90", "sm80")


def test_budgets_the_model_counts():
    """Shared memory: K 36 KiB, V 24, the Q ring 48 (2 stages), dO 32 (2 stages: the room the 128-wide
    V and dO free), P 12, dS 12, the fp32 dQ staging 48, the rows and mbarriers, 1 KiB static: 215 KiB.
    Registers: fp32 dK^T (192 x 48) and dV^T (128 x 48), 120 a thread, beside S and dP: 208."""
    spec = SPECS[0]
    assert sm90_bwd_swap_do_stages(spec) == 2
    assert sm90_bwd_smem_bytes(spec) == 220160 <= SM90_SMEM_LIMIT
    assert sm90_bwd_registers(spec) == 208 <= SM90_CONSUMER_REGS
    # hd192 keeps one dO stage (a second would need 243 KiB) and its bytes
    hd192 = spec.replace(head_dim_v=D)
    assert sm90_bwd_swap_do_stages(hd192) == 1 and sm90_bwd_smem_bytes(hd192) == 223232 + 1024
    assert sm90_bwd_registers(hd192) == 232
    # a three-stage Q ring fits with one dO stage
    assert sm90_bwd_swap_do_stages(spec.replace(stages=3)) == 1
    # workspaces: dQ over 192 columns; per key block dK's chunk (96 x 192) then dV's (96 x 128)
    assert bwd_dq_accum_shape(spec, 1, 2, 100, 3) == (1, 2, 3, 2, 64 * D)
    assert sm90_bwd_dkv_accum_shape(spec, 2, 3, 200, 4) == (2, 3, 4, 3, 96 * (D + DV))
    assert sm90_bwd_dkv_accum_shape(hd192, 2, 3, 200, 4) == (2, 3, 4, 3, 2 * 96 * D)


def test_other_partitions_and_dq_paths_refuse_the_pair_naming_the_supported_one():
    spec = SPECS[1]
    for other in (
        spec.replace(dq_path=DqPath.BULK),  # would stage a 24 KiB dQ piece in dO's 16 KiB tile
        spec.replace(dq_path=DqPath.RED),
        spec.replace(tile_n=128, dq_path=DqPath.BULK),  # dK + dV of 64 keys: an estimate of 264 registers
        spec.replace(tile_n=64, dq_path=DqPath.BULK),  # the head-dim split
        spec.replace(tile_n=128, tile_m=80, dq_path=DqPath.BULK),
    ):
        why = rules.why_invalid(other)
        assert why is not None and "head_dim_v=128 with head_dim=192" in why, (other.name, why)
        assert "swapped-dK/dV partition (tile_n=96, tile_m=64) with dq_path=BULK_STAGED only" in why, why
    # the swapped template takes no feature axes: a packed batch or a window runs the sm80 backward
    for featured in (spec.replace(features=Features(varlen=True)), spec.replace(mask=Mask.LOCAL)):
        assert "take no window, packed batch, softcap or ALiBi" in rules.why_invalid(featured)
    # the sm100 backward takes one head dim, with a sentence naming what is supported
    sm100 = VariantSpec("sm100", "bwd", "bf16", D, 128, 128, 1, 4, head_dim_v=DV)
    assert "(the pairs also on the 16-bit sm90 backward)" in rules.why_invalid(sm100)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dispatch_takes_it_on_hopper_and_the_sm80_one_elsewhere(dtype, causal):
    from cutefa.api import feature_bwd
    from cutefa.api.features import FeatureArgs

    token = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    want = default_spec("sm90", "bwd", token, D, causal=causal, head_dim_v=DV)
    for seqlen_k in (None, 8192):
        assert backward.choose_bwd("sm_90a", dtype, D, causal, seqlen_k=seqlen_k, head_dim_v=DV) == want
    for target in ("sm_80", "sm_100a"):
        got = backward.choose_bwd(target, dtype, D, causal, head_dim_v=DV)
        assert got == default_spec("sm80", "bwd", token, D, causal=causal, head_dim_v=DV), got.name
    # a packed batch on Hopper: the sm80 backward, the sm90 one's reason recorded
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    f = FeatureArgs(
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        seqused_q=cu[1:],
        seqused_k=cu[1:],
        max_seqlen_q=200,
        max_seqlen_k=200,
    )
    packed = feature_bwd.choose_bwd("sm_90a", dtype, D, causal, f, seqlen_k=2048, head_dim_v=DV)
    assert packed.arch == "sm80" and packed.features.varlen and packed.head_dim_v == DV, packed.name


def test_explain_names_the_sm90_backward(capsys):
    from cutefa import cli

    assert cli.main(["explain", "--shape", "2,8192,8192,10,10,192:128", "--gpu", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "  backward: cutefa_sm90_bwd_bf16_hd192v128_64x96_s2_w12_dqbulk_dqs (family sm90)" in out
    assert cli.main(["explain", "--shape", "2,8192,8192,10,10,192:128", "--gpu", "sm_90a", "--causal"]) == 0
    assert (
        "  backward: cutefa_sm90_bwd_bf16_hd192v128_64x96_s2_w12_causal_dqbulk_dqs (family sm90)"
        in capsys.readouterr().out
    )
    q = torch.empty(2, 4096, 16, D, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 4096, 16, DV, device="meta", dtype=torch.bfloat16)
    text = attention.explain(q, q, v, target="sm_86")
    assert "  backward: none (cutefa_sm80_bwd_bf16_hd192v128_" in text and "99 KiB" in text


def test_the_module_computes_v_on_its_own_head_dim_and_hd192_renders_as_before():
    source = codegen.render_source(SPECS[1])
    assert "HEAD_DIM = 192\nHEAD_DIM_V = 128  #" in source
    for line in (
        # V and dO: the swapped layouts at 128 columns, dO with two stages
        "sV_layout, sVt_layout, sdO_layout, sdOt_layout, _, _ = bwd_swap.swap_smem_layouts(\n            DTYPE, TILE_M, TILE_N, HEAD_DIM_V, 2\n        )",
        "v_tma, gV_tma = parts.tma_load_atom(parts.bshd_as_sdhb(mV), sV_layout, (TILE_N, HEAD_DIM_V))",
        "do_tma, gdO_tma = parts.tma_load_atom(parts.bshd_as_sdhb(mdO), sdO_layout, (TILE_M, HEAD_DIM_V))",
        "dv_tma, gdV_tma = parts.tma_store_atom(parts.bshd_as_sdhb(mdV), sV_layout, (TILE_N, HEAD_DIM_V))",
        "do_bar: cute.struct.MemRange[cutlass.Int64, 4]",
        "barrier_storage=storage.do_bar.data_ptr(), num_stages=2, producer_group=producer,",
        "tx_count=TILE_N * (HEAD_DIM + HEAD_DIM_V) * DTYPE.width // 8",
        "acc_dV = cute.make_rmem_tensor(dkv_thr.partition_shape_C((HEAD_DIM_V, KEYS_WG)), Float32)",
        "cute.local_tile(sV[None, None, 0], (KEYS_WG, HEAD_DIM_V), (c, 0))",
        "sVt = bwd_parts.same_bytes(sV, sVt_layout)",
        # D = rowsum(dO * O) over 128 columns; dq_accum zeroed over 192
        "first, lane, ROWS_PER_WARP, HEAD_DIM_V)",
        "bwd_pre_post.zero_bulk_part(mdQaccum, batch, head, bx, tidx, ROWS_PER_CTA, TILE_M, HEAD_DIM, ROW_WARPS * 32)",
        # grouped-query heads: dV's chunk after dK's, its own pieces
        "bwd_dkv.zero_chunk(mdKVaccum, batch, kv, n_block, tidx, DKV_CHUNK + DKV_CHUNK_V, parts.WG_THREADS)",
        "bwd_dkv.red_add_piece(acc_dV, g_dkv + (DKV_CHUNK + c * DKV_PIECE_V), wtid)",
        "bwd_dkv.store_tile(sTile, mdV, batch, kv, n_block, tidx, TILE_N, HEAD_DIM_V, parts.WG_THREADS)",
        # the compile's sample arguments: v, o, do and dv of head_dim_v
        "v, dv = (bshd(seqlen_k, heads_kv, spec.head_dim_v) for _ in range(2))",
        "do, o = (bshd(seqlen_q, heads_q, spec.head_dim_v) for _ in range(2))",
    ):
        assert line in source, line
    plain = codegen.render_source(default_spec("sm90", "bwd", "bf16", D, causal=True))
    assert "HEAD_DIM_V" not in plain and "DKV_CHUNK_V" not in plain and "sVt_layout" not in plain
    assert "num_stages=1, producer_group=producer," in plain  # hd192: one dO stage
    # the committed hd192 modules are the generated ones (cutefa generate --check)
    for spec in committed.default_variants("sm90", "bwd"):
        if sm90_bwd_swapped(spec):
            assert codegen.render_source(spec) == codegen.module_path(spec).read_text(), spec.name


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("bwd_dv_sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_sm90a(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    text = sass.disassemble(cubins[spec.name])
    for op in ("HGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "MUFU.EX2", "STSM"):
        assert report.counts.get(op, 0) > 0, f"{spec.name}: no {op}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == [24, 240], regions
    assert all(used < budget for budget, used in regions), regions
    keys, m = spec.tile_n // 2, spec.tile_m
    shapes: dict[str, int] = {}
    for shape in re.findall(r"\bHGMMA\.(\d+x\d+)x16\b", text):
        shapes[shape] = shapes.get(shape, 0) + 1
    # per query block: S (K = 192: 12 k-steps), dP (K = 128: 8), dK^T (3 M-atoms x 4 k-steps), dV^T
    # (2 M-atoms x 4), all 64 x 48; dQ 64 x 96 over the 96 keys (6 k-steps)
    assert shapes == {
        f"64x{keys}": D // 16 + DV // 16 + (D // 64 + DV // 64) * (m // 16),
        "64x96": 96 // 16,
    }, shapes
    # dK^T and dV^T read both operands transposed from shared memory
    both = re.findall(r"\bHGMMA\.64x\d+x16\S*\s+R\d+,\s*gdesc\[\w+\]\.tnspA\.tnspB", text)
    assert len(both) == (D // 64 + DV // 64) * (m // 16), len(both)
    # TMA boxes: K and Q by 32-column panels of the 64-byte swizzle (half of 192 is 96: 192 bytes),
    # V and dO by 64-column panels of the 128-byte swizzle (half of 128 is 64)
    assert report.counts["UTMALDG"] == 2 * D // 32 + 2 * DV // 64, report.summary()
    assert len(re.findall(r"\bUTMASTG\b", text)) == D // 32 + DV // 64, report.summary()
    # P and dS (64 x 48 per warpgroup) by stmatrix, dK^T and dV^T by transposed stmatrix into K's and
    # V's bytes: 16 x 16 per warp instruction
    transposed = len(re.findall(r"\bSTSM\.16\.MT88\.4\b", text))
    assert transposed == (D // 64 + DV // 64) * (keys // 16), report.summary()
    assert report.counts["STSM"] == 2 * keys // 16 + transposed, report.summary()
    # dQ: one bulk reduce-add per consumer and query block, 16-byte staging stores, no element RED
    assert len(re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32\b", text)) == 1
    assert not re.findall(r"\bREDG?\.E\.ADD\.F32x2\b", text)
    # WGMMAs stay asynchronous: S/dP, dP, dV^T, dQ, dK^T waits per query block
    assert len(re.findall(r"WARPGROUP\.DEPBAR", text)) <= 5, report.summary()
    # grouped-query dK/dV: 16-byte vector reductions of dK^T (192 x 48) and dV^T (128 x 48)
    main = sass.kernel_text(text, "kernel")
    quads = len(re.findall(r"\bREDG?\.E\.ADD\.F32x4\S*\b", main))
    assert quads == (D + DV) * keys // 128 // 4, quads
    print(f"{spec.name}: consumer registers {regions[1][1]}, {report.summary()}")


def v_and_do_offsets() -> dict:
    """The offsets of every element of V and dO of (192, 128)'s tiles through both layouts of each
    (traced with the DSL: run in a child process that compiles for sm_90a)."""
    import cutlass
    import cutlass.cute as cute

    from cutefa.kernels.sm90 import bwd_swap

    result = {}

    @cute.jit
    def offsets():
        tm, tn, dv, st = 64, 96, 128, 2
        sv, svt, sdo, sdot, _, _ = bwd_swap.swap_smem_layouts(cutlass.BFloat16, tm, tn, dv, st)
        result["v"] = [sv((r, c, 0)) for r in range(tn) for c in range(dv)]
        result["vt"] = [svt((c, r, 0)) for r in range(tn) for c in range(dv)]
        result["do"] = [sdo((r, c, s)) for s in range(st) for r in range(tm) for c in range(dv)]
        result["dot"] = [sdot((c, r, s)) for s in range(st) for r in range(tm) for c in range(dv)]
        result["swizzle"] = str(sv.inner)

    offsets()
    return result


@pytest.mark.compile  # traces layouts with the DSL in a child process
def test_v_and_do_layouts_share_bytes_in_both_roles(tmp_path):
    """V's K-major layout (B of dP) and MN-major one (dV's stmatrix target, the same bytes), dO's
    K-major (A of dP) and MN-major (A of dV^T) ones map every element of the 128-column tiles to the
    same offset, each stage one contiguous block, with the 128-byte swizzle (64 columns)."""
    child = (
        'import json, sys; sys.path.insert(0, "{tests}"); import test_compile_sm90_bwd_dv as t; '
        "print(json.dumps(t.v_and_do_offsets()))"
    )
    got = compile_in_child(tmp_path, "sm_90a", child, Path(__file__).resolve().parent)
    tm, tn, dv = 64, 96, DV
    assert got["v"] == got["vt"] and got["do"] == got["dot"]
    assert sorted(got["v"]) == list(range(tn * dv))
    assert sorted(got["do"]) == list(range(2 * tm * dv))
    assert max(got["do"][: tm * dv]) == tm * dv - 1  # stage 0 is the first half
    assert got["swizzle"] == "S<3,4,3>"
