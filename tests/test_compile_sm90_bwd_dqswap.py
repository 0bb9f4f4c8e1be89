"""The sm90 backward's tile_m=80 tile with dQ transposed (FlashAttention-4's non-causal hd128 tile) on
this CPU.

80 query rows per step are not a multiple of WGMMA's 64-row M, so each consumer warpgroup computes
dQ^T = K^T dS^T for its 64 head-dim columns of all 80 rows (M = 64 columns, N = 80 queries, K = the
128 keys) and adds that transposed piece by the bulk path (DqPath.BULK; budgets_sm90.sm90_bwd_dq_swapped).
Checked here: the predicate admits it at head dim 128 with the bulk path, 2 stages and the default
schedule only,
counts its shared memory exactly (the opt-in limit, as FlashAttention-4's budget for this tile) and
its registers; it is a bf16 alternative (both masks) that dispatch does not pick; both masks compile
for sm_90a with S^T, dP^T and dQ^T as 64x80 HGMMAs, dV/dK over K = 80, six WGMMA waits (none
serialized), one bulk reduce-add per consumer path and no spill; the pre/postprocess move 16-byte
vectors; the transposed fragment order maps a query block's chunk one-to-one onto its 80 x 128
elements.

Correctness on hardware: tests/gpu/test_bwd_sm90.py (every committed variant, ragged lengths, GQA,
the NaN-poisoned workspace, deterministic runs against the default twin).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_support import all_variants, assert_sm90_bwd_stores

from cutefa import sass
from cutefa.model.budgets import bwd_dq_accum_shape
from cutefa.model.budgets_sm90 import (
    SM90_CONSUMER_REGS,
    SM90_SMEM_LIMIT,
    sm90_bwd_dq_pieces,
    sm90_bwd_dq_swapped,
    sm90_bwd_registers,
    sm90_bwd_smem_bytes,
)
from cutefa.model.options import DqPath
from cutefa.model.rules import smem_bytes, why_invalid
from cutefa.model.spec import VariantSpec

SWAPPED = [s for s in all_variants("sm90", "bwd") if sm90_bwd_dq_swapped(s)]


def _spec(**kw) -> VariantSpec:
    base = {"head_dim": 128, "tile_m": 80, "tile_n": 128, "stages": 2, "warps": 12, "dq_path": DqPath.BULK}
    base.update(kw)
    return VariantSpec("sm90", "bwd", "bf16", **base)


def test_predicate_admits_the_tile_with_dq_bulk_only():
    spec = _spec()
    assert sm90_bwd_dq_swapped(spec) and why_invalid(spec) is None
    assert why_invalid(_spec(causal=True)) is None
    assert "dq_path=RED" in why_invalid(_spec(dq_path=DqPath.RED))
    assert "stages=3" in why_invalid(_spec(stages=3))
    assert "overlap" in why_invalid(_spec(overlap=True))
    assert "head_dim=64" in why_invalid(_spec(head_dim=64))
    assert "tile_m=96" in why_invalid(_spec(tile_m=96))
    # the other tiles keep their dQ split
    assert not sm90_bwd_dq_swapped(_spec(tile_m=64))
    assert sm90_bwd_dq_pieces(_spec(tile_m=64)) == ((0, 0, 64), (0, 64, 64))
    assert sm90_bwd_dq_pieces(spec) == ((0, 0, 64), (0, 64, 64))  # columns of all 80 rows
    # K, V 64 KiB + Q/dO ring 80 + two dS buffers 40 + dQ staging 40, a 2 KiB head, 1 KiB static
    assert sm90_bwd_smem_bytes(spec) == 232_448 == SM90_SMEM_LIMIT
    assert smem_bytes(spec) == sm90_bwd_smem_bytes(spec)
    # dK + dV 128, S^T + dP^T (64 x 80 fp32) 80, calibrated overhead: 236 (SASS: R235 non-causal)
    assert sm90_bwd_registers(spec) == 236 <= SM90_CONSUMER_REGS
    assert bwd_dq_accum_shape(spec, 1, 2, 161, 3) == (1, 2, 3, 3, 80 * 128)


def test_committed_as_bf16_alternatives_not_dispatched():
    import torch

    from cutefa.api import backward

    assert sorted((s.dtype, s.head_dim, s.causal, s.tile_m) for s in SWAPPED) == [
        ("bf16", 128, False, 80),
        ("bf16", 128, True, 80),
    ]
    assert all(s.options.dq_path is DqPath.BULK and not s.options.overlap and s.stages == 2 for s in SWAPPED)
    for causal in (False, True):
        chosen = backward.choose_bwd("sm_90a", torch.bfloat16, 128, causal)
        assert chosen.tile_m == 64 and chosen not in SWAPPED


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(SWAPPED, "sm_90a", tmp_path_factory.mktemp("bwd_dqswap_sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", SWAPPED, ids=lambda s: s.name)
def test_sass_transposed_dq(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    text = sass.disassemble(cubins[spec.name])
    for op in ("UTMALDG", "USETMAXREG", "SYNCS", "MUFU.EX2"):
        assert report.counts.get(op, 0) > 0, f"{spec.name}: no {op}: {report.summary()}"
    # S^T, dP^T (K = 128 head dim) and both consumers' dQ^T code paths (K = 128 keys): 64x80x16;
    # dV, dK (K = 80 queries): 64x128x16
    shapes = re.findall(r"\bHGMMA\.(\d+x\d+x\d+)\.", text)
    hgmma = {shape: shapes.count(shape) for shape in set(shapes)}
    assert hgmma == {"64x80x16": 2 * 8 + 2 * 8, "64x128x16": 2 * 5}, hgmma
    waits = re.findall(r"WARPGROUP\.DEPBAR", text)
    assert len(waits) <= 6, f"{spec.name}: {len(waits)} WGMMA waits (serialized?)"
    assert report.forms_of("UBLKRED") == {"UBLKRED.G.S.ADD.F32.RN": 2}, report.forms
    # per-thread reductions: only the grouped-query dK/dV sums (16-byte fp32 adds), none for dQ
    assert not [r for r in re.findall(r"\bREDG?\.\S+", text) if not r.startswith("REDG.E.ADD.F32x4")], (
        f"{spec.name}: per-thread reductions remain"
    )
    main = sass.opcode_forms(sass.kernel_text(text, "kernel"))
    assert main.get("STS.128", 0) == 2 * 10, main  # 40 values per thread and consumer path
    assert_sm90_bwd_stores(report, main, spec)  # dS^T (80 / 16), dK/dV staging (128 / 16 each), TMA
    assert not re.findall(r"\b(STL|LDL)\b", text), f"{spec.name}: local-memory spill"
    for budget, used in sass.setmaxnreg_regions(text):
        assert used <= budget, (budget, used)
    assert max(used for _, used in sass.setmaxnreg_regions(text)) >= 200  # the consumers' region


def _memory_forms(text: str, role: str) -> dict[str, int]:
    forms = sass.opcode_forms(sass.kernel_text(text, role))
    return {f: n for f, n in forms.items() if f.startswith(("LD", "ST"))}


@pytest.mark.compile
@pytest.mark.parametrize("spec", SWAPPED[:1], ids=lambda s: s.name)
def test_sass_postprocess(cubins, spec):
    """The postprocess reads 10 16-byte vectors per thread and piece, writes dQ rows by 16-byte stores
    from its 80 x 128 shared-memory tile."""
    text = sass.disassemble(cubins[spec.name])
    post = _memory_forms(text, "postprocess")
    assert post.get("LDG.E.128", 0) >= 2 * 10, post
    assert not {f for f in post if f.startswith("LDG") and f != "LDG.E.128"}, post
    assert {f: n for f, n in post.items() if f.startswith("STG")} == {"STG.E.128": 80 * 128 // 1024}, post
    assert post.get("LDS.128", 0) == 80 * 128 // 1024, post
    assert not {f for f in post if f.startswith(("LDL", "STL"))}, post


_COORDS = """
import json, sys
import cutlass, cutlass.cute as cute
from cutefa.kernels.sm90 import bwd_dq_bulk, bwd_parts

