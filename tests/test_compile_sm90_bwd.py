"""sm90 backward (FlashAttention-3 design) on this CPU: representative default variants compile for
sm_90a and their SASS shows the design: WGMMA (HGMMA) for all five products, TMA loads (UTMALDG) of
K, V, Q and dO, setmaxnreg (USETMAXREG), mbarrier pipelines (SYNCS), MUFU.EX2 for the recomputed
probabilities and 8-byte fp32 vector reductions (REDG ... ADD.F32x2) into the dQ accumulator; no local-memory
spills. Also: the shared-memory layouts that read one buffer in two roles address the same bytes.

The measured alternatives (tools/alternatives.py SM90_BWD_ALTERNATIVES: a 3-stage Q/dO ring, the
overlap schedule) are checked the same way, one per kind (the bulk dQ path, DqPath.BULK:
tests/test_compile_sm90_bwd_dqbulk.py); overlap issues dK in each consumer's dQ branch (its HGMMAs
twice) and
must keep ptxas from serializing the WGMMAs (one wait per commit-group boundary, no more).

One cubin holds the preprocess, main and postprocess kernels; counts are summed over the three.
Correctness on hardware: tests/gpu/test_bwd_sm90.py.
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
from cutefa.model.budgets_sm90 import (
    SM90_CONSUMER_REGS,
    SM90_SMEM_LIMIT,
    sm90_bwd_dq_pieces,
    sm90_bwd_dq_swapped,
    sm90_bwd_head_split,
    sm90_bwd_registers,
    sm90_bwd_smem_bytes,
    sm90_bwd_swapped,
)
from cutefa.model.defaults import DEFAULT_BWD_TILES
from cutefa.model.options import DqPath, Sm90BwdOptions
from cutefa.model.rules import est_registers, smem_bytes, why_invalid
from cutefa.model.spec import HEAD_DIMS

# The head-dim split (head dims 192/256, tile_n=64) and the swapped-dK/dV partition (head dim 192,
# tile_n=96) have their own templates and checks: tests/test_compile_sm90_bwd_hsplit.py and
# tests/test_compile_sm90_bwd_swapkv.py.
# The tile_m=80 tile (dQ transposed): tests/test_compile_sm90_bwd_dqswap.py. Head dims of their own
# (80, 112): tests/test_compile_sm90_bwd_head_dims.py.
COMMITTED = [
    s
    for s in all_variants("sm90", "bwd")
    if not (sm90_bwd_head_split(s) or sm90_bwd_swapped(s) or sm90_bwd_dq_swapped(s))
    and s.head_dim in HEAD_DIMS
]


# The options of the defaults at head dims 64, 96 and 128: dQ by one bulk reduce-add per consumer
# (tests/test_compile_sm90_bwd_dqbulk.py checks that dispatch picks them).
DEFAULT_OPTIONS = Sm90BwdOptions(dq_path=DqPath.BULK)


def _is_default(s) -> bool:
    tile = (s.tile_m, s.tile_n, s.stages, s.warps)
    return tile == DEFAULT_BWD_TILES["sm90"][s.head_dim] and s.options == DEFAULT_OPTIONS


DEFAULTS = [s for s in COMMITTED if _is_default(s)]
ALTERNATIVES = [s for s in COMMITTED if not _is_default(s)]
# The defaults add dQ with one bulk reduce-add per consumer (DqPath.BULK): their SASS is checked by
# tests/test_compile_sm90_bwd_dqbulk.py. Here the per-thread reductions of the alternatives: the
# 2-stage tile at both head dims (one causal), overlap at both head dims (the other mask) and one
# 3-stage ring.
CHECKED = [
    s
    for s in ALTERNATIVES
    if s.options.dq_path is DqPath.RED
    and (
        (s.stages == 2 and not s.options.overlap and s.causal == (s.head_dim == 64))
        or (s.options.overlap and s.stages == 2 and s.causal == (s.head_dim == 128))
        or (not s.options.overlap and s.stages == 3 and s.head_dim == 128 and not s.causal)
    )
]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("bwd_sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_sm90a_bwd(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    for op in ("HGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "MUFU.EX2"):
        assert report.counts.get(op, 0) > 0, f"{spec.name}: no {op}: {report.summary()}"
    # Per query block: S^T and dP^T (head_dim/16 k-steps each), dV and dK (tile_m/16 each), dQ
    # (tile_n/16, once per consumer's piece): every k-step one WGMMA, unrolled.
    expected = 2 * spec.head_dim // 16 + 2 * spec.tile_m // 16 + 2 * spec.tile_n // 16
    if spec.options.overlap:  # dK issued after dQ, in each consumer's branch
        expected += spec.tile_m // 16
    assert report.counts["HGMMA"] == expected, f"{spec.name}: {report.summary()}"
    assert report.counts["USETMAXREG"] >= 2, report.summary()  # producer gives, consumers take
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    # dS^T and the dK/dV staging by stmatrix, dK/dV out by TMA store; 32-bit shared stores only
    # for LSE2/D.
    assert report.forms.get("STS", 0) == 2, report.forms_of("STS")
    text = sass._cuobjdump(cubins[spec.name], "-sass")
    assert_sm90_bwd_stores(report, sass.opcode_forms(sass.kernel_text(text, "kernel")), spec)
    # dQ into dq_accum: 8-byte vector reductions, one per two accumulator columns of each piece
    # (64 rows x its columns over 128 threads; one code path per consumer), each twice: unpredicated
    # for the query blocks whose rows are all in range, guarded row by row for the last one.
    reductions = re.findall(r"\bREDG?\.E\.ADD\.F32x2\b", text)
    expected = 2 * sum(64 * cols // 128 // 2 for _, _, cols in sm90_bwd_dq_pieces(spec))
    assert len(reductions) == expected, f"{spec.name}: {len(reductions)} REDs, expected {expected}"
    # K, V once per key block, Q and dO per query block: 4 TMA loads per box row of 64 columns.
    assert report.counts["UTMALDG"] >= 4, report.summary()
    # WGMMAs stay asynchronous: ptxas serializing them would put a wait after every HGMMA.
    waits = re.findall(r"WARPGROUP\.DEPBAR", text)
    assert len(waits) <= 8, f"{spec.name}: {len(waits)} WGMMA waits (serialized?)"
    # The preprocess reads O and dO by 16-byte vectors: one per row (4 per warp), tensor and lane,
    # all before the products; 32-bit loads only for the LSE and dLSE of a lane's row.
    pre = sass.opcode_forms(sass.kernel_text(text, "preprocess"))
    assert {f: n for f, n in pre.items() if f.startswith("LDG")} == {"LDG.E.128": 2 * 4, "LDG.E": 2}, pre
    # The kernels after the preprocess are launched as programmatic dependents (cutefa.kernels.
    # common.pdl): each triggers the next one's launch at its top (PREEXIT) and waits for the one
    # before it (ACQBULK) before reading what it writes; the preprocess, first of the chain, only
    # triggers. In the main kernel the consumers wait (one code path for both), and the dQ-writer
    # warp where there is one; the load warp does not (it reads inputs only).
    assert "PREEXIT" in pre and "ACQBULK" not in pre, pre
    waits = {"kernel": 2 if spec.options.dq_path is DqPath.BULK_WARP else 1, "postprocess": 1}
    for role, count in waits.items():
        forms = sass.opcode_forms(sass.kernel_text(text, role))
        assert forms.get("ACQBULK") == count and forms.get("PREEXIT") == 1, (role, forms)


def test_alternatives_are_bf16_schedules_beside_the_defaults():
    """SM90_BWD_ALTERNATIVES: bf16, at most 36, each a valid spec that differs from its head dim's
    default; fp16 only the dQ-writer warp's and the overlap schedule's (SM90_FP16_BWD_ALTERNATIVES);
    dispatch (backward.choose_bwd)
    with no tuned table picks the default."""
    import torch

    from cutefa.api import backward

    bf16 = [s for s in ALTERNATIVES if s.dtype == "bf16"]
    fp16 = [s for s in ALTERNATIVES if s.dtype == "fp16"]
    assert 0 < len(bf16) <= 36 and len(bf16) + len(fp16) == len(ALTERNATIVES)
    assert fp16 and all(
        s.options.dq_path is DqPath.BULK_WARP or (s.options.dq_path is DqPath.BULK and s.options.overlap)
        for s in fp16
    )
    assert {s.replace(dtype="bf16") for s in fp16} <= set(bf16)
    assert {s.head_dim for s in ALTERNATIVES} == {64, 128}
    for spec in ALTERNATIVES:
        assert why_invalid(spec) is None, spec.name
        dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
        chosen = backward.choose_bwd("sm_90a", dtype, spec.head_dim, spec.causal)
        assert chosen in DEFAULTS and chosen != spec
    assert any(s.options.overlap for s in ALTERNATIVES) and any(s.stages == 3 for s in ALTERNATIVES)


def test_bwd_budgets_in_the_predicate():
    """The tile_n=128 defaults are head dims 64, 96 and 128 and fit 227 KiB and the consumers' 240
    registers."""
    assert sorted({s.head_dim for s in DEFAULTS}) == [64, 96, 128]
    assert len(DEFAULTS) == 2 * 2 * 3
    for spec in DEFAULTS:
        assert why_invalid(spec) is None
        assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == DEFAULT_BWD_TILES["sm90"][spec.head_dim]
        assert sm90_bwd_smem_bytes(spec) <= SM90_SMEM_LIMIT
        assert sm90_bwd_registers(spec) <= SM90_CONSUMER_REGS
        # the generic budget functions (CLI show, codegen) use the backward's models
        assert smem_bytes(spec) == sm90_bwd_smem_bytes(spec)
        assert est_registers(spec) == sm90_bwd_registers(spec)


_LAYOUT_CHECK = """
import json, sys
import cutlass, cutlass.cute as cute
from cutefa.kernels.sm90 import bwd_parts

