"""The API of calls with features on the CPU: argument checks that name the argument, the mask
options, dispatch of feature problems, the fake implementations, and the sinks gradient's formula
against autograd."""

from __future__ import annotations

import math

import pytest
import torch

import cutefa
from cutefa import dispatch
from cutefa.api import feature_bwd, feature_ops, validate
from cutefa.api.check_lengths import assert_lengths_async
from cutefa.api.features import UNBOUNDED, FeatureArgs
from cutefa.api.validate_features import mask_options, validate_varlen
from cutefa.model.options import Mask
from cutefa.model.spec import Features


@pytest.fixture
def cpu_ok(monkeypatch):
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))


def packed(total_q=10, total_k=12, hq=4, hkv=2, d=64, dtype=torch.bfloat16):
    q = torch.randn(total_q, hq, d, dtype=dtype)
    k = torch.randn(total_k, hkv, d, dtype=dtype)
    v = torch.randn(total_k, hkv, d, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    ("causal", "window", "expected"),
    [
        (False, (-1, -1), (False, -1, -1)),
        (True, (-1, -1), (True, -1, -1)),
        (False, (-1, 0), (True, -1, -1)),  # flash-attn: (-1, 0) is the causal mask
        (False, (None, None), (False, -1, -1)),
        (True, (128, -1), (True, 128, 0)),  # causal caps the right side
        (True, (128, 5), (True, 128, 0)),
        (False, (4, 4), (False, 4, 4)),
        (False, (0, 0), (False, 0, 0)),  # only the diagonal
        (False, (-1, 7), (False, -1, 7)),
    ],
)
def test_mask_options(causal, window, expected):
    assert mask_options(causal, window) == expected


@pytest.mark.parametrize("window", [(-2, 0), (1.5, 0), "ab", (1, 2, 3), (True, 0)])
def test_bad_windows_name_window_size(window):
    with pytest.raises((TypeError, ValueError), match="window_size"):
        mask_options(False, window)


def test_window_bounds_for_the_kernel():
    f = FeatureArgs(window=(-1, 3))
    assert f.window_bounds(False) == (UNBOUNDED, 3)
    assert f.window_bounds(True) == (UNBOUNDED, 0)
    assert FeatureArgs(window=(5, -1)).window_bounds(False) == (5, UNBOUNDED)
    assert f.mask(False) is Mask.LOCAL and FeatureArgs().mask(True) is Mask.CAUSAL


def test_kernel_args_order():
    cu = torch.zeros(3, dtype=torch.int32)
    slopes, sinks = torch.zeros(2, 4), torch.zeros(4)
    f = FeatureArgs(cu, cu, cu[1:], cu[1:], 17, 19, (8, -1), 30.0, slopes, sinks)
    args = f.kernel_args(causal=True)
    assert args[:4] == (cu, cu, f.seqused_q, f.seqused_k) and args[4] == 17
    assert args[5:7] == (8, 0) and args[7] == 30.0 and args[8] is slopes and args[9] is sinks
    assert f.features() == Features(varlen=True, softcap=True, alibi=True, sinks=True)
    assert feature_bwd.backward_features(f) == Features(varlen=True, softcap=True, alibi=True)
    assert FeatureArgs().kernel_args(False) == ()


def test_varlen_validation_names_the_argument(cpu_ok):
    q, k, v = packed()
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    ok = (q, k, v, cu_q, cu_k, 6, 7, None, None, False, None, False)
    assert validate_varlen(*ok) == 2
    cases = [
        ((q, k, v, cu_q.long(), cu_k, 6, 7, None, None, False, None, False), TypeError, "cu_seqlens_q.*int32"),
        ((q, k, v, cu_q, cu_k[:2], 6, 7, None, None, False, None, False), ValueError, "cu_seqlens_k must have 3"),
        ((q, k, v, cu_q, cu_k, 6, 7, cu_q, None, False, None, False), ValueError, "seqused_q must have 2"),
        ((q, k, v, cu_q, cu_k, -1, 7, None, None, False, None, False), ValueError, "max_seqlen_q"),
        ((q, k, v, cu_q, cu_k, 6, 7.0, None, None, False, None, False), TypeError, "max_seqlen_k"),
        ((q[None], k, v, cu_q, cu_k, 6, 7, None, None, False, None, False), ValueError, "q must be 3-D"),
        ((q, k, v, cu_q.view(1, 3), cu_k, 6, 7, None, None, False, None, False), ValueError, "cu_seqlens_q must be 1-D"),
        ((q, k, v, cu_q, cu_k, 6, 7, None, None, 1, None, False), TypeError, "causal"),
        ((q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1), cu_q, cu_k, 6, 7, None, None, False, None, False),
         ValueError, "multiple of k/v's heads"),
        ((q.float(), k, v, cu_q, cu_k, 6, 7, None, None, False, None, False), TypeError, "q has dtype"),
    ]  # fmt: skip
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            validate_varlen(*args)


