"""The sm100 fp8 (e4m3) forward: the default variants compile on this CPU for sm_100a, and their SASS
shows the design. No Blackwell GPU exists here: these kernels are compiled and SASS-checked, not run.

What cuobjdump prints for a tcgen05 kind::f8f6f4 UMMA is ``UTCQMMA`` (read from the SASS): S = Q K^T
as ``UTCQMMA gdesc[..], gdesc[..], tmem[..], ...`` (both operands in shared memory), O += P V as
``UTCQMMA tmem[..], gdesc[..], tmem[..], ...`` (P, the A operand, in TMEM). Also checked: no 16-bit
UMMA (UTCHMMA), TMA loads (UTMALDG) and the bf16 O store (UTMASTG), TMEM loads and stores
(LDTM/STTM), P converted to e4m3 (F2FP.SATFINITE.E4M3) and O to bf16, per-role register budgets
(USETMAXREG) that each role's code stays within, and no local-memory spills.
"""

from __future__ import annotations

import re

import pytest

from cutefa import codegen, sass
from cutefa.model.budgets import SMEM_RESERVE
from cutefa.model.budgets_sm100 import sm100_smem_bytes
from cutefa.model.committed import default_variants
from cutefa.model.defaults import default_config
from cutefa.model.rules import why_invalid
from cutefa.model.spec import VariantSpec

FP8_DEFAULTS = [s for s in default_variants("sm100", "fwd") if s.dtype == "e4m3"]
# Two Q tiles (hd64, hd128) and one (hd256), causal and not.
CHECKED = [
    next(s for s in FP8_DEFAULTS if (s.head_dim, s.causal) == (64, False)),
    next(s for s in FP8_DEFAULTS if (s.head_dim, s.causal) == (128, True)),
    next(s for s in FP8_DEFAULTS if (s.head_dim, s.causal) == (256, False)),
]


def test_every_head_dim_has_an_fp8_default():
    """e4m3 takes the sm100 16-bit default tile and options of each head dim (the one dispatch
    picks), causal and not; no CTA-pair e4m3 variant."""
    assert {s.head_dim for s in FP8_DEFAULTS} == {64, 96, 128, 192, 256}
    assert len(FP8_DEFAULTS) == 10
    for spec in FP8_DEFAULTS:
        sixteen = default_config("sm100", "fwd", "bf16", spec.head_dim)
        assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == tuple(sixteen.tile)
        assert spec.options == sixteen.options
        assert not spec.options.cta_pair
        assert codegen.template_name(spec) == "fwd_sm100.py.j2"


def test_calling_convention():
    """The e4m3 kernels take the sm90 fp8 forward's arguments: (q, k, v, o, lse, q_descale,
    k_descale, v_descale, softmax_scale, stream), declared by the module's fake_arguments."""
    text = codegen.render_source(CHECKED[1])
    assert "from cutefa.kernels.common.fp8 import fake_arguments" in text
    call = re.search(r"def __call__\((.*?)\):", text, re.DOTALL)[1]
    params = re.findall(r"(\w+):", call)
    assert params == ["mQ", "mK", "mV", "mO", "mLSE", "mQd", "mKd", "mVd", "softmax_scale", "stream"]
    assert "OUT_DTYPE = cutlass.BFloat16" in text and "DTYPE = cutlass.Float8E4M3FN" in text
    # 16-bit variants keep their convention
    bf16 = codegen.render_source(CHECKED[1].replace(dtype="bf16"))
    assert "fake_arguments" not in bf16 and "mQd" not in bf16


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_100a", tmp_path_factory.mktemp("sm_100a_fp8"))


