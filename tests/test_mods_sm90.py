"""User mods fused into the sm90 forward (CPU): which family each target's call runs, the key-block
bound per register pressure, and the rendered source (the mods on every key block, the block mask's
ranges, the arguments in the documented order, dense sm90 sources unchanged)."""

from __future__ import annotations

import re

import pytest
import torch
from test_mods_examples import document_mask, prefix_lm, random_docs, relative_bias, softcap_mod

from cutefa.codegen import render_source
from cutefa.model.defaults import default_spec
from cutefa.model.options import Scheduler
from cutefa.mods import create_block_mask, trace_mods
from cutefa.mods.base import mod_arch, mod_base, mod_tile_n
from cutefa.mods.variant import ModVariantSpec


def _bias_docs():
    return trace_mods(
        relative_bias(torch.zeros(4, 127), 64), document_mask(torch.zeros(2, 64, dtype=torch.int32))
    )


def test_each_target_picks_its_family():
    assert mod_arch("sm_90a") == "sm90" and mod_arch("sm_90a", "bwd") == "sm80"
    for target in ("sm_80", "sm_86", "sm_89", "sm_100a", "sm_120a"):
        assert mod_arch(target) == mod_arch(target, "bwd") == "sm80"
    fwd = mod_base("sm_90a", "bf16", 128, True)
    assert fwd.arch == "sm90" and fwd.direction == "fwd" and fwd.causal
    assert mod_base("sm_90a", "bf16", 128, True, "bwd").arch == "sm80"
    assert mod_base("sm_80", "fp16", 64, False).arch == "sm80"


def test_the_key_blocks_follow_the_reads_per_score():
    bias_docs, capped, docs = (
        _bias_docs(),
        trace_mods(softcap_mod(), prefix_lm(16)),
        trace_mods(None, document_mask(torch.zeros(2, 64, dtype=torch.int32))),
    )
    assert bias_docs.reads_per_score()  # table[h, q_idx - kv_idx + ...]: one load per score
    assert not capped.reads_per_score() and not docs.reads_per_score()  # docs: a read per row and per key
    assert mod_tile_n("sm90", True) == 64 and mod_tile_n("sm90", False) == 128
    for head_dim in (64, 96, 128, 192, 256):
        dense = default_spec("sm90", "fwd", "bf16", head_dim)
        light = mod_base("sm_90a", "bf16", head_dim, False, reads_per_score=False)
        heavy = mod_base("sm_90a", "bf16", head_dim, False, reads_per_score=True)
        assert light.tile_n == min(dense.tile_n, 128) and heavy.tile_n == min(dense.tile_n, 64)
        assert (light.tile_m, light.options) == (dense.tile_m, dense.options)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_sm90_mod_kernels_render_for_every_default_head_dim(head_dim, dtype):
    traced = trace_mods(softcap_mod(), prefix_lm(5))
    for causal in (False, True):
        base = mod_base("sm_90a", dtype, head_dim, causal, reads_per_score=traced.reads_per_score())
        for sparse in (False, True):
            spec = ModVariantSpec(base, traced, block_sparse=sparse)
            source = render_source(spec)
            compile(source, "sm90 mod kernel", "exec")
            assert f'FAKE_SPEC_NAME = "{base.name}"' in source and "def fake_arguments(" in source
            assert ("n_first = mBlockRanges[batch, head, m_block, 0]" in source) == sparse
            assert "tanh_approx(" in source


def test_sm90_source_fuses_the_mods_on_every_key_block():
    traced = _bias_docs()
    base = mod_base("sm_90a", "bf16", 128, True, reads_per_score=True)
    for sparse in (False, True):
        source = render_source(ModVariantSpec(base, traced, block_sparse=sparse))
        calls = re.findall(
            r"mod_scores\(\n\s+s_mn, cS_mn, mask_row0, n \* TILE_N, [^\n]+\n\s+([^\n]+)\n", source
        )
        # the last block, the masked and the unmasked ones (and a block mask's left edge)
        assert len(calls) == (4 if sparse else 3), source
        # (clamp keys, mask): without a block mask the mask_mod runs on every block
        flags = [c.split(",")[0].strip() for c in calls]
        unmasked = flags.count("False")
        assert unmasked == (1 if sparse else 0) and flags.count("True") == len(calls) - unmasked
        assert "Float32(LOG2_E)" in source and "softmax_scale * LOG2_E" not in source
        assert "softmax_scale,  # the mods' scale of q.k" in source
        signature = source[source.index("def __call__(") : source.index("stream: cuda.CUstream")]
        names = re.findall(r"^\s+(\w+): ", signature, re.MULTILINE)
        tail = ["mBlockRanges"] * sparse + ["mod_t0", "mod_t1"]
        assert names[-len(tail) :] == tail and names[5] == "softmax_scale"


def test_a_persistent_sm90_mod_kernel_takes_the_sm_count_last():
    base = mod_base("sm_90a", "bf16", 128, False).replace(scheduler=Scheduler.PERSISTENT)
    source = render_source(ModVariantSpec(base, _bias_docs(), block_sparse=True))
    signature = source[source.index("def __call__(") : source.index("stream: cuda.CUstream")]
    names = re.findall(r"^\s+(\w+): ", signature, re.MULTILINE)
    assert names[-4:] == ["mBlockRanges", "mod_t0", "mod_t1", "num_ctas"]
    fake = source[source.index("def fake_arguments(") :]
    assert fake.index("block ranges") < fake.index("a captured tensor") < fake.index("the grid size")


def test_dense_sm90_sources_are_unchanged_by_the_mods_context():
    for causal in (False, True):
        source = render_source(default_spec("sm90", "fwd", "bf16", 128, causal=causal))
        assert "mod_scores" not in source and "FAKE_SPEC_NAME" not in source and "mBlockRanges" not in source
        assert "def fake_arguments(" not in source


def test_the_call_runs_the_sm90_forward_on_sm_90a(monkeypatch):
    """On sm_90a the forward kernel is the sm90 one, with the same arguments as the sm80 one."""
    import cutefa.mods.api as api

    calls = []
    monkeypatch.setattr(api, "validate_inputs", lambda *a, **kw: None)
    monkeypatch.setattr(api.dispatch, "device_target", lambda device: ("sm_90a", "test"))
    monkeypatch.setattr(
        api, "get_kernel", lambda spec, target: lambda *args: calls.append((spec, target, args))
    )
    monkeypatch.setattr(api, "call_on", lambda device, kernel, *args: kernel(*args))
    q = torch.zeros(2, 300, 4, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(2, 200, 2, 128, dtype=torch.bfloat16)
    doc = random_docs(2, 300, 3)
    bm = create_block_mask(document_mask(doc), 2, None, 300, 200, device="cpu")
    api.attention_with_mods(q, k, v, None, False, None, None, bm)
    ((spec, target, args),) = calls
    assert spec.arch == "sm90" and target == "sm_90a" and spec.block_sparse and spec.tile_n == 128
    ranges, ids = args[6:]
    assert torch.equal(ranges, bm.ranges(spec.tile_m, spec.tile_n, False, 2, 4)) and ranges.shape[2] == 3
    assert torch.equal(ids, doc)
