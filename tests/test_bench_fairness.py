"""The benchmarks' checks and timing rules on the CPU, with fake backends (tools/bench_check.py,
tools/bench_run.py): a backend with a wrong dK, an unwritten output element (NaN only because the
outputs are poisoned), a shifted row or a wrong log-sum-exp is FAIL and never timed; a correct one
passes; backends are timed in turns, round after round, and the median kept; the reference and the
bars are what the documentation says."""

from __future__ import annotations

import math

import pytest
import torch
from cpu_support import load_tool, reference

bench_run = load_tool("bench_run")  # puts tools/ on sys.path: the siblings as the tools import them
import bench_backends
import bench_check
import bench_grid
import bench_sides


def _exact(q, k, v, causal):
    """(out in q's dtype, lse float32) of float32 attention, differentiable: a correct backend."""
    out, lse = reference(q.float(), k.float(), v.float(), causal, 1.0 / math.sqrt(q.shape[-1]))
    return out.to(q.dtype), lse


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times 1.5: a backward that gets one input's gradient wrong."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.5


def _fake(name, forward):
    """A Backend whose forward is ``forward(q, k, v, causal) -> (out, lse)``; its timed callable
    carries the backend's name (for the order of the turns)."""

    def make(q, k, v, causal):
        def call():
            return forward(q, k, v, causal)

        call.backend = name
        return call

    return bench_backends.Backend(name, make)


def good():
    return _fake("good", _exact)


def wrong_dk():
    return _fake("wrong_dk", lambda q, k, v, c: _exact(q, _ScaleGrad.apply(k), v, c))


def unwritten_row():
    """Writes every output row but the first into a fresh torch.empty tensor: the row reads NaN
    only when allocations are poisoned (outside, torch.empty on the CPU is whatever memory held)."""

    def forward(q, k, v, causal):
        ref, lse = _exact(q, k, v, causal)
        out = torch.empty(ref.shape, dtype=ref.dtype)
        out[:, 1:] = ref[:, 1:]
        return out, lse

    return _fake("unwritten_row", forward)


def shifted_row():
    def forward(q, k, v, causal):
        ref, lse = _exact(q, k, v, causal)
        return torch.cat([ref[:, :1], ref[:, :-1]], dim=1), lse

    return _fake("shifted_row", forward)


def lse_off(delta):
    def forward(q, k, v, causal):
        out, lse = _exact(q, k, v, causal)
        return out, lse + delta

    return _fake("lse_off", forward)


def raises():
    def forward(q, k, v, causal):
        raise RuntimeError("no kernel for this")

    return _fake("raises", forward)


def nan_grad():
    class NanGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            g.view(-1)[0] = math.nan
            return g

    return _fake("nan_grad", lambda q, k, v, c: _exact(q, k, NanGrad.apply(v), c))


class Timer:
    """A fake ``time_ms``: records which backend each call timed and answers from a script."""

    def __init__(self, times=None):
        self.calls, self.times = [], times or {}

    def __call__(self, fn):
        name = getattr(fn, "backend", "?")
        self.calls.append(name)
        fn()
        count = self.calls.count(name)
        return self.times.get(name, [1.0, 2.0, 3.0, 4.0, 5.0])[count - 1]


def small(pass_="fwd", causal=True, heads=(4, 2)):
    return bench_grid.Cell("bf16", 16, causal, 48, pass_, heads[0], heads[1], 2)