def _umma_lines(text: str) -> list[str]:
    return [line.split("*/", 1)[1].strip() for line in text.splitlines() if re.search(r"\bUTCQMMA\b", line)]


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    summary = f"{spec.name}: {report.summary()}"
    assert report.missing("sm100", "e4m3") == [], summary
    assert report.counts["UTCHMMA"] == 0, summary  # every UMMA takes e4m3 operands
    assert report.spills == 0, summary
    assert 0 < report.registers <= 128, summary  # 512 threads at launch; more only via setmaxnreg
    assert report.counts["MUFU.EX2"] > 0, summary
    assert report.forms.get("F2FP.BF16.F32.PACK_AB", 0) > 0, report.forms  # O -> bf16
    assert sum(report.forms_of("UTMASTG").values()) > 0, report.forms  # O stored by TMA
    assert not [f for f in report.forms if ".2CTA" in f], report.forms
    # Per Q tile, S = Q K^T at two call sites (prologue, mainloop) and O += P V at two (mainloop,
    # tail); each issues its first k-block, then the rest in a rolled loop.
    q_tiles = spec.tile_m // 128
    text = sass.disassemble(cubins[spec.name])
    lines = _umma_lines(text)
    ss = [line for line in lines if line.startswith("UTCQMMA gdesc[")]
    ts = [line for line in lines if line.startswith("UTCQMMA tmem[")]
    assert len(ss) == 4 * q_tiles and len(ts) == 4 * q_tiles, lines
    # Each role's code stays within its setmaxnreg budget (MMA/load/epilogue 64, softmax 184,
    # correction 80). The last stretch (correction, in code order) runs to the end of the function,
    # where ptxas also places out-of-line blocks of other roles (the 16-bit kernels show the same),
    # so its highest register says nothing about the correction warps.
    regions = sass.setmaxnreg_regions(text)
    assert {budget for budget, _ in regions} == {64, 184, 80}, regions
    assert all(used < budget for budget, used in regions[:-1]), regions


@pytest.mark.compile
def test_p_operand_layout_in_tmem(tmp_path):
    """P is stored 4 e4m3 per 32-bit TMEM column (P_PER_COLUMN), key k of the block at byte k:
    the A-operand fragment the DSL builds for the e4m3 P V UMMA from TMEM must say the same
    (lane stride 4 x 65536 bytes, 32 contiguous keys per UMMA, k-blocks 32 bytes = 8 columns apart)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import os; os.environ['CUTE_DSL_ARCH'] = 'sm_100a'\n"
        "import cutlass, cutlass.cute as cute\n"
        "import cutlass.utils.blackwell_helpers as sm100_utils\n"
        "from cutefa.kernels.sm100 import parts\n"
        "@cute.jit\n"
        "def probe():\n"
        "    dt = cutlass.Float8E4M3FN\n"
        "    _, pv = parts.tiled_mmas(dt, 128, 128)\n"
        "    tP = sm100_utils.make_smem_layout_a(pv, (128, 128, 128), dt, 1)\n"
        "    tmem = cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem, assumed_align=16)\n"
        "    frag = pv.get_slice(0).make_fragment_A(cute.make_tensor(tmem, tP.outer))\n"
        "    print('P', frag.layout)\n"
        "    print('W', frag.element_type.width)\n"
        "probe()\n"
    )
    script = tmp_path / "probe_p.py"  # the DSL compiles functions from their source file
    script.write_text(code)
    root = str(Path(codegen.__file__).resolve().parents[1])  # this checkout's cutefa
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line[:2] in ("P ", "W "))
    assert lines["W"] == "8"
    assert lines["P"] == "((128,32),1,4,1):((262144,1),0,32,0)"


def test_fp8_rules():
    base = VariantSpec("sm100", "fwd", "e4m3", 128, 256, 128, 3, 16, exp_emu=25)
    assert why_invalid(base) is None
    assert "single-CTA only" in why_invalid(base.replace(cta_pair=True))
    reason = why_invalid(base.replace(tile_n=80))
    assert reason.startswith("tile_n=80 is not a multiple of 32 (the k of an e4m3 UMMA")
    # TMEM columns do not depend on the dtype (S and O are fp32; P lives inside S)
    assert "768 TMEM columns" in why_invalid(base.replace(head_dim=256))
    # one byte per Q/K/V element, two per staged O element (bf16 output)
    assert sm100_smem_bytes(base) == (256 + 3 * 128) * 128 + 128 * 128 * 2 + 4 * SMEM_RESERVE
    bf16 = base.replace(dtype="bf16")
    assert sm100_smem_bytes(bf16) == ((256 + 3 * 128) * 128 + 128 * 128) * 2 + 4 * SMEM_RESERVE


@pytest.mark.compile
def test_sass_sm103a(tmp_path):
    """The same e4m3 kernel compiled for the B300 (cc 10.3), whose GPUs do not load sm_100a code."""
    spec = CHECKED[1]
    report = sass.analyze(sass.dump_cubins([spec], "sm_103a", tmp_path)[spec.name])
    assert report.missing("sm100", "e4m3") == [], f"{spec.name}: {report.summary()}"
    assert report.counts["UTCHMMA"] == 0 and report.spills == 0, f"{spec.name}: {report.summary()}"
