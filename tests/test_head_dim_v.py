"""A V head dim of its own through the forward API on the CPU (issue: q/k of 192 against v of 128,
DeepSeek's prefill): what validation accepts and refuses, the output shapes of the ops' fake
implementations and of a torch.compile(fullgraph=True) trace, dispatch and ``cutefa explain``,
the call plan, and the gradients: the backward's variant (on Hopper the sm90 one, and the sm80 one
for the packed calls the sm90 template does not take; the sm80 one on every other target), its
rules, and the autograd path of both calls down to the kernel's arguments.

The kernels are stand-ins (``FakeKernel``: attention in float32 written into out and lse;
``FakeBwdKernel``: the sm80 and sm90 backwards' calling conventions, gradients by the backward's
formulas in float32; both refuse tensors whose head dims are not their spec's, as the TVM-FFI entry
of a real kernel does); their GPU counterparts are in tests/gpu/test_head_dim_v_gpu.py and
tests/gpu/test_bwd_sm90_dv_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from cpu_support import pretend_h200, reference, replace_in, trace_attention_block
from torch._subclasses.fake_tensor import FakeTensorMode

import cutefa
from cutefa import cli, dispatch
from cutefa.api import attention, backward, dense, feature_bwd, feature_ops, launch, plans, validate
from cutefa.codegen import render_source
from cutefa.model.defaults import default_spec
from cutefa.model.options import DqLayout
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features

D, DV = 192, 128  # the pair of HEAD_DIM_V_PAIRS
SCALE = 1 / math.sqrt(D)


def qkv(batch=1, sq=8, sk=8, hq=4, hkv=2, d=D, dv=DV, dtype=torch.bfloat16, device="cpu", seed=0):
    """q, k (head dim ``d``) and v (``dv``): random on the CPU, else empty (meta, or fake CUDA
    tensors under a FakeTensorMode)."""
    g = torch.Generator().manual_seed(seed)

    def make(s, h, dim):
        if device != "cpu":
            return torch.empty(batch, s, h, dim, dtype=dtype, device=device)
        return torch.randn(batch, s, h, dim, generator=g).to(dtype)

    return make(sq, hq, d), make(sk, hkv, d), make(sk, hkv, dv)


def _meta(*shape):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


# ---------------------------------------------------------------------------------------------
# Validation


def test_validation_takes_the_pair_where_asked_and_refuses_odd_pairs_naming_the_supported_ones():
    q, k, v = _meta(1, 4, 2, D), _meta(1, 4, 2, D), _meta(1, 4, 2, DV)
    validate.validate_inputs(q, k, v, device_types=("meta",), separate_v=True)
    validate.check_heads(q[0], k[0], v[0], separate_v=True)  # the packed layout
    for d, dv in ((192, 96), (128, 64), (128, 192), (64, 128)):
        with pytest.raises(ValueError, match=rf"head_dim_v={dv} \(v.shape\[-1\]\) with head_dim={d} .*\(192, 128\)"):
            validate.validate_inputs(
                _meta(1, 4, 2, d), _meta(1, 4, 2, d), _meta(1, 4, 2, dv), device_types=("meta",), separate_v=True
            )
    # a call that does not pass v's head dim on refuses it, naming the calls that take it
    refused = r"this call takes v of q's head dim only.*\(192, 128\).*flash_attn_func"
    with pytest.raises(NotImplementedError, match=refused):
        validate.validate_inputs(q, k, v, device_types=("meta",))
    with pytest.raises(ValueError, match="head_dim differs: q has 192, k has 128"):
        validate.check_heads(q, _meta(1, 4, 2, DV), v, separate_v=True)


def test_the_public_calls_refuse_odd_pairs_and_what_takes_no_v_head_dim(monkeypatch):
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    q, k, _ = qkv()
    v96 = torch.randn(1, 8, 2, 96).bfloat16()
    with pytest.raises(ValueError, match=r"head_dim_v=96 \(v.shape\[-1\]\) with head_dim=192.*\(192, 128\) only"):
        cutefa.flash_attn_func(q, k, v96)
    with pytest.raises(ValueError, match=r"head_dim_v=96 .*\(192, 128\) only"):
        cutefa.flash_attn_func(q, k, v96, window_size=(4, 0))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"head_dim_v=96 .*\(192, 128\) only"):
        cutefa.flash_attn_varlen_func(q[0], k[0], v96[0], cu, cu, 8, 8)
    # user mods: their kernels take v of q's head dim only
    _, _, v = qkv()
    with pytest.raises(NotImplementedError, match=r"head_dim_v=128 .*this call takes v of q's head dim only"):
        cutefa.flash_attn_func(q, k, v, score_mod=lambda s, b, h, i, j: s)
    # fp8
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    with pytest.raises(NotImplementedError, match=r"head_dim_v=128 .*the fp8 forward takes v of q's head dim only"):
        cutefa.flash_attn_func(q8, k8, v8)


def test_launch_shapes_name_head_dim_v_only_where_it_is_its_own():
    q, k, v = qkv()
    assert "head_dim_v" not in launch.shapes(q, k) and "head_dim_v" not in launch.shapes(q, k, k)
    assert launch.shapes(q, k, v)["head_dim_v"] == DV
    assert launch.out_shape(q) == tuple(q.shape) and launch.out_shape(q, DV) == (1, 8, 4, DV)
    out, lse = launch.empty_outputs(q, head_dim_v=DV)
    assert out.shape == (1, 8, 4, DV) and lse.shape == (1, 4, 8)
    out, lse = feature_ops.empty_outputs(q[0], True, DV)
    assert out.shape == (8, 4, DV) and lse.shape == (4, 8)


# ---------------------------------------------------------------------------------------------
# Fake implementations and torch.compile


def test_fake_impls_give_the_output_v_head_dim():
    with FakeTensorMode():
        q, k, v = qkv(batch=2, sq=5, sk=7, dtype=torch.float16, device="cuda")
        out, lse = torch.ops.cutefa.flash_fwd(q, k, v, True, 0.1)
        assert (out.shape, out.dtype, lse.shape) == ((2, 5, 4, DV), torch.float16, (2, 4, 5))
        out, lse = torch.ops.cutefa.attn_fwd(
            q, k, v, None, None, None, None, 5, 7, False, 0.1, 3, 0, 0.0, None, None, False
        )
        assert out.shape == (2, 5, 4, DV) and lse.shape == (2, 4, 5)
        cu = torch.zeros(3, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.cutefa.attn_fwd(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, None, None, 5, 7, True, 0.1, -1, -1, 0.0,
            None, None, False,
        )  # fmt: skip
        assert out.shape == (10, 4, DV) and lse.shape == (4, 10)
        with pytest.raises(ValueError, match=r"head_dim_v=96 .*\(192, 128\)"):
            torch.ops.cutefa.flash_fwd(q, k, torch.empty(2, 7, 2, 96, dtype=q.dtype, device="cuda"), True, 0.1)


def test_torch_compile_fullgraph_traces_a_forward_of_v_head_dim(monkeypatch):
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu", "meta"))
    with FakeTensorMode():
        q, k, v = qkv(batch=2, device="cuda")
        (out, lse), ops_called = trace_attention_block(q, k, v)
    assert out.shape == (2, 8, 4, DV) and lse.shape == (2, 4, 8)
    assert torch.ops.cutefa.flash_fwd.default in ops_called


# ---------------------------------------------------------------------------------------------
# Dispatch and explain


PROBLEM = {"dtype": "bf16", "head_dim": D, "seqlen_q": 4096, "seqlen_k": 4096, "batch": 2, "heads_q": 16,
           "heads_kv": 16}  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
def test_dispatch_picks_the_family_default_with_head_dim_v(causal):
    dispatch.clear_caches()
    for target, family in (("sm_90a", "sm90"), ("sm_80", "sm80"), ("sm_100a", "sm80")):
        choice = dispatch.choose(target=target, causal=causal, head_dim_v=DV, **PROBLEM)
        assert choice.spec == default_spec(family, "fwd", "bf16", D, causal=causal, head_dim_v=DV), target
        assert choice.reason.startswith("heuristic") and f"head_dim_v={DV}" in choice.reason
    # the H200's tuned table serves hd192 (v of 192), never a V head dim of its own: memoized apart
    tuned = dispatch.choose(target="sm_90a", causal=causal, gpu_name="NVIDIA H200", **PROBLEM)
    own = dispatch.choose(target="sm_90a", causal=causal, gpu_name="NVIDIA H200", head_dim_v=DV, **PROBLEM)
    assert "tuned table" in tuned.reason and tuned.spec.head_dim_v == D
    assert own.spec.head_dim_v == DV and own.reason.startswith("heuristic")
    assert dispatch.choose(target="sm_90a", causal=causal, head_dim_v=D, **PROBLEM).spec.head_dim_v == D
    varlen = dispatch.choose(
        target="sm_90a", causal=causal, head_dim_v=DV, features=Features(varlen=True), local=True, **PROBLEM
    )
    assert varlen.spec.head_dim_v == DV and varlen.spec.features.varlen and "varlen" in varlen.spec.name


def test_explain_shows_v_and_why_a_family_is_passed_over():
    q, k, v = qkv(batch=2, sq=4096, sk=4096, hq=16, hkv=16, device="meta")
    text = attention.explain(q, k, v, causal=True, target="sm_100a")
    assert text.startswith("cutefa forward: q=(2, 4096, 16, 192) k=(2, 4096, 16, 192) v=(2, 4096, 16, 128) bf16"), text
    assert "chosen: cutefa_sm80_fwd_bf16_hd192v128_" in text
    assert "cutefa_sm100_fwd_bf16_hd192v128_" in text and "(head_dim, head_dim_v) in (192, 128)" in text
    text = attention.explain(q, k, v, target="sm_90a", varlen=True)
    assert "head_dim 192 (v 128)" in text and "chosen: cutefa_sm90_fwd_bf16_hd192v128_" in text and "_varlen" in text
    same = attention.explain(q, k, k, target="sm_90a")
    assert "v=(" not in same and "hd192v" not in same


def test_cli_explain_takes_dqk_colon_dv(capsys):
    assert cli.main(["explain", "--shape", "2,4096,4096,16,16,192:128", "--gpu", "sm_90a", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "v=(2, 4096, 16, 128)" in out and "chosen: cutefa_sm90_fwd_bf16_hd192v128_" in out
    assert cli.main(["explain", "--shape", "2,4096,4096,16,16,192:192", "--gpu", "sm_90a"]) == 0
    assert "v=(" not in capsys.readouterr().out
    assert cli.main(["explain", "--shape", "2,4096,4096,16,16,192:96", "--gpu", "sm_90a"]) == 2
    err = capsys.readouterr().err
    assert "head_dim_v=96" in err and "(192, 128)" in err and "Traceback" not in err
    for shape in ("2,4096,4096,16,16,192:", "2,4096,4096,16,16,192:128:64", "2,4096,4096,16,16,192:0", "1,2:3"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["explain", "--shape", shape, "--gpu", "sm_90a"])
        assert exit_info.value.code == 2 and "DQK:DV" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The calls on CPU stand-ins of the kernels


class FakeKernel:
    """Attention in float32 into out and lse; refuses (ValueError, before writing) q, k, v and out
    whose head dims are not its spec's. Feature arguments (packed sequences) are read."""

    def __init__(self, spec):
        self.spec = spec
        self.calls = 0

    def __call__(self, q, k, v, out, lse, scale, *extra):
        d, dv = self.spec.head_dim, self.spec.head_dim_v
        if (q.shape[-1], k.shape[-1], v.shape[-1], out.shape[-1]) != (d, d, dv, dv):
            raise ValueError("Mismatched Shape on argument")
        self.calls += 1
        causal = self.spec.causal
        if not self.spec.features.varlen:
            o, l = reference(q, k, v, causal, scale)
            out.copy_(o.to(out.dtype))
            lse.copy_(l)
            return
        cu_q, cu_k, used_q, used_k = (t.tolist() for t in extra[:4])
        for b in range(len(used_q)):
            rows = slice(cu_q[b], cu_q[b] + used_q[b])
            keys = slice(cu_k[b], cu_k[b] + used_k[b])
            o, l = reference(q[rows][None], k[keys][None], v[keys][None], causal, scale)
            out[rows] = o[0].to(out.dtype)
            lse[:, rows] = l[0]


