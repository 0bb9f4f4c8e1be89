"""The WGMMA MLA decode variant (templates/decode_mla_wgmma_sm90.py.j2, cutefa.model.policy_mla_wgmma):
its spec and rules (fast), and (compile-marked) its sm_90a build on this CPU, whose SASS shows the
design: S = Q K^T as 64x64x16 HGMMAs from shared memory, O += P V as 64x256x16 HGMMAs with a
transposed (MN-major) B, P from registers in one warpgroup and from shared memory in the other,
stmatrix for P, cp.async page gathers, no local memory, and the combine kernel beside it."""

from __future__ import annotations

import pytest

from cutefa import codegen, sass
from cutefa.model import policy_mla, policy_mla_wgmma, rules
from cutefa.model.options import Mask

SAMPLES = [policy_mla_wgmma.mla_spec("bf16"), policy_mla_wgmma.mla_spec("fp16", causal=True)]


def test_spec_and_rules():
    spec = policy_mla_wgmma.mla_spec("bf16")
    assert spec.name == "cutefa_sm90_fwd_bf16_hd576v512_64x64_s2_w8_paged_split"
    assert policy_mla.is_mla(spec) and policy_mla_wgmma.is_wgmma(spec)
    assert rules.why_invalid(spec) is None and rules.why_not_on(spec, "sm_90a") is None
    assert rules.smem_bytes(spec) == 72 * 1024 + 2 * 72 * 1024 + 8 * 1024 + 1024
    assert codegen.template_name(spec) == "decode_mla_wgmma_sm90.py.j2"
    # the default (mma.sync) specs stay with their template and rules
    for rows in (16, 64, 128):
        default = policy_mla.mla_spec("bf16", rows)
        assert not policy_mla_wgmma.is_wgmma(default)
        assert codegen.template_name(default) == "decode_mla_sm90.py.j2"


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"tile_n": 32}, "tile_n=64"),
        ({"stages": 3}, "stages=2"),
        ({"mask": Mask.LOCAL}, "causal mask"),
        ({"arch": "sm80"}, "sm90 forward"),
    ],
)
def test_refused(changes, words):
    reason = rules.why_invalid(policy_mla_wgmma.mla_spec("bf16").replace(**changes))
    assert reason is not None and "WGMMA MLA decode" in reason and words in reason, reason


def test_renders_one_kernel_per_mask():
    plain = codegen.render_source(SAMPLES[0])
    causal = codegen.render_source(policy_mla_wgmma.mla_spec("bf16", causal=True))
    assert "window_right = Int32(UNBOUNDED)" in plain and "window_right = Int32(0)" in causal
    # the two walks (masked, unmasked) of warpgroup 0
    assert plain.count("online_softmax_step_deferred(") == 2
    assert plain.count("apply_band_mask(") == 1  # in the masked walk only


def test_v_view_is_the_latent_stage():
    """The MN-major V^T layout addresses the same element as the K-major latent stage for every
    (key, column < 512, stage): one cache read serves both products."""
    import cutlass
    import cutlass.cute as cute

    from cutefa.kernels.sm90 import mla_wgmma

    seen = {}

    def check():
        _, skv, svt, _ = mla_wgmma.smem_layouts(cutlass.BFloat16, 64, 576, 512, 2)
        seen["stage"] = cute.cosize(skv) // 2
        seen["pairs"] = [
            (skv((key, col, stage)), svt((col, key, stage)))
            for stage in range(2)
            for key in range(0, 64, 3)
            for col in range(0, 512, 5)
        ]

    cute.jit(lambda: check())()
    assert seen["stage"] == 64 * 576
    assert len(seen["pairs"]) > 4000 and all(a == b for a, b in seen["pairs"])
    assert len({a for a, _ in seen["pairs"]}) == len(seen["pairs"])  # distinct elements


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(SAMPLES, "sm_90a", tmp_path_factory.mktemp("sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", SAMPLES, ids=lambda s: s.name)
def test_mla_wgmma_sass(cubins, spec):
    cubin = cubins[spec.name]
    report = sass.analyze(cubin)
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0, report.summary()
    assert 0 < report.registers <= 255, report.summary()
    text = sass.disassemble(cubin)
    assert len(sass.kernel_sections(text)) == 2
    kernel = sass.kernel_text(text, "kernel")
    forms = sass.opcode_forms(kernel)
    mma = "F32.BF16" if spec.dtype == "bf16" else "F32"  # fp16 inputs are the default form
    # per body (masked, unmasked): 576 / 16 S k-blocks; 64 / 16 P V k-blocks in each warpgroup
    assert kernel.count(f"HGMMA.64x64x16.{mma} ") == 2 * spec.head_dim // 16, report.summary()
    assert kernel.count(f"HGMMA.64x256x16.{mma} ") == 2 * 2 * spec.tile_n // 16, report.summary()
    pv = [line for line in kernel.splitlines() if "HGMMA.64x256x16" in line]
    assert all(".tnspB" in line for line in pv)  # V^T: the MN-major view of the latent stage
    smem_a = [line for line in pv if "gdesc" in line.split("HGMMA")[1].split(",")[1]]
    assert 0 < len(smem_a) < len(pv)  # one warpgroup takes P from shared memory, the other from registers
    assert forms.get("STSM.16.M88.4", 0) > 0 and forms.get("FENCE.VIEW.ASYNC.S", 0) > 0, forms
    assert any(f.startswith("LDGSTS.E") and f.endswith(".128") for f in forms), forms
    combine = sass.kernel_text(text, "combine")
    assert "GMMA" not in combine and "MUFU.EX2" in combine
    # the combine is the splits' programmatic dependent: they trigger it (PREEXIT), it waits (ACQBULK)
    assert "ACQBULK" in sass.opcode_forms(combine)
    assert "PREEXIT" in sass.opcode_forms(sass.kernel_text(text, "kernel"))
