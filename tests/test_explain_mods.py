"""``explain`` for a call with user mods names them (their traced expression and key) and the kernels
they are fused into: the same forward and backward variants the call runs (cutefa/mods/api.py),
or why there is none. CPU only: nothing is compiled."""

from __future__ import annotations

import pytest
import torch
from test_mods_examples import document_mask, prefix_lm, random_docs, relative_bias

from cutefa import create_block_mask, dispatch
from cutefa.mods import ModTraceError, trace_mods
from cutefa.mods import api as mods_api
from cutefa.mods.api import mod_spec

B, SQ, SK, HQ, HKV = 2, 256, 256, 4, 2


def _explain(head_dim=128, causal=False, target="sm_90a", dtype="bf16", **kw):
    return dispatch.explain_problem(
        target=target, dtype=dtype, head_dim=head_dim, causal=causal, seqlen_q=SQ, seqlen_k=SK, batch=B,
        heads_q=HQ, heads_kv=HKV, **kw,
    )  # fmt: skip


def _q(head_dim=128):
    return torch.empty(B, SQ, HQ, head_dim, dtype=torch.bfloat16, device="meta")


def _backward_spec(q, causal, mods, block_sparse, target="sm_90a"):
    return mod_spec(q, causal, mods, block_sparse, target, "bwd")


def _line(text, start):
    found = [line.strip() for line in text.splitlines() if line.strip().startswith(start)]
    assert len(found) == 1, text
    return found[0]


@pytest.mark.parametrize("causal", [False, True])
def test_names_the_mods_and_the_kernels_the_call_runs(causal):
    docs = random_docs(B, SQ, 3)
    table = torch.randn(HQ, 2 * SK - 1)
    score_mod, mask_mod = relative_bias(table, SK), document_mask(docs)
    text = _explain(causal=causal, score_mod=score_mod, mask_mod=mask_mod)
    mods = trace_mods(score_mod, mask_mod)
    assert mods.describe() in text.splitlines()
    assert f"mods {mods.short_key}: score_mod add(score, load(h, " in text
    assert "mask_mod eq(load(b, q_idx), load(b, kv_idx)) (2 captured tensor(s))" in text
    fwd = mod_spec(_q(), causal, mods, False, "sm_90a")
    bwd = _backward_spec(_q(), causal, mods, False)
    assert fwd.arch == "sm90" and bwd.arch == "sm80"  # the sm90 forward, the sm80 backward
    assert _line(text, "chosen:") == f"chosen: {fwd.name} (family sm90, compiled for sm_90a)"
    assert fwd.name.endswith(f"_mod{mods.short_key}") and (fwd.name.find("_causal_") > 0) == causal
    assert _line(text, "backward:") == f"backward: {bwd.name} (family sm80)"
    # the table read per score bounds the key blocks at 64 (cutefa.mods.base.MOD_TILE_N)
    assert fwd.tile_n == 64 and "128x64 forward" in _line(text, "why:") and "read per score" in text
    assert _line(text, "sm80:") == "sm80: the sm90 forward fuses the mods on sm_90a"
    assert "block mask" not in text


def test_block_mask_names_the_block_sparse_kernels_and_lends_its_mask_mod():
    mask_mod = prefix_lm(40)
    block_mask = create_block_mask(mask_mod, None, None, SQ, SK, device="cpu")
    text = _explain(block_mask=block_mask)
    mods = trace_mods(None, mask_mod)
    assert mods.describe() in text.splitlines()
    fwd = mod_spec(_q(), False, mods, True, "sm_90a")
    assert _line(text, "chosen:").startswith(f"chosen: {fwd.name} ")
    assert _line(text, "chosen:").split()[1].endswith(f"_mod{mods.short_key}_bsparse")
    assert fwd.tile_n == 128 and "read per score" not in text  # prefix-LM reads nothing: the dense tile
    assert _line(text, "backward:") == f"backward: {_backward_spec(_q(), False, mods, True).name} (family sm80)"
    assert _line(text, "block mask:").startswith("block mask: key blocks the mask_mod empties are skipped")


