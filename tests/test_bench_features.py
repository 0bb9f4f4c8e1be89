"""tools/bench_features.py and the feature reference of tools/bench_check.py on the CPU: the reference
(window, softcap, ALiBi, sinks) against autograd of plain masked attention, the grid and its
unmasked FLOPs, fake sides (a correct one, the same call without the feature judged against its
own reference, a wrong one FAIL, one that cannot run the cell n/a (why)), the cost columns."""

from __future__ import annotations

import math

import pytest
import torch
from cpu_support import load_tool

bench_features = load_tool("bench_features")
import bench_check
import bench_sides


def plain(q, k, v, *, causal, scale, window=None, softcap=0.0, slopes=None, sinks=None):
    """Masked attention by its definition, float32, differentiable: q (g, sq, d), k, v (sk, d)."""
    g, sq, _ = q.shape
    sk = k.shape[0]
    s = q @ k.T * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    diag = torch.arange(sq)[:, None] + sk - sq
    dist = diag - torch.arange(sk)[None, :]
    if slopes is not None:
        s = s - torch.tensor(slopes)[:, None, None] * dist.abs()
    left, right = bench_check.window_bounds(causal, window)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        allowed &= dist <= left
    if right is not None:
        allowed &= -dist <= right
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        s = torch.cat([s, torch.tensor(sinks)[:, None, None].expand(g, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p[..., :sk] @ v, lse


@pytest.mark.parametrize(
    "features",
    [
        {"window": (3, 2)}, {"window": (2, 0), "causal": True}, {"window": (1, 1), "sq": 12, "sk": 4},
        {"softcap": 2.0, "causal": True}, {"slopes": [0.5, 0.25]}, {"sinks": [0.3, -1.0], "causal": True},
        {"sinks": [0.3, -1.0], "window": (0, 0), "sq": 9, "sk": 3},
    ],
)  # fmt: skip
def test_the_feature_reference_matches_autograd(features):
    features = dict(features)
    causal, sq, sk = features.pop("causal", False), features.pop("sq", 9), features.pop("sk", 9)
    gen = torch.Generator().manual_seed(sq + sk)
    q = torch.randn(2, sq, 16, generator=gen, requires_grad=True)
    k = torch.randn(sk, 16, generator=gen, requires_grad=True)
    v = torch.randn(sk, 16, generator=gen, requires_grad=True)
    dout = torch.randn(2, sq, 16, generator=gen)
    out, lse = plain(q, k, v, causal=causal, scale=0.3, **features)
    (out * dout).sum().backward()
    saved = bench_check.BLOCK_ELEMENTS
    bench_check.BLOCK_ELEMENTS = 4 * sk
    try:
        got = bench_check.attend(
            q.detach(), k.detach(), v.detach(), causal=causal, scale=0.3, dout=dout, **features
        )
    finally:
        bench_check.BLOCK_ELEMENTS = saved
    torch.testing.assert_close(got["O"], out.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(got["LSE"]), torch.isneginf(lse))
    live = torch.isfinite(lse)
    torch.testing.assert_close(got["LSE"][live], lse[live].detach(), atol=1e-5, rtol=1e-5)
    for name, leaf in (("dQ", q), ("dK", k), ("dV", v)):
        torch.testing.assert_close(got[name], leaf.grad, atol=1e-5, rtol=1e-4)
    assert bench_check.rows_without_keys(sq, sk, causal, features.get("window")) == bool(
        torch.isneginf(plain(q, k, v, causal=causal, scale=0.3, window=features.get("window"))[1]).any()
    )


def test_the_grid_and_its_unmasked_flops():
    ps = bench_features.problems(bench_features.SEQLENS, bench_features.FEATURES, ("fwd", "bwd"))
    assert len(ps) == 2 * 5 * 2
    assert {p.batch for p in ps if p.seqlen == 8192} == {4}
    assert bench_features.window_pairs(5, 1) == 1 + 2 * 4
    assert bench_features.window_pairs(3, 10) == 6  # a window wider than the sequence: causal
    p = bench_features.Problem("window1k", 8192, "bwd")
    assert p.flops() == 2.5 * 4 * 4 * 16 * 128 * bench_features.window_pairs(8192, 1024)
    assert p.flops(with_feature=False) == 2.5 * 4 * 4 * 16 * 128 * 8192 * 8193 // 2
    assert bench_features.parse_args(["--quick"]).seqlen == [8192]
    with pytest.raises(SystemExit):
        bench_features.parse_args(["--seqlen", "100"])


class _Timer:
    def __init__(self, ms):
        self.ms = ms

    def __call__(self, fn):
        fn()
        return self.ms[getattr(fn, "side", "?")]


def _side(name, with_feature=True, wrong=False, na=None):
    """A side computing the cell's attention (with its feature or without) from the reference."""

    def make(p):
        if na:
            raise bench_sides.NotApplicable(na)
        values = p.values("cpu") if with_feature else {}

        def fwd(q, k, v):
            outs, lses = [], []
            for b in range(q.shape[0]):
                for h in range(q.shape[2]):
                    one = {
                        n: (x[h : h + 1].tolist() if n in ("slopes", "sinks") else x)
                        for n, x in values.items()
                    }
                    o, lse = plain(q[b, :, h : h + 1].transpose(0, 1).float(), k[b, :, h].float(), v[b, :, h].float(),
                                   causal=True, scale=1 / math.sqrt(q.shape[-1]), **one)  # fmt: skip
                    outs.append(o[0])
                    lses.append(lse[0])
            out = torch.stack(outs).view(q.shape[0], q.shape[2], *outs[0].shape).transpose(1, 2)
            lse = torch.stack(lses).view(q.shape[0], q.shape[2], -1)
            return (out * 1.1 if wrong else out).to(q.dtype), lse

        return fwd

    return bench_sides.Side(name, make)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench_features, "HEADS", 2)
    monkeypatch.setattr(bench_features, "HDIM", 16)
    monkeypatch.setattr(bench_features, "TOKENS", 64)
    monkeypatch.setattr(bench_features, "WINDOWS", {"window1k": 4, "window4k": 8})


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_sides_are_judged_against_their_own_problem(tiny, pass_, monkeypatch):
    def fake_entries(sides, problem, inputs, expect, p, judges=None):
        entries, na = original(sides, problem, inputs, expect, p, judges)
        for e in entries:
            if e.make is not None:
                make = e.make
                e.make = lambda make=make, n=e.name: _tag(make(), n)
        return entries, na

    original = bench_sides.side_entries
    monkeypatch.setattr(bench_sides, "side_entries", fake_entries)
    sides = [_side("cutefa"), _side("cutefa-base", with_feature=False), _side("FA4", wrong=True),
             _side("Flex", na="no sink logit")]  # fmt: skip
    timer = _Timer({"cutefa": 2.1, "cutefa-base": 2.0, "FA4": 1.0})
    lines = []
    for feature in ("softcap", "sinks", "window1k"):
        p = bench_features.Problem(feature, 16, pass_)
        lines.append(bench_features.run_problem(p, sides, timer, 3, 4, device="cpu"))
        r = lines[-1].results
        assert r["cutefa"].status == "ok" and r["cutefa-base"].status == "ok", (feature, r)
        assert r["FA4"].status == "FAIL" and r["FA4"].ms is None
        assert r["Flex"].status == "n/a"
        assert r["cutefa-base"].tflops == pytest.approx(p.flops(with_feature=False) / 2e-3 / 1e12)
    assert bench_features.cost(lines[0]) == "+5.0%" and bench_features.versus_dense(lines[0]) == "-"
    assert bench_features.cost(lines[2]) == "-"
    dense = lines[2].results
    assert (
        bench_features.versus_dense(lines[2]) == f"{dense['cutefa'].tflops / dense['cutefa-base'].tflops:.2f}"
    )
    text = bench_features.report(lines, ["cutefa", "cutefa-base", "FA4", "Flex"], {"rounds": 3})
    assert "n/a (no sink logit)" in text and "| FAIL |" in text


def _tag(fn, name):
    def call():
        return fn()

    call.side = name
    return call
