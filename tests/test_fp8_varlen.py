"""The e4m3 forward on packed sequences (cutefa.api.fp8.fp8_varlen_forward) on the CPU: argument
checks that name the argument, the variants dispatch takes (the sm90 e4m3 template's varlen axis,
its GRID scheduler and per-(sequence, kv head) descales only), the kernel's calling convention
(cutefa.api.features) as the API passes it, and the rows of no sequence 0 / -inf."""

from __future__ import annotations

import math

import pytest
import torch
from cpu_support import pretend_h200, reference, replace_in

import cutefa
from cutefa import codegen, dispatch
from cutefa.api import fp8 as fp8_api
from cutefa.model.defaults import default_spec
from cutefa.model.options import Quant, Scheduler
from cutefa.model.rules import FEATURES_IMPLEMENTED, why_invalid
from cutefa.model.spec import Features

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def on_h200(monkeypatch):
    pretend_h200(monkeypatch)
    yield
    dispatch.clear_caches()


def packed(total_q=10, total_k=12, hq=4, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g) for n, h in ((total_q, hq), (total_k, hkv), (total_k, hkv)))
    return q, k, v


def e4m3(*tensors):
    return tuple(t.to(E4M3) for t in tensors)


CU_Q = torch.tensor([0, 4, 10], dtype=torch.int32)
CU_K = torch.tensor([0, 5, 12], dtype=torch.int32)


def call(q, k, v, cu_q=CU_Q, cu_k=CU_K, max_q=6, max_k=7, **kw):
    return fp8_api.fp8_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


@pytest.mark.parametrize(
    ("change", "error", "name"),
    [
        (lambda a: {**a, "q": a["q"][None]}, ValueError, "q must be 3-D"),
        (lambda a: {**a, "k": a["k"].to(torch.bfloat16)}, TypeError, "k has dtype torch.bfloat16"),
        (lambda a: {**a, "v": a["v"][:, :1]}, ValueError, "k and v must have the same shape"),
        (lambda a: {**a, "cu_q": CU_Q.long()}, TypeError, "cu_seqlens_q must have dtype torch.int32"),
        (lambda a: {**a, "cu_k": CU_K[:2]}, ValueError, "cu_seqlens_k must have 3 entries"),
        (lambda a: {**a, "cu_q": CU_Q[:0], "cu_k": CU_K[:0]}, ValueError, "cu_seqlens_q must have batch"),
        (lambda a: {**a, "seqused_q": CU_Q}, ValueError, "seqused_q must have 2 entries"),
        (lambda a: {**a, "seqused_k": CU_Q[1:].float()}, TypeError, "seqused_k must have dtype"),
        (lambda a: {**a, "max_q": -1}, ValueError, "max_seqlen_q must be >= 0"),
        (lambda a: {**a, "max_k": 7.0}, TypeError, "max_seqlen_k must be an int"),
        (lambda a: {**a, "causal": 1}, TypeError, "causal must be a bool"),
        (lambda a: {**a, "k_descale": torch.ones(2, 3)}, ValueError, r"k_descale must have shape \(\) or"),
        (
            lambda a: {**a, "q_descale": torch.ones(2, 2, dtype=torch.float64)},
            TypeError,
            "q_descale must be float32",
        ),
        (lambda a: {**a, "v_descale": torch.ones(2, 2, 3)}, NotImplementedError, "v_descale of shape"),
    ],
)
def test_validation_names_the_argument(on_h200, change, error, name):
    q, k, v = e4m3(*packed())
    args = change({"q": q, "k": k, "v": v, "cu_q": CU_Q, "cu_k": CU_K, "max_q": 6, "max_k": 7})
    q, k, v, cu_q, cu_k, max_q, max_k = (
        args.pop(n) for n in ("q", "k", "v", "cu_q", "cu_k", "max_q", "max_k")
    )
    with pytest.raises(error, match=name):
        call(q, k, v, cu_q, cu_k, max_q, max_k, **args)


def test_cuda_only():
    q, k, v = e4m3(*packed())
    with pytest.raises(ValueError, match="cutefa runs on CUDA tensors"):
        call(q, k, v)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dispatch_takes_the_varlen_variant(head_dim, causal):
    choice = dispatch.choose(
        target="sm_90a", dtype=E4M3, head_dim=head_dim, causal=causal, seqlen_q=4097, seqlen_k=4097, batch=5,
        heads_q=8, heads_kv=2, features=Features(varlen=True),
    )  # fmt: skip
    spec = choice.spec
    assert spec.dtype == "e4m3" and spec.features == Features(varlen=True) and spec.causal == causal
    assert spec.options.scheduler is Scheduler.GRID and spec.options.quant is Quant.TENSOR
    assert why_invalid(spec) is None and "_varlen" in spec.name
    # the dense twin is dispatch's default
    assert spec.replace(features=Features()) == default_spec("sm90", "fwd", "e4m3", head_dim, causal=causal)


def test_only_varlen_is_implemented_for_e4m3():
    assert FEATURES_IMPLEMENTED[("sm90", "fwd", "e4m3")] == frozenset({"varlen"})
    base = default_spec("sm90", "fwd", "e4m3", 128)
    assert "softcap" in why_invalid(base.replace(features=Features(varlen=True, softcap=True)))
    assert ("sm100", "fwd", "e4m3") not in FEATURES_IMPLEMENTED


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"scheduler": Scheduler.PERSISTENT}, "GRID scheduler only"),
        ({"quant": Quant.BLOCK}, "per-(sequence, kv head) descales"),
        ({"v_mean": True}, "no column means on a packed batch"),
    ],
)
def test_unbuilt_combinations_are_refused(options, why):
    spec = default_spec("sm90", "fwd", "e4m3", 128).replace(features=Features(varlen=True), **options)
    reason = why_invalid(spec)
    assert reason is not None and why in reason and reason.startswith("varlen with")
    assert why_invalid(spec.replace(features=Features())) is None  # the dense one is built


