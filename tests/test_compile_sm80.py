"""The sm80 forward variants compile on this CPU, and their SASS shows the FlashAttention-2 design.

Compiled for sm_90a (the H200 the kernels are tuned on) and, for the large tiles, for sm_80 (A100),
a sample of each (cpu_support.compile_sample; every variant with CUTEFA_FULL_COMPILE_TESTS=1): mma.sync
(HMMA), ldmatrix (LDSM), cp.async (LDGSTS) and MUFU.EX2 must appear; no local-memory spills
(LDL/STL, stack or local bytes); registers within the 255 limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cpu_support import all_variants, compile_sample

from cutefa import sass
from cutefa.model.rules import tile_head_dims

pytestmark = pytest.mark.compile

DEFAULTS = all_variants("sm80", "fwd")
CHECKED = compile_sample(DEFAULTS)
A100_SUBSET = compile_sample(s for s in DEFAULTS if s.dtype == "bf16" and s.tile_m * s.tile_n >= 128 * 64)


@pytest.fixture(scope="module")
def cubins_sm90a(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("sm_90a"))


@pytest.fixture(scope="module")
def cubins_sm80(tmp_path_factory):
    return sass.dump_cubins(A100_SUBSET, "sm_80", tmp_path_factory.mktemp("sm_80"))


def _check(report: sass.SassReport, name: str) -> None:
    assert report.missing("sm80") == [], f"{name}: {report.summary()}"
    assert report.spills == 0, f"{name} spills: {report.summary()}"
    assert 0 < report.registers <= 255, f"{name}: {report.summary()}"
    # One mainloop body for masked blocks, one for unmasked: both must be MMA-bound code.
    assert report.counts["HMMA"] >= 2 * 64, f"{name}: {report.summary()}"


@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_sm90a(cubins_sm90a, spec):
    _check(sass.analyze(cubins_sm90a[spec.name]), spec.name)


@pytest.mark.parametrize("spec", A100_SUBSET, ids=lambda s: s.name)
def test_sass_sm80(cubins_sm80, spec):
    _check(sass.analyze(cubins_sm80[spec.name]), spec.name)


def test_hmma_count_matches_the_tile(cubins_sm90a):
    """Per mainloop body each warp issues (rows/16) * (tile_n/8) * (d_qk/16) HMMAs for S = Q K^T
    and (rows/16) * (d_v/8) * (tile_n/16) for O += P V, over the tile's head dims (a padded head dim
    computes on its padded tile); two bodies (masked, unmasked)."""
    for spec in CHECKED:
        rows = spec.tile_m // spec.warps
        d_qk, d_v = tile_head_dims(spec)
        per_body = (rows // 16) * ((spec.tile_n // 8) * (d_qk // 16) + (d_v // 8) * (spec.tile_n // 16))
        assert sass.analyze(cubins_sm90a[spec.name]).counts["HMMA"] == 2 * per_body, spec.name


def test_aot_export_loads_without_the_compiler(tmp_path):
    """`cutefa compile` writes a linked .so that tvm_ffi loads in a process that never imports cutlass."""
    name = "cutefa_sm80_fwd_bf16_hd128_128x128_s1_w8_causal"
    env = {**os.environ, "CUTEFA_CACHE_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "cutefa", "compile", "--arch", "sm80", "--target", "sm_90a",
         "--kernels", name, "--jobs", "1"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 compiled, 0 failed" in run.stdout
    (so,) = tmp_path.glob(f"sm_90a/{name}-*/kernel.so")
    meta = json.loads((so.parent / "meta.json").read_text())
    assert meta["name"] == name and meta["target"] == "sm_90a"
    probe = (
        "import sys, ctypes\n"
        "from cutefa.ffi import runtime_library\n"
        f"ctypes.CDLL(str(runtime_library({meta['runtime']!r})), ctypes.RTLD_GLOBAL)\n"
        "import tvm_ffi\n"
        f"fn = tvm_ffi.load_module({str(so)!r})[{name!r}]\n"
        "assert 'cutlass' not in sys.modules, 'the DSL compiler was imported'\n"
        "print('loaded', type(fn).__name__)\n"
    )
    load = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert load.returncode == 0 and "loaded" in load.stdout, load.stdout + load.stderr