# ---------------------------------------------------------------------------------------------
# the reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk", "group"), [(13, 13, 1), (9, 20, 2), (20, 9, 3)])
def test_attend_matches_autograd_of_plain_attention(causal, sq, sk, group):
    """:func:`attend` in float32 (its row-block forward and its hand-written backward) against
    autograd of plain attention, grouped heads and bottom-right causal masking (rows without a key
    included), with row blocks smaller than the problem."""
    gen = torch.Generator().manual_seed(sq * 100 + sk + group)
    q = torch.randn(1, sq, group, 16, generator=gen, requires_grad=True)
    k = torch.randn(1, sk, 1, 16, generator=gen, requires_grad=True)
    v = torch.randn(1, sk, 1, 16, generator=gen, requires_grad=True)
    dout = torch.randn(1, sq, group, 16, generator=gen)
    scale = 0.3
    out, lse = reference(q, k, v, causal, scale)
    (out * dout).sum().backward()
    saved = bench_check.BLOCK_ELEMENTS
    bench_check.BLOCK_ELEMENTS = 4 * sk  # 4 rows per block
    try:
        got = bench_check.attend(
            q[0].detach().transpose(0, 1), k[0, :, 0].detach(), v[0, :, 0].detach(), causal=causal, scale=scale,
            dout=dout[0].transpose(0, 1),
        )  # fmt: skip
    finally:
        bench_check.BLOCK_ELEMENTS = saved
    torch.testing.assert_close(got["O"], out[0].detach().transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(got["LSE"]), torch.isneginf(lse[0]))
    live = torch.isfinite(lse[0])
    torch.testing.assert_close(got["LSE"][live], lse[0][live].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["dQ"], q.grad[0].transpose(0, 1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["dK"], k.grad[0, :, 0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["dV"], v.grad[0, :, 0], atol=1e-5, rtol=1e-4)


def test_low_precision_reference_rounds_and_the_bar_is_as_documented():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 40, 2, 16, generator=gen).bfloat16() for _ in range(3))
    dout = torch.randn(2, 40, 2, 16, generator=gen).bfloat16()
    e = bench_check.expectation(q, k, v, causal=True, scale=0.25, dout=dout, slices=2, seed=3)
    assert e.slices == [(0, 0), (1, 1)]
    for name in ("dQ", "dK", "dV"):
        exact, low = [], []
        for b, h in e.slices:
            args = (q[b, :, h : h + 1].transpose(0, 1), k[b, :, h], v[b, :, h])
            do = dout[b, :, h : h + 1].transpose(0, 1)
            exact.append(bench_check.attend(*args, causal=True, scale=0.25, dout=do)[name])
            low.append(
                bench_check.attend(*args, causal=True, scale=0.25, dtype=torch.bfloat16, dout=do)[name]
            )
        exact, low = torch.stack(exact), torch.stack(low)
        assert torch.equal(e.expect[name], exact)
        rel, worst = bench_check.rel_l2(low, exact), bench_check.max_abs(low, exact)
        assert 0 < rel < 0.05  # the bf16 computation is off, and not wildly
        eps = torch.finfo(torch.bfloat16).eps
        assert e.bars[name].rel == pytest.approx(3 * rel + eps / 2)
        assert e.bars[name].abs == pytest.approx(3 * worst + eps * exact.abs().max().item())
    fwd = bench_check.expectation(q, k, v, causal=True, scale=0.25, slices=2, seed=3)
    eps32 = torch.finfo(torch.float32).eps
    assert fwd.bars["LSE"].rel > eps32 / 2  # from the bf16 scores' error, not a float32 epsilon alone
    assert fwd.bars["LSE"].abs < 0.2


