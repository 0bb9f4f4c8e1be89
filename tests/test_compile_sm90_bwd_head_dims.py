"""The sm90 backward (templates/bwd_sm90.py.j2, tile_n = 128) at head dims of its own: every multiple
of 16 from 32 to 128 (80 for Phi-2, StableLM and InternViT; 112), unpadded.

Fast: the defaults (hd80 and hd112 committed, 64 query rows per step as hd96/hd128; hd32 and hd48
128 as hd64, rendered on demand), their dQ pieces and swizzle atoms, dispatch on sm_90a (the sm90
backward for the multiples of 16, the sm80 backward for the other multiples of 8; dense and with
features) and the refusal of the others with a sentence naming what is taken.
Compiled (marker ``compile``): sm_90a SASS of a sample with no local-memory spill, every setmaxnreg
region within its budget, one WGMMA per k-step of each product, asynchronous WGMMAs, the bulk dQ
reduce-add, dS^T and dK/dV by stmatrix and dK/dV out by TMA store; the preprocess zeroes dq_accum's
parts that its threads do not cover evenly (hd80: 2.5 vectors per thread) with one guarded store
more. The shared-memory layouts' two roles and the dQ chunk order are checked at these head dims
in tests/test_compile_sm90_bwd.py and tests/test_compile_sm90_bwd_dqbulk.py.
Correctness on hardware: tests/gpu/test_bwd_sm90_head_dims_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch
from cpu_support import assert_sm90_bwd_stores

from cutefa import sass
from cutefa.api import backward, feature_bwd
from cutefa.api.features import FeatureArgs
from cutefa.codegen import render_source
from cutefa.model import committed
from cutefa.model.budgets_sm90 import (
    SM90_BWD_OWN_HEAD_DIMS,
    SM90_CONSUMER_REGS,
    SM90_SMEM_LIMIT,
    sm90_bwd_dq_pieces,
    sm90_bwd_registers,
    sm90_bwd_smem_bytes,
    sm90_bwd_swizzle_columns,
)
from cutefa.model.defaults import default_spec
from cutefa.model.options import DqPath, Sm90BwdOptions
from cutefa.model.rules import why_invalid
from cutefa.model.spec import TUNED_HEAD_DIMS, VariantSpec

OWN = [d for d in SM90_BWD_OWN_HEAD_DIMS if d not in (64, 96, 128)]  # 32, 48, 80, 112
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def test_own_head_dims_are_the_multiples_of_16_up_to_128():
    assert OWN == [32, 48, 80, 112]
    assert set(TUNED_HEAD_DIMS) <= set(OWN)


@pytest.mark.parametrize("head_dim", OWN)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_defaults_and_dispatch(head_dim, dtype, causal):
    spec = default_spec("sm90", "bwd", dtype, head_dim, causal=causal)
    tile = (128, 128, 2, 12) if head_dim <= 64 else (64, 128, 2, 12)
    assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == tile
    assert spec.options == Sm90BwdOptions(dq_path=DqPath.BULK)
    assert why_invalid(spec) is None, spec.name
    assert sm90_bwd_smem_bytes(spec) <= SM90_SMEM_LIMIT
    assert sm90_bwd_registers(spec) <= SM90_CONSUMER_REGS
    assert backward.choose_bwd("sm_90a", DTYPES[dtype], head_dim, causal) == spec
    # the A100 and the sm_8x GPUs keep the sm80 backward
    assert backward.choose_bwd("sm_80", DTYPES[dtype], head_dim, causal).arch == "sm80"
    # the committed set holds the tuned head dims' (80, 112); the others render on demand
    assert (spec in committed.default_variants("sm90", "bwd")) == (head_dim in TUNED_HEAD_DIMS)
    source = render_source(spec)
    assert f"HEAD_DIM = {head_dim}\n" in source and f"TILE_M = {spec.tile_m} " in source


def test_dq_pieces_and_swizzle_atoms():
    """The widest swizzle that divides a row's bytes (hd80: 160 bytes, hd112: 224: 32-byte atoms of 16
    columns), and the dQ column split of tile_m = 64 at a whole number of atoms with the second
    piece's start a multiple of its width; the standard head dims keep theirs."""
    assert {d: sm90_bwd_swizzle_columns(d) for d in (32, 48, 64, 80, 96, 112, 128)} == {
        32: 32, 48: 16, 64: 64, 80: 16, 96: 32, 112: 16, 128: 64
    }

    def pieces(head_dim, tile_m=64):
        return sm90_bwd_dq_pieces(VariantSpec("sm90", "bwd", "bf16", head_dim, tile_m, 128, 2, 12))

    assert pieces(80) == ((0, 0, 64), (0, 64, 16))
    assert pieces(112) == ((0, 0, 96), (0, 96, 16))
    assert pieces(96) == ((0, 0, 64), (0, 64, 32))
    assert pieces(128) == ((0, 0, 64), (0, 64, 64))
    assert pieces(48) == ((0, 0, 32), (0, 32, 16))
    assert pieces(32) is None and pieces(64) is None  # one atom's columns: rows split at tile_m 128
    assert pieces(32, 128) == ((0, 0, 32), (1, 0, 32))


