"""tools/bench_varlen.py on the CPU with fake sides: the grid (lengths, unmasked FLOPs), the packed
reference (sequence by sequence, an empty sequence inside the batch), a wrong or unwritten side
FAIL with no speed, a side that cannot run a cell "n/a (why)", the table, the JSON and --quick."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cpu_support import load_tool, reference

bench_varlen = load_tool("bench_varlen")
import bench_check
import bench_sides


def _packed(q, k, v, lengths, causal, shift=False):
    """Correct packed attention (out (total, h, d) in q's dtype, lse (h, total)), sequence by sequence;
    ``shift``: the last sequence's rows moved down by one (a wrong side)."""
    outs, lses, start = [], [], 0
    for n in lengths:
        rows = slice(start, start + n)
        o, lse = reference(q[None, rows].float(), k[None, rows].float(), v[None, rows].float(), causal,
                           1.0 / math.sqrt(q.shape[-1]))  # fmt: skip
        outs.append(o[0])
        lses.append(lse[0])
        start += n
    out, lse = torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)
    if shift:
        n = lengths[-1]
        out = torch.cat([out[:-n], out[-n:].roll(1, 0)])
    return out, lse


def _side(name, **how):
    def make(p):
        if how.get("na"):
            raise bench_sides.NotApplicable("no such call")
        return lambda q, k, v: _packed(q, k, v, list(p.lengths), p.causal, how.get("shift", False))

    return bench_sides.Side(name, make)


def _unwritten(name):
    def make(p):
        def fwd(q, k, v):
            out, lse = _packed(q, k, v, list(p.lengths), p.causal)
            fresh = torch.empty(out.shape, dtype=out.dtype)
            fresh[1:] = out[1:]  # row 0 never written: NaN when poisoned
            return fresh + 0 * q.sum(), lse

        return fwd

    return bench_sides.Side(name, make)


class _Timer:
    def __call__(self, fn):
        fn()
        return 2.0


def small(pass_="fwd", causal=True, lengths=(1, 17, 0, 40)):
    return bench_varlen.Problem("test", "bf16", 16, causal, pass_, tuple(lengths), heads_=2)