def test_e4m3_lse_bar_allows_the_score_sums_precision_and_no_more():
    """One key: the e4m3 reference's own LSE error is float32 rounding, so only ``score_eps`` lets
    an fp8 kernel's shorter score sums pass; the bar grows by score_eps * scale * max sum |q k|."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 1, 2, 64, generator=gen) for _ in range(3))
    common = {"causal": False, "scale": 0.125, "slices": 2, "low_dtype": torch.float32, "out_dtype": torch.bfloat16}
    plain = bench_check.expectation(q, k, v, **common, p_round=bench_check.round_e4m3)
    fp8 = bench_check.expectation(q, k, v, **common, p_round=bench_check.round_e4m3, score_eps=2.0**-10)
    sums = max((q[0, :, h].abs() @ k[0, :, h].abs().T).max().item() for h in range(2))
    allowed = 2.0**-10 * 0.125 * sums
    assert fp8.bars["LSE"].abs == pytest.approx(plain.bars["LSE"].abs + allowed)
    assert fp8.bars["O"] == plain.bars["O"]
    lse = fp8.expect["LSE"]
    assert fp8.bars["LSE"].abs < 0.01
    shifted = lse + allowed / 2  # within the score sums' precision
    assert bench_check.max_abs(shifted, lse) <= fp8.bars["LSE"].abs
    assert bench_check.max_abs(shifted, lse) > plain.bars["LSE"].abs
    assert bench_check.max_abs(lse + 0.01, lse) > fp8.bars["LSE"].abs


def test_errors_treat_nan_as_a_failure_and_equal_infinities_as_equal():
    ref = torch.tensor([1.0, -math.inf, 2.0])
    assert bench_check.rel_l2(ref.clone(), ref) == 0.0
    assert bench_check.max_abs(ref.clone(), ref) == 0.0
    assert bench_check.rel_l2(torch.tensor([1.0, math.nan, 2.0]), ref) == math.inf
    assert bench_check.max_abs(torch.tensor([1.0, 0.0, 2.0]), ref) == math.inf
    v = bench_check.judge(
        {"X": torch.tensor([math.nan])}, {"X": torch.tensor([1.0])}, {"X": bench_check.Bar(1, 1)}
    )
    assert not v.ok and "X" in v.message


def test_slices_first_last_and_seeded():
    s = bench_check.sample_slices(4, 8, 3, seed=1)
    assert s[:2] == [(0, 0), (3, 7)] and len(set(s)) == 3
    assert s == bench_check.sample_slices(4, 8, 3, seed=1)
    assert bench_check.sample_slices(1, 2, 3) == [(0, 0), (0, 1)]


def test_poisoned_allocations_fill_nan_and_restore():
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    with bench_check.poisoned_allocations("cpu"):
        assert torch.isnan(torch.empty(16)).all()
        assert (torch.empty(4, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    ) == before


# ---------------------------------------------------------------------------------------------
# fake backends through run_cell


def test_a_correct_backend_passes_and_wrong_ones_fail_without_a_time():
    timer = Timer()
    backends = [good(), unwritten_row(), shifted_row(), lse_off(0.5), raises()]
    row = bench_run.run_cell(small("fwd"), backends, timer, rounds=3, device="cpu")
    assert row.results["good"].status == "ok"
    assert row.results["good"].ms == 2.0 and row.results["good"].rounds_ms == [1.0, 2.0, 3.0]
    assert set(row.results["good"].checks) == {"O", "LSE"}
    for name, what in (
        ("unwritten_row", "O: 128 of 6144 elements not finite"),
        ("shifted_row", "O rel"),
        ("lse_off", "LSE rel"),
    ):
        res = row.results[name]
        assert res.status == "FAIL", name
        assert what in res.error, (name, res.error)
        assert res.ms is None and res.tflops is None and res.text() == "FAIL"
    assert row.results["raises"].status == "err" and "no kernel for this" in row.results["raises"].error
    assert set(timer.calls) == {"good"}  # only what passed was timed


def test_unwritten_elements_fail_only_because_outputs_are_poisoned(monkeypatch):
    """Without the poisoning the unwritten row could read as anything (here: zeros), which a loose
    check could let through; with it, the row is NaN and fails the finiteness check."""
    seen = []
    real = bench_check.poisoned_allocations

    def spy(device):
        seen.append(device)
        return real(device)

    monkeypatch.setattr(bench_check, "poisoned_allocations", spy)
    row = bench_run.run_cell(small("fwd"), [unwritten_row()], Timer(), rounds=1, device="cpu")
    assert seen == ["cpu"]  # once: the checked call
    assert row.results["unwritten_row"].status == "FAIL"
    assert "not finite" in row.results["unwritten_row"].error


def test_a_wrong_dk_fails_the_backward_and_a_nan_gradient_too():
    timer = Timer()
    row = bench_run.run_cell(small("bwd"), [good(), wrong_dk(), nan_grad()], timer, rounds=3, device="cpu")
    assert row.results["good"].status == "ok"
    assert set(row.results["good"].checks) == {"dQ", "dK", "dV"}
    bad = row.results["wrong_dk"]
    assert bad.status == "FAIL" and "dK rel" in bad.error and "dQ" not in bad.error and "dV" not in bad.error
    assert bad.ms is None
    assert row.results["nan_grad"].status == "FAIL" and "dV" in row.results["nan_grad"].error
    assert len(row.results["good"].rounds_ms) == 3


@pytest.mark.parametrize("heads", [(4, 1), (6, 2)], ids=["mqa", "gqa3"])
def test_grouped_query_cells_check_the_summed_dk_dv(heads):
    row = bench_run.run_cell(small("bwd", heads=heads), [good(), wrong_dk()], Timer(), rounds=1, device="cpu")
    assert row.results["good"].status == "ok"
    assert row.results["wrong_dk"].status == "FAIL"


def test_backends_are_timed_in_turns_rotating_each_round():
    names = ["a", "b", "c"]
    timer = Timer({n: [3.0, 1.0, 2.0, 9.0] for n in names})
    backends = [_fake(n, _exact) for n in names] + [shifted_row()]
    row = bench_run.run_cell(small("fwd"), backends, timer, rounds=4, device="cpu")
    assert timer.calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    for n in names:
        assert row.results[n].rounds_ms == [3.0, 1.0, 2.0, 9.0]
        assert row.results[n].ms == 2.5  # the median of the rounds
        assert row.results[n].tflops == pytest.approx(row.cell.flops / 2.5e-3 / 1e12)
    assert bench_run.turn_order(3, 0) == [0, 1, 2] and bench_run.turn_order(3, 5) == [2, 0, 1]


def test_a_backend_that_raises_in_a_later_round_loses_its_time():
    calls = {"n": 0}

    def flaky(fn):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("launch failed")
        return 1.0

    row = bench_run.run_cell(small("fwd"), [good()], flaky, rounds=3, device="cpu")
    res = row.results["good"]
    assert res.status == "err" and res.ms is None and "round 2" in res.error


def test_preallocated_outputs_are_poisoned_before_the_checked_call():
    """A kernel called with outputs allocated once: the warm-up call writes them, so they are
    filled with NaN before the checked call; a kernel that skips a row is then caught."""
    q, k, v = (torch.randn(1, 8, 2, 16).bfloat16() for _ in range(3))
    ref, lse = _exact(q, k, v, False)
    out, lse_out = torch.empty_like(ref), torch.empty_like(lse)
    calls = {"n": 0}

    def launch():
        calls["n"] += 1
        rows = slice(None) if calls["n"] == 1 else slice(1, None)  # the second call skips row 0
        out[:, rows] = ref[:, rows]
        lse_out.copy_(lse)

    expect = bench_check.expectation(q, k, v, causal=False, scale=0.25, slices=2)
    entry = bench_run.Entry("kernel", lambda: bench_run.Preallocated(launch, (out, lse_out)), expect.judge)
    res = bench_run.run_entries([entry], Timer(), rounds=1, device="cpu")["kernel"]
    assert res.status == "FAIL" and "not finite" in res.error


def test_a_fresh_check_makes_its_callable_inside_the_poisoned_block():
    """A backward entry (``check_fresh``) is made again for the checked call, within the poisoned
    block (deterministic mode on), so its forward runs in the mode its backward will; the timed
    callable is the one made outside."""
    q, k, v = (torch.randn(1, 8, 2, 16).bfloat16() for _ in range(3))
    ref, lse = _exact(q, k, v, False)
    expect = bench_check.expectation(q, k, v, causal=False, scale=0.25, slices=2)
    modes = []

    def make():
        modes.append(torch.are_deterministic_algorithms_enabled())
        return lambda: (ref.clone(), lse.clone())

    entry = bench_run.Entry("fresh", make, expect.judge, check_fresh=True)
    timed = []
    res = bench_run.run_entries([entry], lambda fn: timed.append(fn) or 1.0, rounds=2, device="cpu")["fresh"]
    assert res.status == "ok" and res.ms == 1.0
    assert modes == [False, True]  # made for warm-up and timing, then again for the check
    assert len(timed) == 2 and not torch.are_deterministic_algorithms_enabled()
    sides_entry = bench_sides.side_entries(
        [bench_sides.Side("s", lambda p: lambda q, k, v: (q, None))], None, (q, k, v, q), expect, "bwd"
    )[0][0]
    assert sides_entry.check_fresh


def test_default_rounds_are_three():
    assert bench_run.ROUNDS == 3
    assert load_tool("bench").parse_args([]).rounds == 3
    assert load_tool("bench_bwd_variants").parse_args([]).rounds == 3
    assert load_tool("bench_fp8").parse_args([]).rounds == 3


def test_lse_shapes_are_brought_to_batch_heads_seqlen():
    x = torch.zeros(2, 3, 64, 1)  # (b, h, padded s, 1)
    assert bench_backends.canonical_lse(x, 2, 3, 50).shape == (2, 3, 50)
    assert bench_backends.canonical_lse(torch.zeros(2, 50, 3), 2, 3, 50).shape == (2, 3, 50)
    assert bench_backends.canonical_lse(None, 2, 3, 50) is None
    with pytest.raises(ValueError, match="log-sum-exp of shape"):
        bench_backends.canonical_lse(torch.zeros(3, 2, 50), 2, 3, 50)
