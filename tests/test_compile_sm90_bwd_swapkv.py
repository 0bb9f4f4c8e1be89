"""sm90 backward at head dim 192 with dK/dV on WGMMA's M axis (templates/bwd_sm90_swapkv.py.j2) on
this CPU: 96 keys per CTA, 48 per consumer warpgroup. The variants (tools/alternatives.py
SM90_BWD_ALTERNATIVES, bf16,
per-thread dQ reductions and the bulk dQ path) and one fp16 twin compile for sm_90a and their SASS shows the
design: WGMMA (HGMMA) 64x48 for S, dP (K = head_dim) and for dV^T, dK^T (M = head_dim in 64-row
atoms, K = the 64 queries, both operands transposed in shared memory), 64x96 for dQ (K = the 96
keys), TMA loads, setmaxnreg with the consumers within their 240 registers, dQ into dq_accum by
8-byte fp32 vector reductions or (DqPath.BULK) 16-byte shared stores into the Q/dO stage and one bulk
reduce-add whose read of the stage is waited for one query block later, under S and dP (BULK_STAGED:
FlashAttention-4's shared-memory budget, a staging buffer of its own, the piece staged and added
while dK^T runs, one named barrier fewer per query block) (either bulk path:
dK/dV out through K's and V's shared memory with transposed stmatrix and TMA stores), WGMMAs left
asynchronous and no local-memory spills. The shared-memory layouts that read one buffer in two
roles address the same bytes, with each consumer's part on a swizzle-atom edge.

One cubin holds the preprocess, main and postprocess kernels; counts are summed over the three.
Correctness on hardware: tests/gpu/test_bwd_sm90.py and tests/gpu/test_bwd_sm90_swapkv.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_support import all_variants, assert_not_an_option

from cutefa import codegen, sass
from cutefa.model.budgets import bwd_dq_accum_shape
from cutefa.model.budgets_sm90 import (
    SM90_CONSUMER_REGS,
    SM90_SMEM_LIMIT,
    sm90_bwd_dq_pieces,
    sm90_bwd_head_split,
    sm90_bwd_registers,
    sm90_bwd_smem_bytes,
    sm90_bwd_swapped,
)
from cutefa.model.options import DqPath
from cutefa.model.rules import why_invalid
from cutefa.model.spec import VariantSpec

# (head dim 192 itself: the (192, 128) pair on this partition, tests/test_compile_sm90_bwd_dv.py)
COMMITTED = [s for s in all_variants("sm90", "bwd") if sm90_bwd_swapped(s) and s.head_dim_v == s.head_dim]
# the committed bf16 causal variant, the fp16 non-causal twin (fp16 and bf16 differ only in the
# operand type) and the bf16 bulk-path variants
CHECKED = [s for s in COMMITTED if s.causal and s.options.dq_path is DqPath.RED]
CHECKED += [s.replace(dtype="fp16") for s in COMMITTED if not s.causal and s.options.dq_path is DqPath.RED]
# non-causal and causal (its own launch order), DqPath.BULK and BULK_STAGED
CHECKED += [s for s in COMMITTED if s.options.dq_path is not DqPath.RED]


def test_swapped_variants_committed_and_the_staged_one_dispatched():
    """64 x 96, 2 stages, 12 warps, causal and not, rendered by their own template: bf16 with per-thread
    dQ reductions, the bulk path in the Q/dO stage, and the bulk path on FlashAttention-4's budget
    (DqPath.BULK_STAGED), the
    last also in fp16: it is head dim 192's default, which dispatch picks without a tuned entry."""
    import torch

    from cutefa.api import backward

    assert sorted(s.name for s in COMMITTED) == [
        "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12",
        "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_causal",
        "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_causal_dqbulk",
        "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_causal_dqbulk_dqs",
        "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_dqbulk",
        "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_dqbulk_dqs",
        "cutefa_sm90_bwd_fp16_hd192_64x96_s2_w12_causal_dqbulk_dqs",
        "cutefa_sm90_bwd_fp16_hd192_64x96_s2_w12_dqbulk_dqs",
    ]
    for spec in COMMITTED + CHECKED:
        assert why_invalid(spec) is None, spec.name
        assert codegen.template_name(spec) == "bwd_sm90_swapkv.py.j2"
        assert not sm90_bwd_head_split(spec)
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            chosen = backward.choose_bwd("sm_90a", dtype, 192, causal)
            assert sm90_bwd_swapped(chosen) and chosen.options.dq_path is DqPath.BULK_STAGED, chosen.name