class FakeBwdKernel:
    """The sm80 backward's calling convention (q, k, v, o, do, lse, dlse, dq, dk, dv, dq_accum,
    lse_log2, dpsum, dkv_part, tail_count, scale, deterministic, slots, <varlen: cu_seqlens_q,
    cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k>): dq, and dk and dv per query
    head, by the backward's formulas in float32 (:meth:`_sequence`); the sm90 one's (q, k, v, o, do,
    lse, dlse, dq, dk, dv, dq_accum, dkv_accum, lse_log2, dpsum, scale, deterministic): dk and dv per
    kv head, a kv head's group summed; refuses (ValueError, before writing) tensors whose head dims
    are not its spec's (q, k, dq, dk of head_dim; v, o, do, dv of head_dim_v)."""

    def __init__(self, spec):
        self.spec = spec
        self.calls = 0

    def __call__(self, q, k, v, o, do, lse, dlse, dq, dk, dv, *rest):
        d, dv_ = self.spec.head_dim, self.spec.head_dim_v
        if [t.shape[-1] for t in (q, k, dq, dk, v, o, do, dv)] != [d] * 4 + [dv_] * 4:
            raise ValueError("Mismatched Shape on argument")
        sm90 = self.spec.arch == "sm90"
        heads = k.shape[-2] if sm90 else q.shape[-2]  # sm90: a kv head's group summed in the kernel
        if dk.shape[-2] != heads or dv.shape[-2] != heads:
            raise ValueError("dk and dv take one slice per query head (sm80) or kv head (sm90)")
        self.calls += 1
        scale, extra = (rest[4], rest[6:]) if sm90 else (rest[5], rest[8:])
        if not self.spec.features.varlen:
            self._sequence(q, k, v, do, dlse, scale, (dq, dk, dv))
            return
        cu_q, cu_k, used_q, used_k = (t.tolist() for t in extra[:4])
        for b in range(len(used_q)):
            rows = slice(cu_q[b], cu_q[b] + used_q[b])
            keys = slice(cu_k[b], cu_k[b] + used_k[b])
            grads = [dq[rows][None], dk[keys][None], dv[keys][None]]
            inputs = (q[rows], k[keys], v[keys], do[rows], dlse[:, rows])
            self._sequence(*(t[None] for t in inputs), scale, grads)
            dq[rows], dk[keys], dv[keys] = (g[0] for g in grads)

    def _sequence(self, q, k, v, do, dlse, scale, grads):
        """The backward's formulas in float32 (the kernel's, with k and v expanded to query heads):
        P from the reference's lse, dV = P^T dO, dS = P (dO V^T - D) with D = rowsum(dO O) - dLSE,
        dQ = scale dS K, dK = scale dS^T Q."""
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
        q, k, v, do = (t.float() for t in (q, k, v, do))
        out, lse = reference(q, k, v, self.spec.causal, scale)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        if self.spec.causal:
            sq, sk = q.shape[1], k.shape[1]
            s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, -math.inf)
        p = torch.exp(s - lse[..., None])
        d = (do * out).sum(-1).transpose(1, 2) - dlse  # (b, h, q)
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, v) - d[..., None])
        values = (
            torch.einsum("bhqk,bkhd->bqhd", ds, k) * scale,
            torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale,
            torch.einsum("bhqk,bqhd->bkhd", p, do),
        )
        for g, value in zip(grads, values):
            if g.shape[2] != value.shape[2]:  # per kv head: the group's query heads summed
                value = value.unflatten(2, (g.shape[2], group)).sum(3)
            g.copy_(value.to(g.dtype))


