"""Grouped-query attention in the sm90-family backward on a Hopper GPU: a kv head's dK and dV summed
over its query heads in float32 inside the kernels (templates/bwd_sm90*.py.j2,
cutefa/kernels/sm90/bwd_dkv.py) and written once, shaped like k.

Every dispatchable sm90 backward variant (generated/: the defaults and the tuned tables' picks, head
dims 64 to 256, causal and not, all three partitions) is called directly with the calling convention
of cutefa/api/backward.py (:func:`run_kernel`: dq, dk, dv and every workspace poisoned with NaN
beforehand, so a word the kernels do not write or zero fails) at group sizes 1, 2, 4, 8, 16 and
MQA, ragged lengths, seqlen_q != seqlen_k both ways, and judged against float32 autograd of the
exact attention with the tolerance of tests/gpu/test_bwd_sm90.py (3x PyTorch's own error on the
same low-precision inputs). Deterministic mode: two runs bitwise equal, also where each CTA walks
several key blocks. Accuracy: the grouped dK/dV error is no worse than the error of the same
problem run as multi-head attention (k and v repeated per query head), and no worse than what the
former path gave (those per-query-head dK/dV rounded to 16 bits, then summed). The API path
(backward.gradients and flash_attn_func's autograd, a Llama-like 8 query / 2 kv heads step) too.

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_bwd_gqa.py``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from gpu_support import hopper_skip_reason as _skip_reason
from gpu_support import load_sibling as _load

bwd80 = _load("test_bwd_sm80")
bwd90 = _load("test_bwd_sm90")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


def _dispatchable():
    from cutefa.model.committed import default_variants

    return default_variants("sm90", "bwd")


VARIANTS = _dispatchable()
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): group sizes 1, 2, 4, 8, 16 and MQA (one kv head),
# ragged lengths, seqlen_q != seqlen_k both ways, several key blocks and a partial last one.
GQA_SHAPES = (
    (2, 257, 257, 2, 2),  # group 1: dK/dV by the direct store, no workspace
    (1, 300, 1000, 4, 2),  # group 2
    (2, 1000, 333, 8, 2),  # group 4
    (1, 129, 200, 16, 2),  # group 8
    (1, 513, 513, 16, 1),  # group 16, MQA
    (1, 17, 4097, 6, 1),  # MQA, one short query block over many key blocks
    (1, 1, 1, 4, 1),  # one query, one key
)


def run_kernel(kernel, spec, q, k, v, out, lse, dout, *, deterministic=False):
    """dq, dk, dv of one sm90 backward variant, with the arguments cutefa/api/backward.py passes:
    dk and dv shaped like k, the dQ workspace, the grouped-query dK/dV workspace
    (:func:`cutefa.api.backward.sm90_dkv_workspace`: the dQ workspace in its place with one query
    head per kv head). Every output and workspace is NaN beforehand: the kernels must write or zero
    each word they read back."""
    from cutefa.api.backward import dq_accum_workspace, dq_splits, sm90_dkv_workspace

    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = dq_splits(deterministic, batch, heads_q, seqlen_k, spec.tile_n, sm_count)
    nan = math.nan
    dq, dk, dv = torch.full_like(q, nan), torch.full_like(k, nan), torch.full_like(v, nan)
    f32 = {"dtype": torch.float32, "device": q.device}
    dq_accum = dq_accum_workspace(spec, splits, batch, seqlen_q, heads_q, q.device).fill_(nan)
    dkv_accum = sm90_dkv_workspace(spec, deterministic, batch, seqlen_k, heads_q, heads_kv, dq_accum).fill_(
        nan
    )
    lse_log2 = torch.full((batch, heads_q, seqlen_q), nan, **f32)
    dpsum = torch.full((batch, heads_q, seqlen_q), nan, **f32)
    dlse = torch.zeros((batch, heads_q, seqlen_q), **f32)
    kernel(
        q, k, v, out, dout, lse.contiguous(), dlse, dq, dk, dv, dq_accum, dkv_accum, lse_log2, dpsum,
        1.0 / math.sqrt(head_dim), int(deterministic),
    )  # fmt: skip
    return dq, dk, dv


@pytest.fixture(scope="module")
def target():
    from cutefa.dispatch import current_target

    return current_target()


def test_every_head_dim_and_partition_is_covered():
    from cutefa.model.budgets_sm90 import sm90_bwd_head_split, sm90_bwd_swapped

    assert {s.head_dim for s in VARIANTS} == {64, 80, 96, 112, 128, 192, 256}
    assert {s.causal for s in VARIANTS} == {False, True}
    assert any(sm90_bwd_head_split(s) for s in VARIANTS) and any(sm90_bwd_swapped(s) for s in VARIANTS)


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_gqa_grads(gen, target, spec):
    """Each group size against the float32 reference; dk and dv shaped like k."""
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, target)
    for batch, sq, sk, hq, hkv in GQA_SHAPES:
        for deterministic in (False, True):
            q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, batch, sq, sk, hq, hkv)
            got = run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=deterministic)
            assert got[1].shape == k.shape and got[2].shape == v.shape
            where = f"{spec.name} b{batch} sq{sq} sk{sk} hq{hq} hkv{hkv} det{int(deterministic)}"
            bwd90.judge_grads(spec, where, got, q, k, v, dout)


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_gqa_deterministic_is_bitwise_repeatable(gen, target, spec):
    """deterministic=1 at group sizes 4 and 16: two runs bitwise equal and close to the atomic mode,
    also with 32 (batch, head) pairs over 1000 keys (fewer dQ splits than key blocks: each CTA walks
    several key blocks, each adding into its head's slot)."""
    from cutefa.api.backward import dq_splits
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, target)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    assert dq_splits(True, 2, 16, 1000, spec.tile_n, sm_count) < math.ceil(1000 / spec.tile_n)
    for batch, sq, sk, hq, hkv in ((1, 2048, 2000, 8, 2), (2, 1000, 1000, 16, 1)):
        q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, batch, sq, sk, hq, hkv)
        first = run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=True)
        second = run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=True)
        plain = run_kernel(kernel, spec, q, k, v, out, lse, dout)
        for name, a, b, c in zip(("dq", "dk", "dv"), first, second, plain):
            assert torch.isfinite(a).all(), f"{spec.name} {name}"
            assert torch.equal(a, b), f"{spec.name} hq{hq} hkv{hkv} {name}: two deterministic runs differ"
            assert bwd80.rel(a, c) < 1e-2, f"{spec.name} {name}"


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_gqa_error_no_worse_than_mha(gen, target, spec):
    """The same problem as grouped-query attention and as multi-head attention (k and v repeated per
    query head), deterministic: the grouped dK/dV's relative error against float32 autograd is no
    worse than the multi-head dK/dV's (10% slack for the random draw), and no worse than the former
    path's (the multi-head run's 16-bit dK/dV of a group summed in float32 and rounded again)."""
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, target)
    scale = 1.0 / math.sqrt(spec.head_dim)
    for batch, sq, sk, hq, hkv in ((2, 1000, 1000, 8, 2), (1, 513, 700, 16, 1)):
        group = hq // hkv
        q, k, v, dout, _, _ = bwd90.random_inputs(gen, spec, batch, sq, sk, hq, hkv)
        k_mha, v_mha = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
        exact = {}
        for name, (kk, vv) in (("gqa", (k, v)), ("mha", (k_mha, v_mha))):
            fn = functools.partial(bwd80.attention, causal=spec.causal, scale=scale)
            exact[name] = bwd80.grads(fn, q.float(), kk.float(), vv.float(), dout.float())
        out, lse = bwd90.forward_ref(q, k, v, spec.causal)
        gqa = run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=True)
        mha = run_kernel(kernel, spec, q, k_mha, v_mha, out, lse, dout, deterministic=True)
        for i, name in ((1, "dk"), (2, "dv")):
            err_gqa = bwd80.rel(gqa[i], exact["gqa"][i])
            err_mha = bwd80.rel(mha[i], exact["mha"][i])
            grouped = (batch, sk, hkv, group, gqa[i].shape[-1])  # (dv: the V head dim)
            former = mha[i].view(grouped).sum(3, dtype=torch.float32).to(q.dtype)
            err_former = bwd80.rel(former, exact["gqa"][i])
            where = f"{spec.name} hq{hq} hkv{hkv} {name}"
            assert err_gqa <= 1.1 * err_mha + 1e-5, f"{where}: GQA {err_gqa:.3g} vs MHA {err_mha:.3g}"
            assert err_gqa <= err_former * 1.01 + 1e-6, (
                f"{where}: {err_gqa:.3g} vs former path {err_former:.3g}"
            )