def test_swapped_validity():
    """Only head dim 192, 64 query rows per step, a ring that fits beside K, V, P and dS, no overlap
    schedule; the bulk path stages dQ in the Q/dO stage (no extra shared memory): each refusal names its
    reason."""
    base = VariantSpec("sm90", "bwd", "bf16", 192, 64, 96, 2, 12)
    assert why_invalid(base) is None
    # K, V 72 KiB, the Q/dO ring 96 KiB, one P and two dS buffers 36 KiB, rows, mbarriers, 1 KiB static
    assert sm90_bwd_smem_bytes(base) == 211968 <= SM90_SMEM_LIMIT
    assert sm90_bwd_registers(base) <= SM90_CONSUMER_REGS
    assert "shared memory" in why_invalid(base.replace(stages=3))
    assert "64 query rows" in why_invalid(base.replace(tile_m=128))
    assert why_invalid(base.replace(dq_path=DqPath.BULK)) is None
    assert sm90_bwd_smem_bytes(base.replace(dq_path=DqPath.BULK)) == sm90_bwd_smem_bytes(base)
    assert "overlap" in why_invalid(base.replace(overlap=True))
    assert "tile_n=96" in why_invalid(base.replace(head_dim=256))
    assert "tile_n=96" in why_invalid(base.replace(head_dim=128))
    assert sm90_bwd_dq_pieces(base) == ((0, 0, 96), (0, 96, 96))