def test_padded_head_dim():
    """hd80: the forward pads its tile to 96 columns; the backward is the call's."""
    text = _explain(head_dim=80, target="sm_80", mask_mod=prefix_lm(8))
    mods = trace_mods(None, prefix_lm(8))
    assert _line(text, "chosen:").split()[1] == mod_spec(_q(80), False, mods, False, "sm_80").name
    assert "head dim 80 computed on tiles 96 columns wide" in text
    assert _line(text, "backward:") == f"backward: {_backward_spec(_q(80), False, mods, False, 'sm_80').name} (family sm80)"
    assert "rejected:" not in text  # sm_80 runs no other family


def test_other_families_of_the_target_are_rejected():
    text = _explain(target="sm_100a", mask_mod=prefix_lm(8))
    assert _line(text, "sm100:") == "sm100: no sm100 forward template fuses score_mod/mask_mod yet"
    assert "(family sm80, compiled for sm_100a)" in _line(text, "chosen:")


@pytest.mark.parametrize(
    "kw",
    [
        {"local": True},
        {"features": dispatch.Features(softcap=True)},
        {"features": dispatch.Features(varlen=True)},
    ],
    ids=["window", "softcap", "varlen"],
)
def test_mods_with_builtin_features_have_no_kernel(kw):
    text = _explain(mask_mod=prefix_lm(8), **kw)
    assert trace_mods(None, prefix_lm(8)).describe() in text
    assert _line(text, "no kernel:").startswith(
        "no kernel: score_mod/mask_mod take 16-bit inputs without window_size"
    )
    assert "chosen:" not in text


def test_fp8_has_no_mod_kernel():
    text = _explain(dtype="e4m3", mask_mod=prefix_lm(8))
    assert "no kernel: score_mod/mask_mod take 16-bit inputs" in text


def test_errors_are_the_calls():
    def branchy(score, b, h, q_idx, kv_idx):
        if score > 0:  # control flow on a traced value
            return score
        return -score

    with pytest.raises(ModTraceError, match="test_explain_mods.py"):
        _explain(score_mod=branchy)
    with pytest.raises(TypeError, match="block_mask must come from cutefa.create_block_mask"):
        _explain(block_mask=object())


def test_dispatch_picks_the_mod_kernels_as_the_call_does():
    """explain names the kernels the call fuses its mods into (one choice: cutefa.mods.base)."""
    from cutefa.mods.base import mod_arch, mod_base

    assert (mods_api.mod_arch, mods_api.mod_base) == (mod_arch, mod_base)
    for target, fwd_arch in (("sm_80", "sm80"), ("sm_90a", "sm90"), ("sm_100a", "sm80")):
        assert (mod_arch(target, "fwd"), mod_arch(target, "bwd")) == (fwd_arch, "sm80")
        for direction in ("fwd", "bwd"):
            assert mod_base(target, "fp16", 96, True, direction).arch == mod_arch(target, direction)
            assert mod_base(target, "fp16", 96, True, direction).tile_n <= 64
        text = dispatch.explain_problem(
            target=target, dtype=torch.float16, head_dim=96, causal=True, seqlen_q=SQ, seqlen_k=SK, batch=B,
            heads_q=HQ, heads_kv=HKV, score_mod=lambda s, b, h, qi, ki: s * 0.5,
        )
        for direction in ("fwd", "bwd"):
            base = mod_base(target, "fp16", 96, True, direction, reads_per_score=False)
            assert base.name in text, (direction, text)


def test_without_mods_nothing_changes():
    text = _explain()
    assert "mods " not in text and "score_mod" not in text
    assert _line(text, "chosen:").split()[1].startswith("cutefa_sm90_fwd_bf16_hd128_")


def test_the_public_explain_names_the_mod():
    import torch

    import cutefa

    q = torch.empty(1, 256, 4, 128, dtype=torch.bfloat16, device="meta")

    def bias(score, b, h, qi, ki):
        return score + (qi - ki) * 0.01

    text = cutefa.explain(q, q, q, target="sm_90a", score_mod=bias)
    plain = cutefa.explain(q, q, q, target="sm_90a")
    assert "mod" in text and text != plain
