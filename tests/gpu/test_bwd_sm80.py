"""Backward correctness of cutefa on a CUDA GPU against float32 autograd of the exact reference.

Each gradient is judged against what PyTorch's own attention (SDPA, math backend) gets on the same
fp16/bf16 inputs: cutefa's relative L2 error must be at most 3x SDPA's (with a small floor). Also:
bitwise determinism with deterministic=True, the gradient of the lse, torch.compile(fullgraph)
forward+backward against eager, and a 20-step training loop against the same model on SDPA.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gpu_support import all_variants
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa
from cutefa.model.options import DqLayout, Sm80BwdOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (64, 96, 128, 192, 256)
SEQLENS = ((1, 1), (17, 17), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17), (128, 4097))


def attention(q, k, v, causal, scale):
    """Grouped, bottom-right causal attention in the inputs' dtype (or float32), through SDPA math."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    mask = None
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = (
            torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + sk - sq
        )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale).transpose(1, 2)
    if mask is not None:  # rows that attend nothing: 0, as cutefa defines them
        out = torch.where(mask.any(-1)[None, :, None, None], out, torch.zeros_like(out))
    return out


def grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(dout)
    return q.grad, k.grad, v.grad


def rel(x, ref):
    """Relative L2 error. The denominator has a floor of 1e-3 per element (the inputs are unit
    normal, so gradients are O(1)): where the exact gradient is 0 (dq with one key: softmax over a
    single key has no slope), rounding noise is judged against the gradients' scale, not 0."""
    floor = 1e-3 * math.sqrt(ref.numel())
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(floor)).item()