def test_template_takes_the_calling_convention():
    """The varlen module's entry takes the feature arguments after softmax_scale, in the order of
    cutefa.api.features, and its fake arguments have the packed layouts."""
    spec = default_spec("sm90", "fwd", "e4m3", 128, causal=True).replace(features=Features(varlen=True))
    text = codegen.render_source(spec)
    call_head = text[text.index("def __call__") : text.index("stream: cuda.CUstream")]
    names = [line.split(":")[0].strip() for line in call_head.splitlines()[2:] if ":" in line]
    assert names == [
        "mQ", "mK", "mV", "mO", "mLSE", "mQd", "mKd", "mVd", "softmax_scale",
        "mCuSeqlensQ", "mCuSeqlensK", "mSeqUsedQ", "mSeqUsedK", "max_seqlen_q",
    ]  # fmt: skip
    assert "varlen.packed_as_sdhx(mV)" in text and "mLSE[head, offset_q + row]" in text
    assert "if m_block >= 0:" in text
    dense = codegen.render_source(spec.replace(features=Features()))
    assert "varlen" not in dense and "m_block >= 0" not in dense


def _fake_kernel(calls, causal):
    """The kernel as its calling convention says: per sequence, the dequantized reference; the
    rows of no sequence 0 / -inf (the module's fill kernel, cutefa/kernels/common/varlen_fill.py)."""

    def kernel(q, k, v, out, lse, qd, kd, vd, scale, cu_q, cu_k, used_q, used_k, max_seqlen_q):
        calls.append(
            (qd.clone(), kd.clone(), vd.clone(), scale, used_q.clone(), used_k.clone(), max_seqlen_q)
        )
        assert out.dtype == torch.bfloat16 and lse.shape == (q.shape[1], q.shape[0])
        group = q.shape[1] // k.shape[1]
        no_one = torch.ones(q.shape[0], dtype=torch.bool)
        for b in range(cu_q.shape[0] - 1):
            oq, ok, nq, nk = int(cu_q[b]), int(cu_k[b]), int(used_q[b]), int(used_k[b])
            no_one[oq : oq + nq] = False
            qs = q[oq : oq + nq].float() * qd[b].repeat_interleave(group)[None, :, None]
            ks = k[ok : ok + nk].float() * kd[b][None, :, None]
            vs = v[ok : ok + nk].float() * vd[b][None, :, None]
            o, l = reference(qs[None], ks[None], vs[None], causal, scale)
            out[oq : oq + nq] = o[0].to(out.dtype)
            lse[:, oq : oq + nq] = l[0]
        out[no_one] = 0
        lse[:, no_one] = -math.inf

    return kernel


@pytest.mark.parametrize("causal", [False, True])
def test_call_passes_the_convention(on_h200, monkeypatch, causal):
    calls = []
    replace_in(monkeypatch, [fp8_api], "get_kernel", lambda spec, target: _fake_kernel(calls, causal))
    x = packed(total_q=12, total_k=14, hq=4, hkv=2)
    (qq, qd), (kq, kd), (vq, vd) = (
        cutefa.quantize_fp8(t[None], g, group=grp)
        for t, g, grp in zip(x, ("head", "head", "tensor"), (2, 1, 1))
    )
    qq, kq, vq = qq[0], kq[0], vq[0]
    qd, kd = qd.expand(2, 2).contiguous(), kd.expand(2, 2).contiguous()
    used_q = torch.tensor([3, 5], dtype=torch.int32)  # below the spans (4, 6): rows 3 and 9.. are no one's
    out, lse = call(qq, kq, vq, seqused_q=used_q, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                    return_lse=True)  # fmt: skip
    (sqd, skd, svd, scale, sent_q, sent_k, max_q) = calls[-1]
    assert scale == pytest.approx(1 / 8) and max_q == 6
    assert torch.equal(sent_q, used_q) and torch.equal(sent_k, CU_K[1:] - CU_K[:-1])  # spans where not given
    assert torch.equal(sqd, qd) and torch.equal(skd, kd) and torch.all(svd == vd)  # per tensor: broadcast
    unused = torch.tensor([3, 9, 10, 11])
    assert torch.all(out[unused] == 0) and torch.all(lse[:, unused] == -math.inf)
    assert out.shape == (12, 4, 64) and out.dtype == torch.bfloat16
    used = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8])
    assert torch.isfinite(lse[:, used]).all() and out[used].abs().sum() > 0


def test_empty_batch_launches_nothing(on_h200, monkeypatch):
    replace_in(monkeypatch, [fp8_api], "get_kernel", lambda spec, target: pytest.fail("launched"))
    q, k, v = e4m3(*packed())
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse = call(q, k, v, cu, cu, 0, 0, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_the_varlen_entry_routes_e4m3_and_refuses_what_it_lacks():
    import cutefa

    q = torch.zeros(10, 2, 64, dtype=torch.float8_e4m3fn)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="window_size, softcap"):
        cutefa.flash_attn_varlen_func(q, q, q, cu, cu, 10, 10, window_size=(4, 0), softcap=5.0)
    with pytest.raises(NotImplementedError, match="sinks"):
        cutefa.flash_attn_varlen_func(q, q, q, cu, cu, 10, 10, sinks=torch.zeros(2))