@pytest.mark.parametrize("head_dim", [8, 16, 40, 56, 72, 88, 104, 120, 136, 160])
def test_other_head_dims_are_refused_and_run_the_sm80_backward(head_dim):
    spec = VariantSpec("sm90", "bwd", "bf16", head_dim, 64, 128, 2, 12, dq_path=DqPath.BULK)
    reason = why_invalid(spec)
    assert reason is not None and f"head_dim={head_dim}" in reason
    assert "multiples of 16 from 32 to 128" in reason and "the sm80 backward" in reason, reason
    assert default_spec("sm90", "bwd", "bf16", head_dim) is None
    assert backward.choose_bwd("sm_90a", torch.bfloat16, head_dim, False).arch == "sm80"


def test_tiles_over_the_registers_are_refused():
    """hd80 and hd112 at 128 query rows per step: fp32 dK + dV (80 / 112 registers) beside S^T and
    dP^T of 64 x 128 (128) would spill."""
    for head_dim in (80, 112):
        spec = VariantSpec("sm90", "bwd", "bf16", head_dim, 128, 128, 2, 12, dq_path=DqPath.BULK)
        assert "would spill registers" in why_invalid(spec)


def test_the_dq_writer_warp_is_refused():
    """The dQ-writer warp (and the row prefetch, which rides on it) spills at 80 and 112 on sm_90a
    (8-16 bytes of stack): refused there; the per-thread reductions and a third stage are not."""
    base = VariantSpec("sm90", "bwd", "bf16", 80, 64, 128, 2, 12, dq_path=DqPath.BULK)
    for head_dim in (80, 112):
        spec = base.replace(head_dim=head_dim)
        warp = spec.replace(dq_path=DqPath.BULK_WARP)
        for other in (warp, warp.replace(row_prefetch=True)):
            assert "spill" in why_invalid(other) and f"head_dim={head_dim}" in why_invalid(other)
        assert why_invalid(spec.replace(dq_path=DqPath.RED)) is None
        assert why_invalid(spec.replace(stages=3)) is None
        assert "dQ pieces differ in width" in why_invalid(spec.replace(overlap=True))


def _args(varlen: bool, window: bool, softcap: bool, alibi: bool) -> FeatureArgs:
    cu = torch.zeros(3, dtype=torch.int32)
    return FeatureArgs(
        cu_seqlens_q=cu if varlen else None, cu_seqlens_k=cu if varlen else None, seqused_q=None, seqused_k=None,
        max_seqlen_q=1000, max_seqlen_k=1000, window=(128, 0) if window else None, softcap=30.0 if softcap else 0.0,
        alibi_slopes=torch.zeros(2, 8) if alibi else None,
    )  # fmt: skip