def random_inputs(gen, dtype, head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, *, head_dim_v=None):
    """q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv, head_dim), v (batch,
    seqlen_k, heads_kv, head_dim_v) and dout (q's shape but for its head_dim_v; head_dim_v None:
    head_dim): unit normal values in ``dtype`` on the GPU, drawn from ``gen`` in that order."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, generator=gen, device="cuda", dtype=dtype)
    dout = torch.randn(*q.shape[:-1], head_dim_v, generator=gen, device="cuda", dtype=dtype)
    return q, k, v, dout


def check(q, k, v, causal, gen):
    scale = 1.0 / math.sqrt(q.shape[-1])
    dout = torch.randn(q.shape, generator=gen, device="cuda", dtype=q.dtype)
    got = grads(lambda a, b, c: cutefa.flash_attn_func(a, b, c, causal=causal), q, k, v, dout)
    # float32 leaves: the reference gradients must not be rounded to the inputs' dtype (that
    # would make SDPA's own low-precision gradients look exact and the tolerance meaningless)
    exact = grads(
        lambda a, b, c: attention(a, b, c, causal, scale), q.float(), k.float(), v.float(), dout.float()
    )
    base = grads(lambda a, b, c: attention(a, b, c, causal, scale), q, k, v, dout)
    for name, g, e, b in zip(("dq", "dk", "dv"), got, exact, base):
        assert g.shape == e.shape and g.dtype == q.dtype, name
        assert dout.abs().sum() > 0, "dout was modified in place by the backward pass"
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        err, err_base = rel(g, e), rel(b, e)
        assert err <= 3 * err_base + 1e-3, f"{name}: rel err {err:.3g} vs SDPA {err_base:.3g}"


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"sq{s[0]}_sk{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"hd{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grads_match_reference(gen, dtype, head_dim, causal, seqlens):
    sq, sk = seqlens
    dt = DTYPES[dtype]
    q = torch.randn(1, sq, 2, head_dim, generator=gen, device="cuda", dtype=dt)
    k = torch.randn(1, sk, 2, head_dim, generator=gen, device="cuda", dtype=dt)
    v = torch.randn(1, sk, 2, head_dim, generator=gen, device="cuda", dtype=dt)
    check(q, k, v, causal, gen)


@pytest.mark.parametrize("heads", [(6, 2), (8, 1)], ids=["gqa3", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_grads(gen, heads, causal):
    hq, hkv = heads
    q = torch.randn(2, 333, hq, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 517, hkv, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 517, hkv, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    check(q, k, v, causal, gen)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_is_bitwise_reproducible(gen, head_dim):
    q = torch.randn(1, 2048, 4, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2048, 2, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2048, 2, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(q.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    fn = lambda a, b, c: cutefa.flash_attn_func(a, b, c, causal=True, deterministic=True)
    first, second = grads(fn, q, k, v, dout), grads(fn, q, k, v, dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    plain = grads(lambda a, b, c: cutefa.flash_attn_func(a, b, c, causal=True), q, k, v, dout)
    for a, b in zip(first, plain):
        assert rel(a, b) < 1e-2


def check_lse_gradient(q, k, v, w):
    """The gradients of out.sum() + (lse * w).sum() through cutefa.flash_attn_func(return_lse=True)
    (the incoming log-sum-exp gradient included) against float32 autograd of the exact attention."""

    def loss(a, b, c, lse_fn):
        out, lse = lse_fn(a, b, c)
        return out.float().sum() + (lse * w).sum()

    def ref(a, b, c):
        s = torch.einsum("bqhd,bkhd->bhqk", a.float(), b.float()) / math.sqrt(a.shape[-1])
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), c.float()), torch.logsumexp(s, -1)

    got = [t.detach().requires_grad_() for t in (q, k, v)]
    loss(*got, lambda a, b, c: cutefa.flash_attn_func(a, b, c, return_lse=True)).backward()
    want = [t.detach().float().requires_grad_() for t in (q, k, v)]
    loss(*want, ref).backward()
    for g, e in zip(got, want):
        assert rel(g.grad, e.grad) < 1e-2


def test_lse_gradient(gen):
    q, k, v = (
        torch.randn(1, 300, 2, 64, generator=gen, device="cuda", dtype=torch.float16) for _ in range(3)
    )
    w = torch.randn(1, 2, 300, generator=gen, device="cuda")
    check_lse_gradient(q, k, v, w)


def test_torch_compile_fullgraph_matches_eager(gen):
    q, k, v = (
        torch.randn(2, 257, 4, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )

    def step(a, b, c):
        return cutefa.flash_attn_func(a, b, c, causal=True).float().square().mean()

    eager = grads(step, q, k, v, torch.tensor(1.0, device="cuda"))
    torch._dynamo.reset()
    compiled = grads(torch.compile(step, fullgraph=True), q, k, v, torch.tensor(1.0, device="cuda"))
    for a, b in zip(eager, compiled):
        assert rel(b, a) < 1e-3


class Block(torch.nn.Module):
    def __init__(self, dim, heads, use_cutefa):
        super().__init__()
        self.heads, self.use_cutefa = heads, use_cutefa
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        if self.use_cutefa:
            a = cutefa.flash_attn_func(q, k, v, causal=True)
        else:
            a = F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
            ).transpose(1, 2)
        x = x + self.proj(a.reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def test_training_loop_matches_sdpa():
    losses = {}
    for use_cutefa in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(256, 2, use_cutefa), Block(256, 2, use_cutefa)).cuda().bfloat16()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator(device="cuda").manual_seed(1)
        data = torch.randn(20, 4, 512, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
        curve = []
        for step in range(20):
            loss = (model(data[step]).float() - data[step].float().roll(1, 1)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[use_cutefa] = curve
    for a, b in zip(losses[False], losses[True]):
        assert abs(a - b) <= 2e-2 * abs(a), (losses[False], losses[True])
    assert losses[True][-1] < losses[True][0]


# Every committed sm80 backward variant (the defaults and the tuning alternatives: dispatch runs only
# the defaults), called directly. (batch, seqlen_q, seqlen_k, heads_q, heads_kv): partial tiles on
# both sides, one query row, one key, more query blocks than two (a double-buffered Q alternates
# its buffers several times), grouped-query heads.
VARIANT_SHAPES = (
    (1, 1, 1, 2, 2),
    (2, 17, 1000, 4, 2),
    (1, 1000, 17, 3, 3),
    (2, 333, 257, 6, 2),
    (1, 1000, 1100, 4, 1),
)


def _variant_inputs(gen, spec, batch, seqlen_q, seqlen_k, heads_q, heads_kv):
    """:func:`random_inputs` in the variant's dtype and head dims (v and dout of its V head dim), and
    out (in that dtype) and lse of the exact forward at the softmax scale 1/sqrt(head_dim), for
    calling a variant directly."""
    dt = DTYPES[spec.dtype]
    q, k, v, dout = random_inputs(
        gen, dt, spec.head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim_v=spec.head_dim_v
    )
    with torch.no_grad():
        out, lse = _load("reference").attention_ref(
            q, k, v, causal=spec.causal, softmax_scale=1.0 / math.sqrt(spec.head_dim)
        )
    return q, k, v, dout, out.to(dt), lse


def _variants():
    return all_variants("sm80", "bwd")


def _variant_modes():
    """(variant, mode): every committed variant in atomic and deterministic mode, the non-causal
    ones of an unpadded head dim also with the stream-K tail on a few CTA slots (so that small grids
    have a tail; a padded head dim's kernel walks its own key blocks only: backward.tail_slots)."""
    from cutefa.model.rules import tile_head_dims

    return [
        (spec, mode)
        for spec in _variants()
        for mode in ("atomic", "deterministic", "stream")
        if mode != "stream" or (not spec.causal and tile_head_dims(spec) == (spec.head_dim, spec.head_dim))
    ]


# Slot counts tried per shape in "stream" mode: the first that gives the shape a stream-K tail.
STREAM_SLOTS = (5, 3, 7, 2)


@pytest.mark.parametrize(
    ("spec", "mode"), _variant_modes(), ids=lambda x: x if isinstance(x, str) else x.name
)
def test_bwd_variant(gen, spec, mode):
    """dq, dk and dv of one variant against float32 autograd of the exact reference, with every
    output and the dQ accumulator poisoned with NaN beforehand (an element the kernel does not
    write, or a split the preprocess does not clear, fails). Deterministic mode with up to 3
    splits makes each CTA walk several key blocks (the Q buffers restart at each). Stream mode runs
    the stream-K tail on 2-7 slots, so that CTAs cover parts of key blocks and several key blocks
    of different heads and batches: its parts workspace is poisoned with NaN and its counters with
    garbage (the preprocess must zero them), and most shapes must have a tail."""
    from cutefa.api import backward
    from cutefa.api.backward import dq_accum_workspace, sm80_tail_workspaces
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel
    from cutefa.model.rules import why_not_on

    target = current_target()
    if why_not_on(spec, target) is not None:
        pytest.skip(f"{spec.name} does not run on {target}: {why_not_on(spec, target)}")
    kernel = get_kernel(spec, target)
    dt = DTYPES[spec.dtype]
    scale = 1.0 / math.sqrt(spec.head_dim)
    deterministic = int(mode == "deterministic")
    tails = 0
    for batch, sq, sk, hq, hkv in VARIANT_SHAPES:
        q, k, v, dout, out, lse = _variant_inputs(gen, spec, batch, sq, sk, hq, hkv)
        # as backward.dq_splits: never more splits than key blocks
        splits = min(3, math.ceil(sk / spec.tile_n)) if deterministic else 1
        slots = 0
        if mode == "stream":
            dims = (batch, hq, sq, sk)
            slots = next((n for n in STREAM_SLOTS if backward.tail_slots(spec, False, *dims, n)), 0)
            tails += slots > 0
        nan = {"device": "cuda"}
        dq = torch.full(q.shape, math.nan, dtype=dt, **nan)
        dk_heads = torch.full((batch, sk, hq, spec.head_dim), math.nan, dtype=dt, **nan)
        dv_heads = torch.full((batch, sk, hq, spec.head_dim_v), math.nan, dtype=dt, **nan)
        dq_accum = dq_accum_workspace(spec, splits, batch, sq, hq, q.device).fill_(math.nan)
        lse_log2 = torch.full((batch, hq, sq), math.nan, **nan)
        dpsum = torch.full_like(lse_log2, math.nan)
        dlse = torch.zeros_like(lse_log2)
        dkv_part, tail_count = sm80_tail_workspaces(spec, slots, q.device)
        dkv_part.fill_(math.nan)
        tail_count.fill_(7)
        kernel(
            q, k, v, out, dout, lse.float().contiguous(), dlse, dq, dk_heads, dv_heads, dq_accum, lse_log2,
            dpsum, dkv_part, tail_count, scale, deterministic, slots,
        )  # fmt: skip
        torch.cuda.synchronize()
        group = hq // hkv
        dk = dk_heads.float().view(batch, sk, hkv, group, -1).sum(3)
        dv = dv_heads.float().view(batch, sk, hkv, group, -1).sum(3)
        exact = grads(
            lambda a, b, c: attention(a, b, c, spec.causal, scale),
            q.float(),
            k.float(),
            v.float(),
            dout.float(),
        )
        base = grads(lambda a, b, c: attention(a, b, c, spec.causal, scale), q, k, v, dout)
        shape = f"b{batch} sq{sq} sk{sk} hq{hq} hkv{hkv} slots={slots}"
        for name, g, e, b in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, base):
            assert torch.isfinite(g).all(), f"{spec.name} {shape}: {name} has non-finite values"
            err, err_base = rel(g, e), rel(b, e)
            assert err <= 3 * err_base + 1e-3, (
                f"{spec.name} {shape}: {name} rel err {err:.3g} vs SDPA {err_base:.3g}"
            )
    if mode == "stream":
        assert tails >= 3, f"{spec.name}: only {tails} of the shapes had a stream-K tail"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_stream_tail_through_the_launch(gen, dtype, monkeypatch):
    """flash_attn_func's backward with the sm80 family's head-dim-192 variant (chosen in place of
    dispatch's, which on sm_90a GPUs is the sm90 family's) on a grid that ends on a partial wave
    (2 x 10 heads x 32 key blocks = 640 CTAs), so that the launch path turns the stream-K tail on
    with the GPU's own slots: the gradients against the float32 reference."""
    from cutefa.api import backward
    from cutefa.model import defaults

    dt = DTYPES[dtype]
    spec = backward.choose_bwd("sm_80", dt, 192, False)  # the sm80 family's default
    tile = (spec.tile_m, spec.tile_n, spec.stages, spec.warps)
    assert spec.arch == "sm80" and tile == defaults.DEFAULT_BWD_TILES["sm80"][192], spec.name
    monkeypatch.setattr(backward, "choose_bwd", lambda *args, **kwargs: spec)
    q, k, v, _ = random_inputs(gen, dt, 192, 2, 2048, 2048, 10, 10)
    assert backward.device_tail_slots(spec, q.device, False, 2, 10, 2048, 2048) > 0
    check(q, k, v, False, gen)