result = {}

@cute.jit
def offsets(tile_m: cutlass.Constexpr, head_dim: cutlass.Constexpr):
    sk, skt, sq, sqt, sds = bwd_parts.smem_layouts(cutlass.BFloat16, tile_m, 128, head_dim, 2)
    result["k"] = [sk((r, c, 0)) for r in range(128) for c in range(head_dim)]
    result["kt"] = [skt((c, r, 0)) for r in range(128) for c in range(head_dim)]
    result["q"] = [sq((r, c, s)) for s in range(2) for r in range(tile_m) for c in range(head_dim)]
    result["qt"] = [sqt((c, r, s)) for s in range(2) for r in range(tile_m) for c in range(head_dim)]
    result["ds"] = [sds((r, c, s)) for s in range(2) for r in range(tile_m) for c in range(128)]

offsets(int(sys.argv[1]), int(sys.argv[2]))
print(json.dumps(result))
"""


@pytest.mark.compile  # traces layouts with the DSL in a child process (~10 s each)
@pytest.mark.parametrize(
    ("tile_m", "head_dim"),
    [(128, 64), (64, 96), (64, 128), (80, 128), (64, 80), (64, 112), (128, 48), (128, 32)],
)
def test_two_role_layouts_share_bytes(tmp_path, tile_m, head_dim):
    """K's K-major (A of S^T) and MN-major (B of dQ) layouts map every element to the same offset,
    as do Q/dO's K-major (B of S^T, dP^T) and MN-major (B of dK, dV) ones; dS's two buffers are
    each a permutation of their own range."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)}
    script = tmp_path / "layouts.py"  # a file: the DSL reads the traced function's source
    script.write_text(_LAYOUT_CHECK)
    proc = subprocess.run(
        [sys.executable, str(script), str(tile_m), str(head_dim)],
        env=env, capture_output=True, text=True, check=False, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["k"] == got["kt"]
    assert got["q"] == got["qt"]
    assert sorted(got["k"]) == list(range(128 * head_dim))
    assert sorted(got["q"]) == list(range(2 * tile_m * head_dim))
    assert sorted(got["ds"]) == list(range(2 * tile_m * 128))