def test_varlen_lengths_checked_on_the_device_without_sync():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    assert_lengths_async(cu, None, 5, 3, "q")  # an empty sequence is fine
    assert_lengths_async(cu, torch.tensor([2, 0, 1], dtype=torch.int32), 5, 3, "q")
    bad = [
        (torch.tensor([0, 3, 2, 5], dtype=torch.int32), None, 5, 3),  # decreasing
        (cu, None, 4, 3),  # past the packed rows
        (cu, None, 5, 2),  # a sequence longer than max_seqlen
        (cu, torch.tensor([4, 0, 1], dtype=torch.int32), 5, 4),  # seqused past its span
    ]
    for cu_, used, total, max_seqlen in bad:
        with pytest.raises(RuntimeError, match="cu_seqlens_k"):
            assert_lengths_async(cu_, used, total, max_seqlen, "k")


def test_varlen_lengths_checked_once_per_tensor_and_version(monkeypatch):
    """The device check runs again only for another tensor object, an in-place write, other bounds,
    or while a CUDA graph is captured; a tensor equal to a checked one but new is checked."""
    from cutefa.api import check_lengths

    runs = []
    monkeypatch.setattr(torch, "_assert_async", lambda ok, msg: runs.append(bool(ok)))
    monkeypatch.setattr(check_lengths, "_CHECKED", {})
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    used = torch.tensor([2, 0, 1], dtype=torch.int32)
    assert_lengths_async(cu, None, 5, 3, "q")
    assert_lengths_async(cu, None, 5, 3, "k")  # self-attention: the same tensor for q and k
    assert len(runs) == 1
    assert_lengths_async(cu, None, 6, 3, "k")  # other packed rows
    assert_lengths_async(cu, used, 5, 3, "q")  # with seqused
    assert_lengths_async(cu, used, 5, 3, "q")
    assert len(runs) == 3
    cu[2] = 4  # an in-place write: checked again (spans 3, 1, 1)
    assert_lengths_async(cu, None, 5, 3, "q")
    used.add_(0)  # seqused written (a no-op write still counts)
    assert_lengths_async(cu, used, 5, 3, "q")
    assert_lengths_async(cu.clone(), None, 5, 3, "q")  # equal values, another tensor
    assert len(runs) == 6 and all(runs)
    monkeypatch.setattr(check_lengths, "_capturing", lambda t: True)
    assert_lengths_async(cu, None, 5, 3, "q")
    assert_lengths_async(cu, None, 5, 3, "q")
    assert len(runs) == 8  # during a capture every call is part of the graph
    monkeypatch.setattr(check_lengths, "_capturing", lambda t: False)
    for n in range(check_lengths.CHECKED_KEPT + 4):  # the memo stays bounded
        assert_lengths_async(torch.tensor([0, n], dtype=torch.int32), None, 100, 100, "q")
    assert len(check_lengths._CHECKED) <= check_lengths.CHECKED_KEPT


def test_plain_eager_varlen_calls_skip_the_op_and_gradients_keep_it(cpu_ok, monkeypatch):
    """A varlen call with nothing to differentiate runs the op's implementation directly; one whose
    inputs require gradients goes through the op (its autograd)."""
    ran = []

    def impl(q, k, v, *rest):
        ran.append("impl")
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(feature_ops, "attn_fwd_impl", impl)
    monkeypatch.setattr(feature_ops, "attn_fwd", lambda *a: (ran.append("op"), impl(*a))[1])
    q, k, v = packed(total_q=12)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    cutefa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    assert ran == ["impl"]
    ran.clear()
    cutefa.flash_attn_varlen_func(q.requires_grad_(), k, v, cu, cu, 7, 7)
    assert ran == ["op", "impl"]
    ran.clear()
    with torch.no_grad():  # gradients off: nothing to differentiate
        cutefa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    assert ran == ["impl"]


