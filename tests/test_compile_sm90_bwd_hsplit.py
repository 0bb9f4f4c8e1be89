"""sm90 backward at head dims 192 and 256 (the head-dim split, templates/bwd_sm90_hsplit.py.j2) on
this CPU: the committed variants with per-thread dQ reductions (DqPath.RED: bf16 alternatives beside
head dim 256's default, the split with the bulk dQ path and the overlap schedule
(tests/test_compile_sm90_bwd_dqbulk.py), and beside
head dim 192's swapped default) compile for sm_90a and their SASS shows the design: WGMMA (HGMMA)
64 x tile_m/2 for S^T and dP^T (each consumer its half of the queries) and 64 x d/2 for dV, dK and
dQ (each consumer its half of the head dim), TMA loads (UTMALDG) of K, V, Q and dO, setmaxnreg
(USETMAXREG), MUFU.EX2, 8-byte fp32 vector reductions into the dQ accumulator, WGMMAs left
asynchronous, and no local-memory spills; the consumers stay within setmaxnreg's 240 registers.
The committed overlap alternative (_ov: dV/dK over each consumer's own queries from registers
before the per-block barrier) is checked the same way at both head dims.
The shared-memory layouts that read one buffer in two roles address the same bytes.

One cubin holds the preprocess, main and postprocess kernels; counts are summed over the three.
Correctness on hardware: tests/gpu/test_bwd_sm90.py and tests/gpu/test_bwd_sm90_hsplit.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_support import all_variants

from cutefa import sass
from cutefa.model.budgets_sm90 import sm90_bwd_head_split
from cutefa.model.defaults import DEFAULT_BWD_TILES
from cutefa.model.options import DqPath, Sm90BwdOptions
from cutefa.model.rules import why_invalid

# (the DqPath.BULK twins have their own test: tests/test_compile_sm90_bwd_dqbulk.py)
COMMITTED = [
    s
    for s in all_variants("sm90", "bwd")
    if sm90_bwd_head_split(s) and s.options.dq_path is DqPath.RED
]
# bf16 alternatives (hd256's default adds the bulk path and the overlap)
SPLIT = [s for s in COMMITTED if not s.options.overlap]
OVERLAP = [s for s in COMMITTED if s.options.overlap]  # SM90_BWD_ALTERNATIVES: bf16, both masks
# both head dims, one causal and the other not; the overlap schedule at both head dims (one causal).
CHECKED = [s for s in SPLIT if s.causal == (s.head_dim == 192)] + [
    s for s in OVERLAP if s.causal == (s.head_dim == 256)
]


def test_split_defaults():
    """Dispatch's default backward tile at head dim 256 is the split (64 x 64, 2 stages, 12 warps),
    fp16 and bf16, causal and not, with the bulk dQ path and the overlap schedule, and backward.choose_bwd
    picks it on sm_90a; the plain split stays committed beside it at head dims 256 and 192 (there
    beside the swapped default; bf16, both masks)."""
    import torch

    from cutefa.api import backward

    assert sorted((s.dtype, s.head_dim, s.causal) for s in SPLIT) == [
        ("bf16", d, c) for d in (192, 256) for c in (False, True)
    ]
    for spec in SPLIT:
        assert why_invalid(spec) is None, spec.name
        assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == (64, 64, 2, 12)
    assert DEFAULT_BWD_TILES["sm90"][256] == (64, 64, 2, 12)
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            spec = backward.choose_bwd("sm_90a", dtype, 256, causal)
            assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == (64, 64, 2, 12), spec.name
            assert spec.options == Sm90BwdOptions(overlap=True, dq_path=DqPath.BULK), spec.name
            assert sm90_bwd_head_split(spec), spec.name
    # the sm80 family still serves these head dims below Hopper
    assert backward.choose_bwd("sm_80", torch.bfloat16, 256, True).arch == "sm80"
    # the overlap schedule is committed beside the bf16 defaults; dispatch keeps the defaults
    assert sorted(OVERLAP) == sorted(s.replace(overlap=True) for s in SPLIT if s.dtype == "bf16")
    assert all(s.options == Sm90BwdOptions(overlap=True) for s in OVERLAP)


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("bwd_hsplit_sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_sm90a_bwd_hsplit(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    for op in ("HGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "MUFU.EX2"):
        assert report.counts.get(op, 0) > 0, f"{spec.name}: no {op}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    half_d, half_m = spec.head_dim // 2, spec.tile_m // 2
    # Per query block, one code path for both consumers: S^T and dP^T (head_dim/16 k-steps each,
    # N = tile_m/2), dV and dK (tile_m/16 each) and dQ (tile_n/16), N = d/2; every k-step one WGMMA.
    text = sass.disassemble(cubins[spec.name])
    shapes: dict[str, int] = {}
    for shape in re.findall(r"\bHGMMA\.(\d+x\d+)x16\b", text):
        shapes[shape] = shapes.get(shape, 0) + 1
    assert shapes == {
        f"64x{half_m}": 2 * spec.head_dim // 16,
        f"64x{half_d}": 2 * spec.tile_m // 16 + spec.tile_n // 16,
    }, f"{spec.name}: {shapes}"
    assert sum(shapes.values()) == report.counts["HGMMA"]
    # overlap: dV and dK over the consumer's own tile_m/2 queries take P^T, dS^T from registers
    # (``HGMMA ... Rd, Ra, gdesc``), tile_m/32 k-steps each; the default has no register A operand.
    register_a = re.findall(r"\bHGMMA\.\S+\s+R\d+,\s*R\d+,\s*gdesc", text)
    expected = 2 * half_m // 16 if spec.options.overlap else 0
    assert len(register_a) == expected, f"{spec.name}: {len(register_a)}"
    # The producer gives registers up, the consumers take 240 and stay within them.
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == [24, 240], regions
    assert all(used < budget for budget, used in regions), regions
    # dQ into dq_accum: 8-byte vector reductions, one per two columns of 64 rows x d/2 per thread,
    # twice: unpredicated for full query blocks, guarded for the last one.
    reductions = re.findall(r"\bREDG?\.E\.ADD\.F32x2\b", text)
    assert len(reductions) == 2 * (64 * half_d // 128 // 2), f"{spec.name}: {len(reductions)} REDs"
    # K, V, Q, dO: one TMA box per swizzle-atom column panel (64 columns at d=256, 32 at d=192).
    atom = 64 if half_d % 64 == 0 else 32
    assert report.counts["UTMALDG"] == 4 * spec.head_dim // atom, report.summary()
    # WGMMAs stay asynchronous: ptxas serializing them would put a wait after every HGMMA.
    waits = re.findall(r"WARPGROUP\.DEPBAR", text)
    limit = 5 if spec.options.overlap else 4
    assert len(waits) <= limit, f"{spec.name}: {len(waits)} WGMMA waits (serialized?)"


_LAYOUT_CHECK = """
import json, sys
import cutlass, cutlass.cute as cute
from cutefa.kernels.sm90 import bwd_parts