class _H200Properties:
    multi_processor_count = 132
    regs_per_multiprocessor = 65536
    shared_memory_per_multiprocessor = 228 * 1024


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors accepted, an H200 pretended, every kernel a FakeKernel or FakeBwdKernel (one per
    variant)."""
    kernels = {}

    def get_kernel(spec, target):
        return kernels.setdefault(spec.name, (FakeKernel if spec.direction == "fwd" else FakeBwdKernel)(spec))

    pretend_h200(monkeypatch)
    replace_in(monkeypatch, (dense, feature_ops, backward, feature_bwd), "get_kernel", get_kernel)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _H200Properties())
    monkeypatch.setattr(plans, "_PLANS", {})
    yield kernels
    dispatch.clear_caches()


def test_dense_call_and_its_plan(fake_gpu):
    q, k, v = qkv(sq=9, sk=13)
    out, lse = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    want, want_lse = reference(q, k, v, True, SCALE)
    assert out.shape == (1, 9, 4, DV) and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=0)
    torch.testing.assert_close(lse, want_lse)
    (name,) = fake_gpu
    assert "hd192v128" in name and "_causal" in name
    (plan_key,) = plans._PLANS
    # the second call takes the plan: its output template has v's head dim
    again = cutefa.flash_attn_func(q, k, v, causal=True)
    assert fake_gpu[name].calls == 2 and torch.equal(again, out)
    # v of q's head dim under the same key (q's and k's shapes): the plan passes it on to the
    # validating way, which dispatches for it
    v_same = torch.randn(1, 13, 2, D).bfloat16()
    out_same = cutefa.flash_attn_func(q, k, v_same, causal=True)
    assert out_same.shape == q.shape and len(fake_gpu) == 2
    torch.testing.assert_close(out_same.float(), reference(q, k, v_same, True, SCALE)[0], atol=1e-2, rtol=0)
    assert list(plans._PLANS) == [plan_key] and fake_gpu[name].calls == 2
    # the plan made for v of q's head dim passes v of 128 on too
    plans._PLANS.clear()
    cutefa.flash_attn_func(q, k, v_same, causal=True)
    assert torch.equal(cutefa.flash_attn_func(q, k, v, causal=True), out)


def test_the_op_path_and_an_empty_problem(fake_gpu):
    q, k, v = qkv(batch=2, sq=1, sk=17, hq=4, hkv=1)
    with torch.inference_mode():
        out = torch.ops.cutefa.flash_fwd(q, k, v, False, SCALE)[0]
    torch.testing.assert_close(out.float(), reference(q, k, v, False, SCALE)[0], atol=1e-2, rtol=0)
    torch.library.opcheck(torch.ops.cutefa.flash_fwd.default, (q, k, v, True, SCALE))
    q0, k0, v0 = qkv(sq=3, sk=0)
    out, lse = cutefa.flash_attn_func(q0, k0, v0, return_lse=True)
    assert out.shape == (1, 3, 4, DV) and (out == 0).all() and torch.isneginf(lse).all()


def test_varlen_and_windowed_calls(fake_gpu):
    lens = [(1, 1), (17, 5), (4, 30)]
    cu_q = torch.tensor([0, 1, 18, 22], dtype=torch.int32)
    cu_k = torch.tensor([0, 1, 6, 36], dtype=torch.int32)
    q, k, v = (t[0] for t in qkv(sq=22, sk=36))
    out, lse = cutefa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 30, causal=True, return_lse=True)
    assert out.shape == (22, 4, DV) and lse.shape == (4, 22)
    for b, (sq, sk) in enumerate(lens):
        rows, keys = slice(cu_q[b], cu_q[b] + sq), slice(cu_k[b], cu_k[b] + sk)
        want, _ = reference(q[rows][None], k[keys][None], v[keys][None], True, SCALE)
        torch.testing.assert_close(out[rows].float(), want[0], atol=1e-2, rtol=0)
    assert any("hd192v128" in n and "varlen" in n for n in fake_gpu)
    qd, kd, vd = qkv(sq=5, sk=5)
    windowed = cutefa.flash_attn_func(qd, kd, vd, window_size=(2, 0), softcap=0.0)
    assert windowed.shape == (1, 5, 4, DV)
    assert any("hd192v128" in n and "local" in n for n in fake_gpu)


# ---------------------------------------------------------------------------------------------
# The backward


def test_backward_head_dims_accepted_and_refused_naming_the_supported_pairs():
    validate.check_backward_head_dims(D, DV)
    validate.check_backward_head_dims(128, 128)
    for d, dv in ((192, 96), (128, 64), (128, 192), (576, 512)):
        with pytest.raises(
            NotImplementedError,
            match=rf"backward of attention with head_dim_v={dv} \(v.shape\[-1\]\) apart from head_dim={d} .*"
            r"v of q's head dim, or \(head_dim, head_dim_v\) in \(192, 128\)",
        ):
            validate.check_backward_head_dims(d, dv)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_sm80_backward_takes_the_pair_on_the_tiled_dq_accumulator(dtype, causal):
    spec = default_spec("sm80", "bwd", dtype, D, causal=causal, head_dim_v=DV)
    hd192 = default_spec("sm80", "bwd", dtype, D, causal=causal)
    assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps, spec.options) == (
        hd192.tile_m, hd192.tile_n, hd192.stages, hd192.warps, hd192.options
    )
    assert "hd192v128" in spec.name and spec.options.dq_layout is DqLayout.TILE
    assert why_invalid(spec) is None
    for features in (Features(varlen=True), Features(varlen=True, softcap=True, alibi=True)):
        assert why_invalid(spec.replace(features=features)) is None
    for layout in (DqLayout.ROWS, DqLayout.QUAD):
        why = why_invalid(spec.replace(dq_layout=layout, dq_pipe=False))
        assert why is not None and "head_dim_v=128" in why and "dq_layout=TILE" in why, why
    # the sm90 backward takes the pair too (its swapped partition, tests/test_compile_sm90_bwd_dv.py);
    # the sm100 one takes one head dim for q, k and v
    assert why_invalid(default_spec("sm90", "bwd", dtype, D, causal=causal, head_dim_v=DV)) is None
    other = default_spec("sm100", "bwd", dtype, 128, causal=causal)
    assert why_invalid(other.replace(head_dim=D, head_dim_v=DV)) is not None


def test_the_generated_backward_computes_v_on_its_own_head_dim():
    source = render_source(default_spec("sm80", "bwd", "bf16", D, causal=True, head_dim_v=DV))
    assert "HEAD_DIM = 192\n" in source and "HEAD_DIM_V = 128\n" in source and "TILE_DV = 128" in source
    # V and dO in shared memory, dV's accumulator and the preprocess's D over 128 columns
    assert "sV_layout = parts.smem_layout(DTYPE, TILE_N, TILE_DV)" in source
    assert "sdO_layout = parts.smem_layout(DTYPE, TILE_M, TILE_DV)" in source
    assert "acc_dV = cute.make_rmem_tensor(thr_dv.partition_shape_C((TILE_N, TILE_DV)), Float32)" in source
    assert "first + i, lane, HEAD_DIM_V, False" in source
    assert "DV_WARPS = bwd_parts.warp_grid(TILE_N, TILE_DV, WARPS)" in source
    # the compile's sample arguments: v, o, do and dv of head_dim_v
    assert "k, v = bshd(seqlen_k, heads_kv), bshd(seqlen_k, heads_kv, spec.head_dim_v)" in source
    plain = render_source(default_spec("sm80", "bwd", "bf16", D, causal=True))
    assert "HEAD_DIM_V" not in plain and "TILE_DV" not in plain and "g2s_v" not in plain


@pytest.mark.parametrize("target", ["sm_80", "sm_90a", "sm_100a"])
def test_dispatch_routes_the_pair_to_the_sm90_backward_on_hopper_and_the_sm80_one_elsewhere(target):
    family = "sm90" if target == "sm_90a" else "sm80"
    for causal in (False, True):
        spec = backward.choose_bwd(
            target, torch.bfloat16, D, causal, seqlen_k=4096, gpu_name="NVIDIA H200", head_dim_v=DV
        )  # fmt: skip
        assert spec == default_spec(family, "bwd", "bf16", D, causal=causal, head_dim_v=DV)
    # on Hopper hd192 itself keeps the sm90 backward (and its tuned table)
    assert backward.choose_bwd("sm_90a", torch.bfloat16, D, True).arch == "sm90"
    families, passed = backward.separate_v_families(target, D, DV)
    assert families == {"sm_80": ["sm80"], "sm_90a": ["sm90", "sm80"], "sm_100a": ["sm80"]}[target]
    assert all("one head dim for q, k and v" in why for why in passed)
    assert len(passed) == {"sm_80": 0, "sm_90a": 0, "sm_100a": 1}[target]  # (sm_100a: sm100, sm80)


def test_the_pair_takes_no_stream_k_tail():
    """Its kernel walks its own key blocks (as a padded head dim's): no tail slots, no tail workspace."""
    spec = default_spec("sm80", "bwd", "bf16", D, head_dim_v=DV)
    plain = default_spec("sm80", "bwd", "bf16", D)
    assert backward.tail_slots(plain, False, 2, 16, 4096, 4096, 132) > 0
    assert backward.tail_slots(spec, False, 2, 16, 4096, 4096, 132) == 0


def test_the_pair_has_no_backward_where_shared_memory_is_short():
    with pytest.raises(NotImplementedError, match=r"head_dim=192 head_dim_v=128 on sm_86.*102.0 KiB"):
        backward.choose_bwd("sm_86", torch.float16, D, False, head_dim_v=DV)


def test_explain_names_the_backward_of_the_pair():
    q, k, v = qkv(batch=2, sq=4096, sk=4096, hq=16, hkv=16, device="meta")
    text = attention.explain(q, k, v, causal=True, target="sm_90a")
    want = default_spec("sm90", "bwd", "bf16", D, causal=True, head_dim_v=DV).name
    assert f"  backward: {want} (family sm90)\n" in text
    blackwell = attention.explain(q, k, v, causal=True, target="sm_100a")
    want = default_spec("sm80", "bwd", "bf16", D, causal=True, head_dim_v=DV).name
    assert (
        f"  backward: {want} (family sm80; the sm100 backward takes one head dim for q, k and v)" in blackwell
    )
    packed = attention.explain(q, k, v, target="sm_80", varlen=True)
    assert "  backward: cutefa_sm80_bwd_bf16_hd192v128_" in packed and "_varlen_" in packed
    # a packed batch on Hopper: the swapped sm90 backward takes none, so the sm80 one, saying why
    packed = attention.explain(q, k, v, target="sm_90a", varlen=True)
    line = next(x for x in packed.splitlines() if x.startswith("  backward:"))
    assert line.startswith("  backward: cutefa_sm80_bwd_bf16_hd192v128_") and "_varlen_" in line
    assert (
        "cutefa_sm90_bwd_bf16_hd192v128_64x96_s2_w12_varlen_dqbulk_dqs: " in line and "packed batch" in line
    )
    assert "backward:" not in attention.explain(q, k, k, target="sm_90a")


def _grads(leaves, call, dout, dlse):
    out, lse = call(*leaves)
    torch.autograd.backward([out, lse], [dout, dlse])
    return [t.grad for t in leaves]


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (4, 4)])
def test_dense_gradients_through_the_backward_kernel(fake_gpu, monkeypatch, family, hq, hkv):
    """On the pretended H200 the sm90 backward (its calling convention: dk and dv per kv head), and
    the sm80 one where the families are held to it (per query head, the group summed by the call)."""
    if family == "sm80":
        monkeypatch.setattr(backward, "families_for_target", lambda target: ("sm80",))
    q, k, v = (t.requires_grad_() for t in qkv(batch=2, sq=6, sk=9, hq=hq, hkv=hkv))
    g = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(2, 6, hq, DV, generator=g).bfloat16(), torch.randn(2, hq, 6, generator=g)
    got = _grads([q, k, v], lambda *t: cutefa.flash_attn_func(*t, causal=True, return_lse=True), dout, dlse)
    exact = _grads(
        [t.detach().float().requires_grad_() for t in (q, k, v)], lambda *t: reference(*t, True, SCALE),
        dout.float(), dlse,
    )  # fmt: skip
    for name, a, b in zip(("dq", "dk", "dv"), got, exact):
        assert a.shape == b.shape and a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2, msg=name)
    (name,) = [n for n in fake_gpu if "_bwd_" in n]
    assert name == default_spec(family, "bwd", "bf16", D, causal=True, head_dim_v=DV).name
    assert fake_gpu[name].calls == 1


