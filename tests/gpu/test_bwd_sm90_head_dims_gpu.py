"""The sm90 backward (templates/bwd_sm90.py.j2) at head dims of its own on a Hopper GPU: 80 and 112
(Phi-2, StableLM, InternViT; committed) and 32, 48 (rendered on demand), unpadded (32-byte swizzle
atoms at 80/112/48, dQ split 64 + 16 / 96 + 16 between the consumers).

Each default variant called directly with the calling convention of cutefa/api/backward.py
(tests/gpu/test_bwd_gqa.py's harness: dq, dk, dv and every workspace NaN-poisoned beforehand, so an
element the kernel does not write fails), O and the LSE from the float32 reference forward;
gradients judged against float32 autograd of the exact attention, at most 3x the error of the same
attention computed in the input dtype (+1e-3): lengths 1, 17, 1000, seqlen_q != seqlen_k both ways,
MHA and GQA 8/2, causal and not, deterministic off and on; deterministic=1 bitwise repeatable.
Through the public API: dispatch runs the sm90 backward for these head dims (the sm80 backward for
a multiple of 8 that is not one of 16), dense and packed (varlen, with a window and softcap).

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_bwd_sm90_head_dims_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import hopper_skip_reason
from gpu_support import load_sibling as _load

from cutefa.model.defaults import default_spec

bwd90 = _load("test_bwd_sm90")
feat = _load("test_sm90_bwd_features")
ref = _load("reference")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(hopper_skip_reason() is not None, reason=str(hopper_skip_reason())),
]

# (dtype, head_dim): both dtypes at the committed 80 and 112, bf16 at 32 and 48
HEAD_DIMS = [("bf16", 80), ("fp16", 80), ("bf16", 112), ("fp16", 112), ("bf16", 32), ("bf16", 48)]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): lengths 1, 17, 1000, sq != sk both ways, MHA and
# GQA 8/2, several key and query blocks with partial last ones
SHAPES = (
    (1, 1, 1, 2, 2),
    (2, 17, 17, 8, 2),
    (1, 1000, 1000, 2, 2),
    (1, 1000, 1000, 8, 2),
    (1, 17, 1000, 8, 2),
    (1, 1000, 17, 2, 2),
    (2, 333, 257, 8, 2),
    (1, 1, 1000, 8, 2),
)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def target():
    from cutefa.dispatch import current_target

    return current_target()


def _spec(dtype: str, head_dim: int, causal: bool):
    spec = default_spec("sm90", "bwd", dtype, head_dim, causal=causal)
    assert spec is not None and spec.head_dim == head_dim
    return spec


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("dtype", "head_dim"), HEAD_DIMS, ids=lambda x: str(x))
def test_grads_against_float32(gen, target, dtype, head_dim, causal):
    from cutefa.api import backward
    from cutefa.loader import get_kernel

    spec = _spec(dtype, head_dim, causal)
    # dispatch on this GPU picks it (no tuned table holds these head dims)
    assert backward.choose_bwd(target, TORCH_DTYPES[dtype], head_dim, causal) == spec
    kernel = get_kernel(spec, target)
    for batch, sq, sk, hq, hkv in SHAPES:
        for deterministic in (False, True):
            q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, batch, sq, sk, hq, hkv)
            got = bwd90.run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=deterministic)
            assert got[0].shape == q.shape and got[1].shape == k.shape and got[2].shape == v.shape
            where = f"{spec.name} b{batch} sq{sq} sk{sk} hq{hq} hkv{hkv} det{int(deterministic)}"
            bwd90.judge_grads(spec, where, got, q, k, v, dout)


@pytest.mark.parametrize(("dtype", "head_dim"), HEAD_DIMS[:4], ids=lambda x: str(x))
def test_deterministic_is_bitwise_repeatable(gen, target, dtype, head_dim):
    """deterministic=1, causal: two runs bitwise equal and close to the atomic mode (GQA 4/2 over
    2000 keys), and with fewer dQ splits than key blocks (32 (batch, head) pairs over 1000 keys)."""
    spec = _spec(dtype, head_dim, True)
    bwd90.check_deterministic_split(spec, target, gen)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [80, 112, 72])
def test_through_the_api(gen, head_dim, causal, monkeypatch):
    """cutefa.flash_attn_func forward and backward: the sm90 backward ran at 80 and 112, the sm80 one
    at 72 (a multiple of 8 that is not one of 16); gradients against the float32 reference, GQA 8/2,
    sq != sk."""
    import cutefa
    from cutefa import dispatch

    ran = []
    log_run = dispatch.log_run

    def logged(choice, *args):
        ran.append(choice)
        log_run(choice, *args)

    monkeypatch.setattr(dispatch, "log_run", logged)
    monkeypatch.setattr(dispatch, "_LOG_RUNS", True)  # runs are reported only while logging is on
    dtype = torch.bfloat16
    q = torch.randn(2, 300, 8, head_dim, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(2, 451, 2, head_dim, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(2, 451, 2, head_dim, generator=gen, device="cuda", dtype=dtype)
    dout = torch.randn(q.shape, generator=gen, device="cuda", dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cutefa.flash_attn_func(*leaves, causal=causal).backward(dout)
    (spec,) = [c.spec for c in ran if c.spec.direction == "bwd"]
    assert spec.arch == ("sm90" if head_dim % 16 == 0 else "sm80") and spec.head_dim == head_dim, spec.name
    got = tuple(t.grad for t in leaves)
    where = f"api hd{head_dim} causal{int(causal)}"
    bwd90.assert_grads_close(where, got, *bwd90.reference_grads(spec, q, k, v, dout))


PACKED = [
    feat.Case((1, 17, 1000, 0), (1, 17, 1000, 0), heads_q=8, heads_kv=2),
    feat.Case((17, 0, 1000), (40, 5, 700), heads_q=8, heads_kv=2, causal=True, slack=3),
    feat.Case((1000, 17), (1000, 33), heads_q=8, heads_kv=2, softcap=30.0, window=(128, 0), causal=True),
]


@pytest.mark.parametrize("head_dim", [80, 112])
@pytest.mark.parametrize("case", PACKED, ids=feat._id)
def test_packed_gradients(case, head_dim):
    """flash_attn_varlen_func (with the dLSE term) on the sm90 backward's packed kernel at these head
    dims: rows of no sequence zero, the others within 3x the bf16 reference's error."""
    dtype = torch.bfloat16
    p = feat._problem(case, dtype, head_dim)
    spec = feat._spec_for(case, p)
    assert spec.arch == "sm90" and spec.features.varlen and spec.head_dim == head_dim, spec.name
    got = feat._run(case, p)
    want = feat._reference(case, p, torch.float32)
    low = feat._reference(case, p, dtype)
    rows_q = ref.used_rows(p.cu_q, p.used_q, p.q.shape[0], "cuda")
    rows_k = ref.used_rows(p.cu_k, p.used_k, p.k.shape[0], "cuda")
    for name, g, w, lo, rows in zip(["dq", "dk", "dv"], got, want, low, (rows_q, rows_k, rows_k)):
        assert (g[~rows] == 0).all(), f"{name}: rows of no sequence must be zero"
        feat._check(name, g, w, lo, rows, dtype)
    first = feat._run(case, p, deterministic=True)
    second = feat._run(case, p, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