result = {}

@cute.jit
def offsets(head_dim: cutlass.Constexpr):
    tm, tn, st = 64, 64, 2
    sk, skt, sq, sqt, sds, sdst = bwd_parts.split_smem_layouts(cutlass.BFloat16, tm, tn, head_dim, st)
    result["k"] = [sk((r, c, 0)) for r in range(tn) for c in range(head_dim)]
    result["kt"] = [skt((c, r, 0)) for r in range(tn) for c in range(head_dim)]
    result["q"] = [sq((r, c, s)) for s in range(st) for r in range(tm) for c in range(head_dim)]
    result["qt"] = [sqt((c, r, s)) for s in range(st) for r in range(tm) for c in range(head_dim)]
    result["ds"] = [sds((r, c, s)) for s in range(2) for r in range(tm) for c in range(tn)]
    result["dst"] = [sdst((c, r, s)) for s in range(2) for r in range(tm) for c in range(tn)]
    result["swizzle"] = str(sk.inner)

offsets(int(sys.argv[1]))
print(json.dumps(result))
"""


@pytest.mark.compile  # traces layouts with the DSL in a child process
@pytest.mark.parametrize("head_dim", [192, 256])
def test_split_two_role_layouts_share_bytes(tmp_path, head_dim):
    """K's K-major (A of S^T) and MN-major (B of dQ) layouts map every element to the same offset,
    as do Q/dO's (B of S^T, dP^T and B of dK, dV) and dS's MN-major (A of dQ) and K-major (A of dK,
    also P^T's for dV) ones; the head-dim swizzle atom puts each consumer's half on an atom edge."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)}
    script = tmp_path / "layouts.py"  # a file: the DSL reads the traced function's source
    script.write_text(_LAYOUT_CHECK)
    proc = subprocess.run(
        [sys.executable, str(script), str(head_dim)], env=env, capture_output=True, text=True, check=False, cwd=root
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["k"] == got["kt"]
    assert got["q"] == got["qt"]
    assert got["ds"] == got["dst"]
    assert sorted(got["k"]) == list(range(64 * head_dim))
    assert sorted(got["q"]) == list(range(2 * 64 * head_dim))
    assert sorted(got["ds"]) == list(range(2 * 64 * 64))
    # 128-byte swizzle (S<3,4,3>, 64-column atoms) at d=256, 64-byte (S<2,4,3>, 32 columns) at 192
    assert got["swizzle"] == ("S<3,4,3>" if head_dim == 256 else "S<2,4,3>")
    half = head_dim // 2
    atom = 64 if head_dim == 256 else 32
    # the second consumer's half of K^T starts on an atom boundary: its first column's offsets are
    # those of column 0 shifted by whole atom panels
    col = [got["kt"][r * head_dim + half] for r in range(64)]
    col0 = [got["kt"][r * head_dim] for r in range(64)]
    assert [a - b for a, b in zip(col, col0)] == [(half // atom) * atom * 64] * 64