def test_feature_arguments_checked(cpu_ok):
    q, k, v = (torch.randn(2, 8, 4, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="softcap"):
        cutefa.flash_attn_func(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        cutefa.flash_attn_func(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="sinks must have shape"):
        cutefa.flash_attn_func(q, k, v, sinks=torch.ones(2, 4))
    with pytest.raises(TypeError, match="sinks must be a float"):
        cutefa.flash_attn_func(q, k, v, sinks=torch.ones(4, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        cutefa.flash_attn_func(q, k, v, 0.1, None, False, (4, 4))
    with pytest.raises(NotImplementedError, match="fp8"):
        cutefa.flash_attn_func(q, k, v, window_size=(4, 4), q_descale=torch.ones(()))


def _sm90_choice(**changes):
    problem = dict(
        target="sm_90a", dtype="bf16", head_dim=128, causal=True, seqlen_q=4096, seqlen_k=4096, batch=4,
        heads_q=16, heads_kv=16, gpu_name="NVIDIA H100 80GB HBM3",
    )  # fmt: skip
    problem.update(changes)
    return dispatch.choose(**problem)


def test_feature_problems_dispatch_the_dense_variant_with_the_features():
    dense = _sm90_choice().spec
    for local, features in [(True, Features()), (False, Features(varlen=True)),
                            (True, Features(varlen=True, softcap=True, alibi=True, sinks=True))]:  # fmt: skip
        spec = _sm90_choice(local=local, features=features).spec
        assert spec.features == features
        assert spec.mask is (Mask.LOCAL if local else Mask.CAUSAL)
        assert spec.arch == "sm90" and spec.head_dim == dense.head_dim
    text = dispatch.explain_problem(
        target="sm_90a", dtype="bf16", head_dim=128, causal=False, seqlen_q=300, seqlen_k=300, batch=64,
        heads_q=8, heads_kv=2, features=Features(varlen=True),
    )  # fmt: skip
    assert "varlen: 64 sequences, max_seqlen_q=300" in text and "chosen: cutefa_sm90_fwd_bf16_hd128" in text


def test_paged_problem_has_no_kernel_and_says_why():
    with pytest.raises(NotImplementedError, match="paged"):
        _sm90_choice(features=Features(paged_kv=True))


def test_backward_with_features_passes_over_families_without_them():
    f = FeatureArgs(window=(64, 0), softcap=30.0)
    spec = feature_bwd.choose_bwd("sm_90a", torch.bfloat16, 128, True, f, seqlen_k=2048, gpu_name="H100")
    # the sm90 default backward template takes the window and softcap
    assert spec.arch == "sm90" and spec.mask is Mask.LOCAL and spec.features.softcap and spec.direction == "bwd"
    # its head-dim split template (head dim 256) takes none: the sm80 family's backward serves
    split = feature_bwd.choose_bwd("sm_90a", torch.bfloat16, 256, True, f, seqlen_k=2048, gpu_name="H100")
    assert split.arch == "sm80" and split.mask is Mask.LOCAL and split.direction == "bwd"
    sinks_only = feature_bwd.choose_bwd(
        "sm_90a", torch.bfloat16, 128, False, FeatureArgs(sinks=torch.zeros(4)), seqlen_k=2048
    )
    assert sinks_only.arch == "sm90" and not sinks_only.features.any  # sinks need no backward kernel


def test_fake_implementations_give_the_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = packed(total_q=33, total_k=40, hq=8, hkv=2, d=128)
        cu = torch.zeros(4, dtype=torch.int32)
        out, lse = feature_ops.attn_fwd(
            q, k, v, cu, cu, None, None, 20, 20, True, 0.1, -1, -1, 0.0, None, torch.zeros(8), False
        )
        assert out.shape == q.shape and lse.shape == (8, 33) and lse.dtype == torch.float32
        dense_q = torch.randn(2, 17, 8, 64, dtype=torch.float16)
        dense_k = torch.randn(2, 29, 2, 64, dtype=torch.float16)
        out, lse = feature_ops.attn_fwd(
            dense_q, dense_k, dense_k, None, None, None, None, 17, 29, False, 0.1, 16, 16, 30.0, None, None, False
        )
        assert out.shape == dense_q.shape and lse.shape == (2, 8, 17)
        grads = feature_ops.attn_bwd(
            out, dense_q, dense_k, dense_k, out, lse, None, None, None, None, None, 17, 29, False, 0.1, 16, 16,
            30.0, None, torch.zeros(8), False,
        )  # fmt: skip
        assert [g.shape for g in grads] == [dense_q.shape, dense_k.shape, dense_k.shape, (8,)]


def _attention_with_sinks(q, k, v, sinks):
    """float64 reference: (b, s, h, d) with one sink logit per head."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    sink = sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
    full = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


@pytest.mark.parametrize("varlen", [False, True])
def test_sink_gradient_formula_matches_autograd(varlen):
    torch.manual_seed(0)
    b, s, h, d = 2, 5, 3, 8
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True)
    out, lse = _attention_with_sinks(q, k, v, sinks)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    # D = rowsum(dO * O) - dlse, as the backward kernels' preprocess writes it (lse's layout)
    dpsum = (dout * out.detach()).sum(-1).permute(0, 2, 1) - dlse
    if varlen:  # packed: lse and D (h, total)
        got = feature_ops.sink_grad(
            sinks.detach(), lse.detach().permute(1, 0, 2).reshape(h, b * s), dpsum.permute(1, 0, 2).reshape(h, b * s),
            True,
        )  # fmt: skip
    else:
        got = feature_ops.sink_grad(sinks.detach(), lse.detach(), dpsum, False)
    torch.testing.assert_close(got.double(), sinks.grad, rtol=1e-5, atol=1e-6)