def test_packed_gradients_through_the_backward_kernel(fake_gpu):
    cu_q = torch.tensor([0, 1, 1, 18], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 8, 30], dtype=torch.int32)
    q, k, v = (t[0].requires_grad_() for t in qkv(sq=18, sk=30))
    g = torch.Generator().manual_seed(2)
    dout, dlse = torch.randn(18, 4, DV, generator=g).bfloat16(), torch.randn(4, 18, generator=g)

    def call(q, k, v):
        return cutefa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 22, return_lse=True)

    dq, dk, dv = _grads([q, k, v], call, dout, dlse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        leaves = [t.detach()[s][None].float().requires_grad_() for t, s in ((q, rows), (k, keys), (v, keys))]
        dout_b, dlse_b = dout[rows][None].float(), dlse[:, rows][None]
        want = _grads(leaves, lambda *t: reference(*t, False, SCALE), dout_b, dlse_b)
        for name, got, w, s in zip(("dq", "dk", "dv"), (dq, dk, dv), want, (rows, keys, keys)):
            torch.testing.assert_close(got[s].float(), w[0], atol=3e-2, rtol=3e-2, msg=f"{name}, sequence {b}")
    assert any("_bwd_" in n and "hd192v128" in n and "varlen" in n for n in fake_gpu)