def _natural(spec):
    """``spec`` with the natural (row-major) dQ accumulator, reduced element-wise."""
    return spec.replace(dq_layout=DqLayout.ROWS, dq_pipe=False)


def _quad_variants():
    variants = all_variants("sm80", "bwd")
    plain = [s for s in variants if s.options == Sm80BwdOptions()]
    # every variant whose natural-layout twin (the same tile and dtype) is a variant too
    return [s for s in variants if s.options.dq_layout is not DqLayout.ROWS and _natural(s) in plain]


# Longer shapes for the DqLayout.QUAD and TILE twins: whole and partial query blocks over several key blocks,
# seqlen_q != seqlen_k both ways, grouped-query heads.
QUAD_SHAPES = ((1, 4097, 4097, 2, 1), (2, 1000, 4097, 4, 2), (1, 4097, 128, 2, 2), (2, 17, 1000, 4, 2))


@pytest.mark.parametrize("spec", _quad_variants(), ids=lambda s: s.name)
def test_bwd_dq_quad_matches_twin(gen, spec):
    """DqLayout.QUAD only moves dQ's columns in the fp32 accumulator and adds four per reduction, TILE
    moves every value to its fragment-order place in a per-query-block chunk, dq_pipe computes dQ by
    column chunks (each value's k-blocks in the same order) and adds each chunk between the next
    one's MMAs: in deterministic mode
    (each accumulator element summed by one thread in a fixed order, the splits in order) dq, dk and
    dv are bitwise those of the same tile with the natural layout; in atomic mode they agree to fp32
    reordering. Each kernel's accumulator is poisoned with NaN in its own layout (no stream-K tail:
    it sums the parts of a key block's dK and dV, which moves their rounding)."""
    from cutefa.api.backward import dq_accum_workspace, sm80_tail_workspaces
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel
    from cutefa.model.rules import why_not_on

    target = current_target()
    twin = _natural(spec)
    if why_not_on(spec, target) is not None:
        pytest.skip(f"{spec.name} does not run on {target}: {why_not_on(spec, target)}")
    kernels = [get_kernel(s, target) for s in (spec, twin)]
    dt = DTYPES[spec.dtype]
    scale = 1.0 / math.sqrt(spec.head_dim)
    for batch, sq, sk, hq, hkv in QUAD_SHAPES:
        q, k, v, dout, out, lse = _variant_inputs(gen, spec, batch, sq, sk, hq, hkv)
        for deterministic in (1, 0):
            splits = min(3, math.ceil(sk / spec.tile_n)) if deterministic else 1
            results = []
            for variant, kernel in zip((spec, twin), kernels):
                dq = torch.full(q.shape, math.nan, dtype=dt, device="cuda")
                dk = torch.full((batch, sk, hq, spec.head_dim), math.nan, dtype=dt, device="cuda")
                dv = torch.full_like(dk, math.nan)
                dq_accum = dq_accum_workspace(variant, splits, batch, sq, hq, q.device).fill_(math.nan)
                lse_log2 = torch.full((batch, hq, sq), math.nan, device="cuda")
                dpsum = torch.full_like(lse_log2, math.nan)
                kernel(
                    q, k, v, out, dout, lse.float().contiguous(), torch.zeros_like(lse_log2), dq, dk, dv,
                    dq_accum, lse_log2, dpsum, *sm80_tail_workspaces(variant, 0, q.device), scale, deterministic, 0,
                )  # fmt: skip
                torch.cuda.synchronize()
                results.append((dq, dk, dv))
            shape = f"b{batch} sq{sq} sk{sk} hq{hq} hkv{hkv} deterministic={deterministic}"
            for name, got, ref in zip(("dq", "dk", "dv"), *results):
                assert torch.isfinite(got).all(), f"{spec.name} {shape}: {name} has non-finite values"
                if deterministic or name != "dq":  # dk, dv never go through the accumulator
                    assert torch.equal(got, ref), f"{spec.name} {shape}: {name} differs from {twin.name}"
                else:
                    assert rel(got.float(), ref.float()) <= 2e-3, f"{spec.name} {shape}: dq vs {twin.name}"