result = {}

@cute.jit
def coords(cols: cutlass.Constexpr, tile_m: cutlass.Constexpr):
    mma = bwd_parts.dq_tiled_mma(cutlass.BFloat16, tile_m)
    slices = [bwd_dq_bulk.bulk_dq_transposed_coords(mma, t, cols, tile_m) for t in range(128)]
    result["coords"] = [[[int(c[i][0]), int(c[i][1])] for i in range(cute.size(c))] for c in slices]

coords(int(sys.argv[1]), int(sys.argv[2]))
print(json.dumps(result))
"""


@pytest.mark.compile  # traces the tiled-MMA partition with the DSL in a child process
def test_transposed_chunk_order_is_a_bijection(tmp_path):
    """Word w = offset(piece) + 4 (128 j + t) + e of a query block's chunk holds value 4 j + e of
    thread t's fragment of its consumer's 64 x 80 dQ^T piece (offsets 0 and 80 * 64 words); through
    bulk_dq_transposed_coords (the accumulator's partition: thread t of warp w holds head-dim columns
    16 w + (t % 32) / 4 (+ 8) and queries 8 k + 2 (t % 4) (+ 1)) every word lands on its own element
    of the 80 x 128 block, and every element is covered."""
    from cutefa.kernels.sm90.bwd_dq_bulk import BULK_VEC

    spec = _spec()
    pieces = sm90_bwd_dq_pieces(spec)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)}
    script = tmp_path / "coords.py"  # a file: the DSL reads the traced function's source
    script.write_text(_COORDS)
    proc = subprocess.run(
        [sys.executable, str(script), "64", "80"], env=env, capture_output=True, text=True, check=False, cwd=root
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    table = json.loads(proc.stdout.strip().splitlines()[-1])["coords"]
    element_of_word = {}
    for c, (_, col0, cols) in enumerate(pieces):
        offset = c * spec.tile_m * cols
        for t in range(128):
            values = table[t]
            assert len(values) == cols * spec.tile_m // 128
            for i, (col, row) in enumerate(values):
                warp, lane = divmod(t, 32)
                k, v = divmod(i, 4)
                assert (col, row) == (16 * warp + lane // 4 + 8 * (v // 2), 8 * k + 2 * (lane % 4) + v % 2)
                j, e = divmod(i, BULK_VEC)
                element_of_word[offset + BULK_VEC * (128 * j + t) + e] = (row, col0 + col)
    assert sorted(element_of_word) == list(range(spec.tile_m * spec.head_dim))
    assert sorted(element_of_word.values()) == [(r, c) for r in range(spec.tile_m) for c in range(spec.head_dim)]