@pytest.mark.parametrize("spec", [s for s in VARIANTS if s.head_dim in (64, 128, 256)], ids=lambda s: s.name)
def test_gqa_through_gradients(gen, spec):
    """backward.gradients with the variant forced (the host allocates the workspaces), both modes."""
    from cutefa.api import backward

    scale = 1.0 / math.sqrt(spec.head_dim)
    q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, 2, 333, 1000, 8, 2)
    for deterministic in (False, True):
        got = backward.gradients(dout, q, k, v, out, lse, None, spec.causal, scale, deterministic, spec=spec)
        bwd90.judge_grads(spec, f"{spec.name} det{int(deterministic)}", got, q, k, v, dout)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_step_through_autograd(gen, dtype, causal, monkeypatch):
    """A training step's attention (batch 2 x 2048 tokens, 8 query / 2 kv heads, head dim 128)
    through flash_attn_func's autograd, the variant dispatch picks (logged as sm90), against the
    float32 reference: dk and dv of k's shape, errors within 3x PyTorch's own."""
    import cutefa
    from cutefa import dispatch

    ran = []
    log_run = dispatch.log_run

    def logged(choice, *args):
        ran.append(choice)
        log_run(choice, *args)

    monkeypatch.setattr(dispatch, "log_run", logged)
    monkeypatch.setattr(dispatch, "_LOG_RUNS", True)  # runs are reported only while logging is on
    q, k, v, dout = bwd80.random_inputs(gen, dtype, 128, 2, 2048, 2048, 8, 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cutefa.flash_attn_func(*leaves, causal=causal).backward(dout)
    (spec,) = [c.spec for c in ran if c.spec.direction == "bwd"]
    assert spec.arch == "sm90", spec.name
    got = [t.grad for t in leaves]
    assert got[1].shape == k.shape
    scale = 1.0 / math.sqrt(128)
    fn = functools.partial(bwd80.attention, causal=causal, scale=scale)
    exact = bwd80.grads(fn, q.float(), k.float(), v.float(), dout.float())
    base = bwd80.grads(fn, q, k, v, dout)
    bwd90.assert_grads_close(f"{spec.name} llama step", got, exact, base)
