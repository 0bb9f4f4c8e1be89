"""The sm90 16-bit backward's feature kernels (packed sequences, the local window, softcap, ALiBi;
templates/bwd_sm90.py.j2, cutefa/kernels/sm90/bwd_features.py).

Fast: on an sm_90a target the dispatcher runs every feature call at head dims 64, 96 and 128 on the
sm90 family's default backward template and every such variant renders; head dims 192 and 256 (the
head-dim split and swapped templates, which take no feature) fall back to the sm80 family.
Compiled (marker ``compile``, a sample of four dispatched variants): sm_90a SASS with no local-memory
spill and every setmaxnreg region within its budget, WGMMA for the products, MUFU.TANH exactly with
softcap, and packed batches reading and writing through the ragged TMA views (five-mode UTMALDG and
UTMASTG). The dense modules are unchanged (``cutefa generate --check``, tests/test_sass_reference.py).
Correctness on hardware: tests/gpu/test_sm90_bwd_features.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from cutefa import sass
from cutefa.api import feature_bwd
from cutefa.api.features import FeatureArgs
from cutefa.codegen import render_source, template_name
from cutefa.model.options import Mask

CU = torch.zeros(3, dtype=torch.int32)
SLOPES = torch.zeros(2, 8)


def _args(varlen: bool, window: bool, softcap: bool, alibi: bool) -> FeatureArgs:
    return FeatureArgs(
        cu_seqlens_q=CU if varlen else None, cu_seqlens_k=CU if varlen else None, seqused_q=None, seqused_k=None,
        max_seqlen_q=1000, max_seqlen_k=1000, window=(128, 0) if window else None, softcap=30.0 if softcap else 0.0,
        alibi_slopes=SLOPES if alibi else None,
    )  # fmt: skip


def _choose(dtype, head_dim: int, causal: bool, f: FeatureArgs, gpu: str = "H100"):
    return feature_bwd.choose_bwd("sm_90a", dtype, head_dim, causal, f, seqlen_k=2048, gpu_name=gpu)


FLAGS = [flags for flags in itertools.product((False, True), repeat=4) if any(flags)]


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dispatch_takes_the_sm90_backward_and_it_renders(head_dim, causal):
    for flags in FLAGS:
        f = _args(*flags)
        spec = _choose(torch.bfloat16, head_dim, causal, f)
        assert spec.arch == "sm90" and template_name(spec) == "bwd_sm90.py.j2", spec.name
        assert spec.features == feature_bwd.backward_features(f) and spec.mask is f.mask(causal)
        source = render_source(spec)
        assert "def fake_arguments" in source and ("mCuSeqlensQ" in source) == f.varlen
        assert ("window_left" in source) == (f.window is not None)


@pytest.mark.parametrize("head_dim", [192, 256])
def test_split_templates_fall_back_to_sm80(head_dim):
    spec = _choose(torch.float16, head_dim, True, _args(True, True, True, True))
    assert spec.arch == "sm80" and spec.mask is Mask.LOCAL and spec.features.varlen


# Four dispatched variants (H100 table): hd128 with every feature; hd64 (128 query rows per step,
# the tightest registers) packed, and windowed with softcap; hd128 ALiBi on the dense layout.
CHECKED = [
    _choose(torch.bfloat16, 128, True, _args(True, True, True, True)),
    _choose(torch.float16, 64, False, _args(True, False, False, False)),
    _choose(torch.bfloat16, 64, True, _args(False, True, True, False)),
    _choose(torch.float16, 128, False, _args(False, False, False, True)),
]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("sm90_bwd_features"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    text = sass.disassemble(cubins[spec.name])
    assert report.stack_bytes == 0 and report.local_bytes == 0, spec.name
    assert not any(op.startswith(("LDL", "STL")) for op in report.forms), spec.name
    regions = sass.setmaxnreg_regions(text)
    assert regions and all(used < budget for budget, used in regions), regions
    assert report.counts["HGMMA"] > 0 and report.counts["MUFU.EX2"] > 0
    assert (report.forms.get("MUFU.TANH", 0) > 0) == spec.features.softcap
    five_modes = report.forms.get("UTMALDG.5D", 0) > 0 and report.forms.get("UTMASTG.5D", 0) > 0
    assert five_modes == spec.features.varlen