def test_the_grid_is_the_issues():
    longtail = bench_varlen.lengths_of("longtail")
    assert sum(longtail) == bench_varlen.TOKENS and longtail == bench_varlen.lengths_of("longtail")
    assert max(longtail) <= bench_varlen.MAX_DOC and min(longtail) >= 1
    short = sum(n <= 256 for n in longtail)
    assert (
        short > len(longtail) / 2 and max(longtail) > 8 * sorted(longtail)[len(longtail) // 2]
    )  # long-tailed
    assert bench_varlen.lengths_of("8x2k") == [2048] * 8
    c = bench_varlen.lengths_of("64x100-300")
    assert len(c) == 64 and all(100 <= n <= 300 for n in c)
    ps = bench_varlen.problems(
        bench_varlen.GROUPS, ("bf16", "fp16"), (64, 128, 256), (False, True), ("fwd", "bwd")
    )
    assert len(ps) == 3 * 2 * 3 * 2 * 2 and {p.heads for p in ps if p.hdim == 128} == {16}
    quick = bench_varlen.parse_args(["--quick"])
    assert (quick.groups, quick.dtype, quick.hdim) == (["longtail", "8x2k"], ["bf16"], [128])
    with pytest.raises(SystemExit):
        bench_varlen.parse_args(["--groups", "nope"])


def test_flops_count_only_the_unmasked_pairs():
    assert bench_varlen.attended_pairs(4, 4, False) == 16
    assert bench_varlen.attended_pairs(4, 4, True) == 10
    assert bench_varlen.attended_pairs(2, 5, True) == 4 + 5  # bottom-right
    assert bench_varlen.attended_pairs(0, 3, True) == 0
    f = bench_varlen.flops([3, 0, 2], heads=2, hdim=8, causal=True, pass_="bwd")
    assert f == 2.5 * 4 * 2 * 8 * (6 + 0 + 3)


def test_packed_reference_matches_attention_sequence_by_sequence():
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 0, 9, 1]
    q, k, v, dout = (torch.randn(13, 4, 16, generator=gen).bfloat16().float() for _ in range(4))
    q = q.requires_grad_()
    out, lse = _packed(q, k, v, lengths, True)
    (out * dout).sum().backward()
    low = [x.detach().bfloat16() for x in (q, k, v)]
    e = bench_check.packed_expectation(*low, lengths, lengths, causal=True, scale=0.25, slices=16)
    assert e.spans == [(0, 3, 0, 3), (3, 0, 3, 0), (3, 9, 3, 9), (12, 1, 12, 1)]
    assert e.judge((out.detach().bfloat16(), lse.detach())).ok
    assert not e.judge((out.detach().bfloat16(), lse.detach() + 1e-2)).ok
    g = bench_check.packed_expectation(q.detach(), k, v, lengths, lengths, causal=True, scale=0.25, dout=dout,
                                       slices=16)  # fmt: skip
    dq_only = g.sample((q.grad, torch.zeros_like(k), torch.zeros_like(v)))["dQ"]
    torch.testing.assert_close(dq_only, g.expect["dQ"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_wrong_and_unwritten_sides_fail_and_get_no_speed(pass_):
    sides = [
        _side("cutefa"), _side("FA4", shift=True), _unwritten("FA2"), _side("cuDNN", na=True),
        bench_sides.Side("cutefa-dense", None, "not installed"),
    ]  # fmt: skip
    line = bench_varlen.run_problem(small(pass_), sides, _Timer(), rounds=3, slices=8, device="cpu")
    r = line.results
    assert r["cutefa"].status == "ok" and r["cutefa"].tflops == pytest.approx(line.flops / 2e-3 / 1e12)
    assert r["FA4"].status == "FAIL" and r["FA4"].ms is None
    if pass_ == "fwd":  # an unwritten forward row reads NaN
        assert r["FA2"].status == "FAIL" and "not finite" in r["FA2"].error
    assert r["cuDNN"].status == "n/a" and r["cuDNN"].error == "no such call"
    text = bench_varlen.report([line], list(r), {"gpu": "cpu", "rounds": 3})
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| {line.label}"))
    assert "| FAIL |" in row and "n/a (no such call)" in row and "n/a (not installed)" in row
    assert "Failures and errors" in text and "FA4: FAIL" in text


def test_the_dense_side_compares_with_the_varlen_call(tmp_path):
    p = small(lengths=(8, 8))
    line = bench_varlen.run_problem(p, [_side("cutefa"), _side("cutefa-dense")], _Timer(), 3, 4, device="cpu")
    text = bench_varlen.report([line], ["cutefa", "cutefa-dense"], {})
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| {line.label}"))
    assert row.endswith("| - | 1.00x |")  # no peer; varlen over dense
    bench_sides.write_json(tmp_path / "x.json", {"gpu": "cpu"}, [line])
    blob = json.loads((tmp_path / "x.json").read_text())
    assert blob["rows"][0]["results"]["cutefa"]["status"] == "ok"
    unequal = bench_varlen._cutefa_dense()
    if unequal.make is not None:
        with pytest.raises(bench_sides.NotApplicable):
            unequal.make(small())


def test_packed_lse_layouts():
    x = torch.zeros(3, 10)
    assert bench_varlen.packed_lse(x, 3, 10).data_ptr() == x.data_ptr()
    assert bench_varlen.packed_lse(torch.zeros(10, 3), 3, 10).shape == (3, 10)
    assert bench_varlen.packed_lse(torch.zeros(1, 3, 10, 1), 3, 10).shape == (3, 10)
    assert bench_varlen.packed_lse(torch.zeros(4, 10), 3, 10) is None
    assert bench_varlen.packed_lse(None, 3, 10) is None


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib draws the PNG")
    line = bench_varlen.run_problem(small(), [_side("cutefa")], _Timer(), 1, 2, device="cpu")
    assert (
        bench_sides.plot([line], ["cutefa"], tmp_path / "a.png", "t") and (tmp_path / "a.png").stat().st_size
    )


def test_variant_tails_complete_per_cell():
    p = small(causal=True)
    tail = "128x128_s2_w12_varlen_ov_pp_hfirst"
    assert (
        bench_varlen.variant_name(tail, p)
        == "cutefa_sm90_fwd_bf16_hd16_128x128_s2_w12_causal_varlen_ov_pp_hfirst"
    )
    flat = bench_varlen.Problem("t", "fp16", 128, False, "fwd", (3,), heads_=1)
    assert (
        bench_varlen.variant_name(tail, flat)
        == "cutefa_sm90_fwd_fp16_hd128_128x128_s2_w12_varlen_ov_pp_hfirst"
    )
    # a causal tail runs non-causal in a non-causal cell: one column per configuration
    assert bench_varlen.variant_name("128x128_s2_w12_causal_varlen_ov_pp", flat).endswith(
        "_128x128_s2_w12_varlen_ov_pp"
    )
    with pytest.raises(ValueError, match="varlen"):
        bench_varlen.variant_name("128x128_s2_w12_ov_pp", flat)
    args = bench_varlen.parse_args(["--quick", "--variants", f"{tail}, 128x176_s2_w12_varlen_ov_pp_pcvt"])
    assert args.variants == [tail, "128x176_s2_w12_varlen_ov_pp_pcvt"] and args.sides[0] == "cutefa"
    for bad in ("128x128_s2_w12_ov_pp", "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_varlen_ov_pp"):
        with pytest.raises(SystemExit):
            bench_varlen.parse_args(["--variants", bad])


def test_direct_sides_are_forward_only_and_report_against_cutefa():
    sides = bench_varlen.variant_sides(["128x128_s2_w12_varlen_ov_pp_hfirst", "128x128_s2_w12_varlen_ov_pp_lpt"])
    assert [s.name for s in sides] == ["cutefa:128x128_s2_w12_varlen_ov_pp_hfirst", "cutefa:128x128_s2_w12_varlen_ov_pp_lpt"]
    for side in sides:
        assert side.make is not None, side.missing
        with pytest.raises(bench_sides.NotApplicable, match="forward only"):
            side.make(small("bwd"))
    line = bench_varlen.run_problem(
        small(), [_side("cutefa"), _side("cutefa:lpt")], _Timer(), 3, 4, device="cpu"
    )
    text = bench_varlen.report([line], ["cutefa", "cutefa:lpt"], {})
    assert "| cutefa:lpt / cutefa |" in text.splitlines()[4]
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| {line.label}"))
    assert row.endswith("| 1.00x |")