def test_dq_stage_validity():
    """DqPath.BULK_STAGED (name tokens _dqbulk_dqs): FlashAttention-4's shared-memory budget for the
    swapped tile only: K, V 72 KiB, Q 48 (2 stages), dO 24 (1 stage), P 12, dS 12, the fp32 dQ staging 48,
    rows and mbarriers (a 223,232-byte struct), 1 KiB static: 219 KiB of the 227."""
    spec = VariantSpec("sm90", "bwd", "bf16", 192, 64, 96, 2, 12, dq_path=DqPath.BULK_STAGED)
    assert spec.name == "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_dqbulk_dqs"
    assert why_invalid(spec) is None
    assert sm90_bwd_smem_bytes(spec) == 223232 + 1024 <= SM90_SMEM_LIMIT
    assert bwd_dq_accum_shape(spec, 1, 2, 100, 3) == (1, 2, 3, 2, 64 * 192)  # the bulk path's chunks
    assert "shared memory" in why_invalid(spec.replace(stages=3))
    for other in (
        spec.replace(tile_n=64),  # the head-dim split
        spec.replace(head_dim=128, tile_n=128),
        spec.replace(head_dim=128, tile_n=128, tile_m=80),
    ):
        assert "swapped-dK/dV" in why_invalid(other), other.name
    assert_not_an_option("sm80", "bwd", "bf16", dq_path=DqPath.BULK_STAGED)
    assert_not_an_option("sm90", "fwd", "bf16", dq_path=DqPath.BULK_STAGED)


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("bwd_swapkv_sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_sm90a_bwd_swapkv(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    for op in ("HGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "MUFU.EX2", "STSM"):
        assert report.counts.get(op, 0) > 0, f"{spec.name}: no {op}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    d, keys = spec.head_dim, spec.tile_n // 2
    text = sass.disassemble(cubins[spec.name])
    shapes: dict[str, int] = {}
    for shape in re.findall(r"\bHGMMA\.(\d+x\d+)x16\b", text):
        shapes[shape] = shapes.get(shape, 0) + 1
    # one code path per query block: S and dP (d/16 k-steps each), dV^T and dK^T (d/64 M-atoms x
    # tile_m/16 k-steps each), dQ (tile_n/16 k-steps, N = d/2)
    assert shapes == {
        f"64x{keys}": 2 * d // 16 + 2 * (d // 64) * (spec.tile_m // 16),
        f"64x{d // 2}": spec.tile_n // 16,
    }, f"{spec.name}: {shapes}"
    # dV^T, dK^T read both operands transposed (MN-major) from shared memory; dQ its B only
    assert len(re.findall(r"\bHGMMA\.64x\d+x16\S*\s+R\d+,\s*gdesc\[\w+\]\.tnspA\.tnspB", text)) == 2 * (d // 64) * (
        spec.tile_m // 16
    )
    assert not re.findall(r"\bHGMMA\.\S+\s+R\d+,\s*R\d+,\s*gdesc", text)  # no register A operand
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == [24, 240], regions
    assert all(used < budget for budget, used in regions), regions
    reductions = re.findall(r"\bREDG?\.E\.ADD\.F32x2\b", text)
    bulk = re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32\b", text)
    path = spec.options.dq_path
    if path is not DqPath.RED:
        # the 64 x d/2 fp32 piece: 16-byte shared stores in fragment order, one bulk reduce-add
        assert not reductions and len(bulk) == 1, f"{spec.name}: {len(reductions)} REDs, {len(bulk)} bulk"
        assert len(re.findall(r"\bSTS\.128\b", text)) == 64 * (d // 2) // 128 // 4, report.summary()
        loop = text[text.index("HGMMA.") :]
        if path is DqPath.BULK_STAGED:
            # FlashAttention-4's budget: the previous bulk copy's read of this consumer's own staging
            # buffer is waited for before dQ is issued; dO's stage goes back between dQ and dK^T
            # (dV^T done); the piece is staged and bulk-added while dK^T runs (after its last HGMMA,
            # before the wait for every WGMMA); four named barriers per query block (P, dS twice,
            # the staging), one fewer than in-stage staging
            dq_first = loop.index(f"HGMMA.64x{d // 2}x16")
            dk_last = loop.rindex(".tnspA.tnspB")
            wait_all = loop.index("WARPGROUP.DEPBAR.LE gsb0, 0x0")
            red = loop.index("UBLKRED")
            assert dk_last < red < wait_all, f"{spec.name}: bulk reduce-add not under dK^T"
            assert re.search(r"DEPBAR\.LE SB0, 0x0", loop[:dq_first]), f"{spec.name}: no bulk wait before dQ"
            release = r"SYNCS\.ARRIVE\.TRANS64\S*\s+RZ, \["
            assert re.search(release, loop[dq_first:dk_last]), f"{spec.name}: dO not released between dQ and dK^T"
            assert len(re.findall(r"\bBAR\.SYNC", loop[:red])) == 4, f"{spec.name}: barriers per query block"
            assert len(re.findall(r"\bDEPBAR\.LE SB0, 0x0", loop)) >= 2
        else:
            _check_in_stage_release(spec, loop)
    else:
        # 8-byte reductions, one per two columns of 64 rows x d/2 per thread, unguarded and guarded paths
        assert len(reductions) == 2 * (64 * (d // 2) // 128 // 2) and not bulk, f"{spec.name}: {len(reductions)} REDs"
    # K, V, Q, dO: one TMA box per 32-column panel of the 64-byte swizzle
    assert report.counts["UTMALDG"] == 4 * d // 32, report.summary()
    # WGMMAs stay asynchronous: S/dP, dV, dQ (twice) waits per query block; BULK_STAGED: S/dP, dP,
    # dV^T, dQ, dK^T
    waits = re.findall(r"WARPGROUP\.DEPBAR", text)
    limit = 5 if path is DqPath.BULK_STAGED else 4
    assert len(waits) <= limit, f"{spec.name}: {len(waits)} WGMMA waits (serialized?)"
    # P and dS stored with stmatrix: 64 x 48 each per warpgroup, 16 x 16 per warp instruction
    stsm = 2 * keys // 16
    if path is not DqPath.RED:
        # dK^T and dV^T (d x 48 per warpgroup) with transposed stmatrix into K's and V's bytes, 16 x 16
        # per warp instruction; then one TMA store per 32-column panel of each; no 2-byte stores
        stsm += 2 * (d // 64) * (keys // 16)
        transposed = len(re.findall(r"\bSTSM\.16\.MT88\.4\b", text))
        assert transposed == 2 * (d // 64) * (keys // 16), report.summary()
        assert len(re.findall(r"\bUTMASTG\b", text)) == 2 * d // 32, report.summary()
        assert not re.findall(r"\bSTG\.E\.U16\b", text), f"{spec.name}: 2-byte global stores left"
    else:
        assert not re.findall(r"\bUTMASTG\b", text)
    assert report.counts["STSM"] == stsm, report.summary()


def _check_in_stage_release(spec, loop: str) -> None:
    """DqPath.BULK, staged in the Q/dO stage: the stage of the previous query block goes back once its
    bulk copy has read it, waited for after the next block's S and dP WGMMAs are issued and before S
    is waited on (not ahead of them), and once more after the query loop."""
    first_wait = loop.index("WARPGROUP.DEPBAR")
    assert re.search(r"DEPBAR\.LE SB0, 0x0", loop[:first_wait]), f"{spec.name}: no bulk wait under S/dP"
    release = r"SYNCS\.ARRIVE\.TRANS64\S*\s+RZ, \[R\d+\+URZ\+0x\w+\]"
    assert re.search(release, loop[:first_wait]), f"{spec.name}: no stage release under S/dP"
    waits = len(re.findall(r"\bDEPBAR\.LE SB0, 0x0", loop))
    assert waits >= 4, f"{spec.name}: {waits} bulk waits (read and full, in and after the loop)"


_LAYOUT_CHECK = """
import json
import cutlass, cutlass.cute as cute
from cutefa.kernels.sm90 import bwd_swap

result = {}

@cute.jit
def offsets():
    tm, tn, d, st = 64, 96, 192, 2
    sk, skt, sq, sqt, sp, spt = bwd_swap.swap_smem_layouts(cutlass.BFloat16, tm, tn, d, st)
    result["k"] = [sk((r, c, 0)) for r in range(tn) for c in range(d)]
    result["kt"] = [skt((c, r, 0)) for r in range(tn) for c in range(d)]
    result["q"] = [sq((r, c, s)) for s in range(st) for r in range(tm) for c in range(d)]
    result["qt"] = [sqt((c, r, s)) for s in range(st) for r in range(tm) for c in range(d)]
    result["p"] = [sp((r, c, s)) for s in range(2) for r in range(tm) for c in range(tn)]
    result["pt"] = [spt((c, r, s)) for s in range(2) for r in range(tm) for c in range(tn)]
    result["swizzle"] = [str(sk.inner), str(sp.inner)]

offsets()
print(json.dumps(result))
"""


@pytest.mark.compile  # traces layouts with the DSL in a child process
def test_swap_two_role_layouts_share_bytes(tmp_path):
    """K's K-major (B of S) and MN-major (B of dQ) layouts, Q/dO's K-major (A of S, dP) and MN-major
    (A of dK^T, dV^T) ones, and P/dS's K-major (A of dQ) and MN-major (B of dK^T, dV^T) ones map every
    element to the same offset; consumer 1's dQ columns of K^T and its keys of P/dS start on atom
    panels, and a P/dS buffer is one contiguous half (the P buffer is allocated alone)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)}
    script = tmp_path / "layouts.py"  # a file: the DSL reads the traced function's source
    script.write_text(_LAYOUT_CHECK)
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=False, cwd=root
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    d, tn, tm = 192, 96, 64
    assert got["k"] == got["kt"] and got["q"] == got["qt"] and got["p"] == got["pt"]
    assert sorted(got["k"]) == list(range(tn * d))
    assert sorted(got["q"]) == list(range(2 * tm * d))
    assert sorted(got["p"]) == list(range(2 * tm * tn))
    assert max(got["p"][: tm * tn]) == tm * tn - 1  # buffer 0 is the first half
    # 64-byte swizzle (32 head-dim columns) on K, Q, dO; 32-byte (16 keys) on P and dS
    assert got["swizzle"] == ["S<2,4,3>", "S<1,4,3>"]
    col = [got["kt"][r * d + d // 2] for r in range(tn)]
    col0 = [got["kt"][r * d] for r in range(tn)]
    assert {a - b for a, b in zip(col, col0)} == {(d // 2) * tn}
    key = [got["p"][r * tn + tn // 2] for r in range(tm)]
    key0 = [got["p"][r * tn] for r in range(tm)]
    assert {a - b for a, b in zip(key, key0)} == {(tn // 2) * tm}


_DKV_STORE_CHECK = """
import cutlass, cutlass.cute as cute
from cutefa.kernels.sm90 import bwd_swap

pairs = []

@cute.jit
def check():
    mma = bwd_swap.swap_dkv_tiled_mma(cutlass.BFloat16, 48)
    r2s = cute.make_tiled_copy_C(bwd_swap.dkv_store_atom(cutlass.BFloat16), mma)
    ident = cute.make_identity_tensor((192, 48))
    for t in cutlass.range_constexpr(128):
        held = r2s.get_slice(t).retile(mma.get_slice(t).partition_C(ident))
        wanted = r2s.get_slice(t).partition_S(ident)
        for i in cutlass.range_constexpr(cute.size(wanted)):
            pairs.append((held[i][0], held[i][1], wanted[i][0], wanted[i][1]))

check()
bad = sum(1 for p in pairs if p[:2] != p[2:])
print(len(pairs), bad, len({p[2:] for p in pairs}))
"""


@pytest.mark.compile  # traces layouts with the DSL in a child process
def test_swap_dkv_store_fragment_order(tmp_path):
    """The bulk paths' dK/dV epilogue: the transposed stmatrix copy built on the dK^T/dV^T tiled MMA takes
    every (head-dim row, key) of a warpgroup's 192 x 48 accumulator exactly once, each register
    holding the coordinate the copy expects there."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)}
    script = tmp_path / "dkv_store.py"
    script.write_text(_DKV_STORE_CHECK)
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=False, cwd=root
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    total, bad, distinct = map(int, proc.stdout.strip().splitlines()[-1].split())
    assert (total, bad, distinct) == (192 * 48, 0, 192 * 48)



_HEAVY_FIRST_CHECK = """
import cutlass, cutlass.cute as cute
from cutlass import Int32
from cutefa.kernels.sm80 import bwd_parts

cases = []


def _int(v):
    # a folded constant: repr is Int32(k); anything else (not folded) fails here
    return int(repr(v).removeprefix("Int32(").removesuffix(")"))


@cute.jit
def check(n_blocks: cutlass.Constexpr, heads: cutlass.Constexpr, batches: cutlass.Constexpr,
          wave: cutlass.Constexpr):
    got = []
    for b in cutlass.range_constexpr(batches):
        for h in cutlass.range_constexpr(heads):
            for x in cutlass.range_constexpr(n_blocks):
                grid = (Int32(n_blocks), Int32(heads), Int32(batches))
                n, hh, bb = bwd_parts.heavy_first(Int32(x), Int32(h), Int32(b), *grid, wave)
                got.append((_int(n), _int(hh), _int(bb)))
    cases.append(((n_blocks, heads, batches, wave), got))

for shape in ((5, 3, 2, 11), (22, 4, 2, 132), (21, 5, 2, 132), (3, 6, 2, 132), (43, 1, 1, 132),
              (200, 3, 1, 132)):
    check(*shape)
print(repr(cases))
"""


@pytest.mark.compile  # traces the DSL function in a child process (constants fold)
def test_swap_causal_heavy_first_order(tmp_path):
    """The causal bulk path's launch order maps the grid's (bx, head, batch), in launch order (bx
    fastest), onto every (key block, head, batch) exactly once; within each chunk of
    max(wave // n_blocks, 1) (batch, head) pairs the key blocks never go down (longest CTAs first)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)}
    script = tmp_path / "heavy_first.py"
    script.write_text(_HEAVY_FIRST_CHECK)
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=False, cwd=root
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    cases = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert len(cases) == 6
    for (n_blocks, heads, batches, wave), got in cases:
        # every (key block, head, batch) exactly once
        every = [(n, h, b) for n in range(n_blocks) for h in range(heads) for b in range(batches)]
        assert sorted(got) == every, (n_blocks, heads, batches)
        g = max(wave // n_blocks, 1)
        chunk = g * n_blocks
        for start in range(0, len(got), chunk):
            blocks = [n for n, _, _ in got[start : start + chunk]]
            assert blocks == sorted(blocks), (n_blocks, heads, batches, start)
            assert blocks[0] == 0 and blocks[-1] == n_blocks - 1