def _choose(dtype, head_dim: int, causal: bool, f: FeatureArgs):
    return feature_bwd.choose_bwd("sm_90a", dtype, head_dim, causal, f, seqlen_k=2048, gpu_name="H100")


@pytest.mark.parametrize("head_dim", [80, 112])
def test_feature_calls_take_the_sm90_backward(head_dim):
    for flags in ((True, False, False, False), (False, True, True, False), (True, True, True, True)):
        spec = _choose(torch.bfloat16, head_dim, True, _args(*flags))
        assert spec.arch == "sm90" and spec.head_dim == head_dim and spec.tile_m == 64, spec.name
        assert why_invalid(spec) is None
        assert "def fake_arguments" in render_source(spec)
    assert _choose(torch.float16, 72, False, _args(True, False, False, False)).arch == "sm80"


# hd80 bf16 non-causal and fp16 causal, hd112 bf16 causal; hd48 (128 query rows, a 16-column atom)
# causal and hd32 non-causal; hd80 packed and causal, hd112 with a window, softcap and ALiBi.
CHECKED = [
    default_spec("sm90", "bwd", "bf16", 80),
    default_spec("sm90", "bwd", "fp16", 80, causal=True),
    default_spec("sm90", "bwd", "bf16", 112, causal=True),
    default_spec("sm90", "bwd", "bf16", 48, causal=True),
    default_spec("sm90", "bwd", "fp16", 32),
    _choose(torch.bfloat16, 80, True, _args(True, False, False, False)),
    _choose(torch.float16, 112, False, _args(False, True, True, True)),
]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("bwd_head_dims_sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    text = sass.disassemble(cubins[spec.name])
    for op in ("HGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "MUFU.EX2"):
        assert report.counts.get(op, 0) > 0, f"{spec.name}: no {op}: {report.summary()}"
    # S^T, dP^T over the head dim; dV, dK over the query rows; dQ over the keys (each consumer's piece)
    assert report.counts["HGMMA"] == 2 * spec.head_dim // 16 + 2 * spec.tile_m // 16 + 2 * spec.tile_n // 16
    assert report.stack_bytes == 0 and report.local_bytes == 0 and report.spills == 0, report.summary()
    regions = sass.setmaxnreg_regions(text)
    assert regions and all(used < budget for budget, used in regions), regions
    assert len(re.findall(r"WARPGROUP\.DEPBAR", text)) <= 8  # not serialized
    assert report.forms_of("UBLKRED") == {"UBLKRED.G.S.ADD.F32.RN": 2}, report.forms
    assert not [r for r in re.findall(r"\bREDG?\.\S+", text) if not r.startswith("REDG.E.ADD.F32x4")]
    assert (report.forms.get("MUFU.TANH", 0) > 0) == spec.features.softcap
    if not spec.features.varlen:  # (the packed batch's stores: tests/test_compile_sm90_bwd_features.py)
        assert_sm90_bwd_stores(report, sass.opcode_forms(sass.kernel_text(text, "kernel")), spec)
    # K, V, Q and dO by TMA, one box per swizzle atom of columns (16 at hd80/112/48, 32 at hd32)
    assert report.counts["UTMALDG"] == 4 * spec.head_dim // sm90_bwd_swizzle_columns(spec.head_dim)
    # the preprocess: 16-byte vectors; the zeroing of its 16 x head_dim words of a dq_accum chunk
    # per split, the last store guarded where the 128 threads do not cover them evenly
    pre = sass.opcode_forms(sass.kernel_text(text, "preprocess"))
    assert {f: n for f, n in pre.items() if f.startswith("LDG")} == {"LDG.E.128": 2 * 4, "LDG.E": 2}, pre
    assert pre.get("STG.E.128", 0) == -(-16 * spec.head_dim // 4 // 128), pre
