"""tools/bench.py's head dims on the CPU: ``--hdim`` items D and QK:V (and the errors for bad ones),
the cells and FLOPs of a V head dim of its own, the float32 reference and the checks with v of
another head dim than q's, and each backend's word on whether it takes a cell (n/a with its reason,
never run, never timed, out of the ratios, the plot and the failures)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cpu_support import load_tool, reference

bench = load_tool("bench")  # puts tools/ on sys.path: the siblings as the tools import them
import bench_backends
import bench_check
import bench_grid
import bench_report
import bench_run
from test_bench_fairness import Timer, _exact, _ScaleGrad
from test_bench_fairness import _fake as fairness_fake

# ---------------------------------------------------------------------------------------------
# --hdim


def test_hdim_items_are_plain_dims_and_qk_v_pairs():
    args = bench.parse_args(["--hdim", "80,112,192:128"])
    assert args.hdim == [(80, 80), (112, 112), (192, 128)]
    assert bench.parse_args(["--hdim", "128, 64:64,128"]).hdim == [(128, 128), (64, 64)]  # one cell each
    assert bench.parse_args([]).hdim == [(64, 64), (128, 128), (256, 256)]
    assert bench.parse_args(["--quick"]).hdim == [(128, 128)]
    assert bench_grid.parse_hdim(" 192:128 ") == (192, 128)
    assert bench_grid.hdim_text(192, 128) == "192:128" and bench_grid.hdim_text(80, 80) == "80"


@pytest.mark.parametrize("bad", ["192:", ":128", "0:128", "128:0", "0", "-8", "a", "192:128:64", "8.5", ","])
def test_bad_hdim_items_are_a_clear_argparse_error(bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--hdim", bad])
    err = capsys.readouterr().err
    assert "--hdim" in err and "QK:V" in err
    with pytest.raises(ValueError, match="positive integers"):
        bench_grid.parse_hdim(bad if bad != "," else "")


def test_quick_grid_is_unchanged():
    cells = bench_grid.grid(bench.parse_args(["--quick", "--causal", "0"]))
    assert [(c.hdim, c.v_dim, c.heads, c.kv_heads, c.seqlen) for c in cells] == [
        (128, 128, 16, 16, 1024), (128, 128, 16, 16, 4096), (128, 128, 32, 8, 1024), (128, 128, 32, 8, 4096),
    ]  # fmt: skip
    assert all(c.hdim_v is None for c in cells)
    assert cells[0].label == "fwd bf16 hd128 causal=0 s=1024"  # the label seeds the inputs: as before


def test_the_issue_grid_cells():
    """The issue's speed table: 80, 112 and 192:128 at 8k tokens, forward and backward, causal and
    not, "mha" heads = 2048 // d_qk (rounded down where it does not divide)."""
    line = "--hdim 80,112,192:128 --seqlen 8192 --pass fwd,bwd --causal both --heads mha"
    assert line in bench.__doc__  # the module docstring's example
    args = bench.parse_args(line.split())
    cells = bench_grid.grid(args)
    assert len(cells) == 2 * 3 * 2
    shapes = {(c.hdim, c.v_dim): (c.batch, c.heads, c.kv_heads) for c in cells}
    assert shapes == {(80, 80): (2, 25, 25), (112, 112): (2, 18, 18), (192, 128): (2, 10, 10)}
    deepseek = next(c for c in cells if c.v_dim == 128 and c.pass_ == "bwd" and c.causal)
    assert deepseek.label == "bwd bf16 hd192v128 causal=1 s=8192" and deepseek.hdim_text == "192:128"
    q, k, v, dout = bench_run.cell_inputs(
        bench_grid.Cell("bf16", 192, True, 64, "bwd", 4, 2, 1, hdim_v=128), device="cpu"
    )
    assert (q.shape, k.shape, v.shape, dout.shape) == (
        (1, 64, 4, 192),
        (1, 64, 2, 192),
        (1, 64, 2, 128),
        (1, 64, 4, 128),
    )


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("causal", [False, True])
def test_flops_count_both_head_dims_and_reduce_to_the_one_head_dim_formula(pass_, causal):
    b, h, s = 2, 10, 8192
    pair = bench_grid.Cell("bf16", 192, causal, s, pass_, h, h, b, hdim_v=128)
    fwd = 2.0 * b * h * s * s * (192 + 128)
    expected = fwd * (2.5 if pass_ == "bwd" else 1.0) / (2 if causal else 1)
    assert pair.flops == expected
    one = bench_grid.Cell("bf16", 128, causal, s, pass_, h, h, b)
    assert one.flops == 4.0 * b * h * s * s * 128 * (2.5 if pass_ == "bwd" else 1.0) / (2 if causal else 1)
    assert bench_grid.Cell("bf16", 128, causal, s, pass_, h, h, b, hdim_v=128) == one


def test_a_backward_variant_serves_its_own_v_head_dim_only():
    name = "cutefa_sm80_bwd_bf16_hd192v128_64x128_s1_w8"
    assert bench_grid.variant_serves(name, bench_grid.Cell("bf16", 192, False, 2048, "bwd", hdim_v=128))
    assert not bench_grid.variant_serves(name, bench_grid.Cell("bf16", 192, False, 2048, "bwd"))
    plain = "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_ov"
    assert not bench_grid.variant_serves(plain, bench_grid.Cell("bf16", 128, False, 2048, "bwd", hdim_v=64))


# ---------------------------------------------------------------------------------------------
# the reference with v of its own head dim


@pytest.mark.parametrize("causal", [False, True])
def test_attend_with_another_v_head_dim_matches_autograd(causal):
    gen = torch.Generator().manual_seed(5)
    sq, sk, group, d, dv = 11, 17, 2, 24, 16
    q = torch.randn(1, sq, group, d, generator=gen, requires_grad=True)
    k = torch.randn(1, sk, 1, d, generator=gen, requires_grad=True)
    v = torch.randn(1, sk, 1, dv, generator=gen, requires_grad=True)
    dout = torch.randn(1, sq, group, dv, generator=gen)
    out, _ = reference(q, k, v, causal, 0.2)
    (out * dout).sum().backward()
    got = bench_check.attend(
        q[0].detach().transpose(0, 1), k[0, :, 0].detach(), v[0, :, 0].detach(), causal=causal, scale=0.2,
        dout=dout[0].transpose(0, 1),
    )  # fmt: skip
    assert got["O"].shape == (group, sq, dv) and got["dV"].shape == (sk, dv) and got["dK"].shape == (sk, d)
    torch.testing.assert_close(got["O"], out[0].detach().transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["dQ"], q.grad[0].transpose(0, 1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["dK"], k.grad[0, :, 0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["dV"], v.grad[0, :, 0], atol=1e-5, rtol=1e-4)


def _fake(name, forward, refuses=None):
    """A fake backend (tests/test_bench_fairness.py) with a ``refuses`` check."""
    return dataclasses.replace(fairness_fake(name, forward), refuses=refuses)


def _pair_cell(pass_, causal=True, heads=(4, 2)):
    return bench_grid.Cell("bf16", 24, causal, 40, pass_, heads[0], heads[1], 2, hdim_v=16)


@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_checks_judge_v_of_its_own_head_dim(heads):
    """With d_v != d_qk a correct backend passes forward and backward (dQ, dK of d_qk; O, dV of d_v);
    a wrong dV, a wrong dK, or an output of q's head dim fails."""

    def wrong_dv(q, k, v, c):
        return _exact(q, k, _ScaleGrad.apply(v), c)

    def wrong_dk(q, k, v, c):
        return _exact(q, _ScaleGrad.apply(k), v, c)

    def q_width(q, k, v, c):  # an output of q's head dim: the first 16 columns right, 8 more
        out, lse = _exact(q, k, v, c)
        return torch.cat([out, out[..., :8]], dim=-1), lse

    backends = [_fake("good", _exact), _fake("wrong_dv", wrong_dv), _fake("wrong_dk", wrong_dk)]
    row = bench_run.run_cell(_pair_cell("bwd", heads=heads), backends, Timer(), rounds=1, device="cpu")
    assert row.results["good"].status == "ok" and set(row.results["good"].checks) == {"dQ", "dK", "dV"}
    assert row.results["wrong_dv"].status == "FAIL" and "dV rel" in row.results["wrong_dv"].error
    assert "dK" not in row.results["wrong_dv"].error and "dQ" not in row.results["wrong_dv"].error
    assert row.results["wrong_dk"].status == "FAIL" and "dK rel" in row.results["wrong_dk"].error
    fwd = bench_run.run_cell(
        _pair_cell("fwd", heads=heads), [_fake("good", _exact), _fake("q_width", q_width)], Timer(), rounds=1,
        device="cpu",
    )  # fmt: skip
    assert fwd.results["good"].status == "ok" and set(fwd.results["good"].checks) == {"O", "LSE"}
    assert fwd.results["q_width"].status == "FAIL" and "O rel inf" in fwd.results["q_width"].error


# ---------------------------------------------------------------------------------------------
# which backend takes which cell


def _one_head_dim(q, k, v, causal):
    return None if q.shape[-1] == v.shape[-1] else "wants one head dim for q, k and v. Got 24 and 16"


def test_a_backend_that_refuses_a_cell_is_na_with_its_reason_and_never_runs():
    calls = []

    def counted(q, k, v, c):
        calls.append(v.shape[-1])
        return _exact(q, k, v, c)

    backends = [
        _fake("cutefa", _exact),
        _fake("FA2", counted, refuses=_one_head_dim),
        _fake("FA4", _exact, refuses=lambda *a: None),
    ]
    timer = Timer()
    for pass_ in ("fwd", "bwd"):
        row = bench_run.run_cell(_pair_cell(pass_), backends, timer, rounds=2, device="cpu")
        fa2 = row.results["FA2"]
        assert fa2.status == "n/a" and fa2.error == "wants one head dim for q, k and v. Got 24 and 16"
        assert fa2.ms is None and fa2.tflops is None and row.value("FA2") is None
        assert row.results["cutefa"].status == "ok" and row.results["FA4"].status == "ok"
        assert row.ratio_fa2() is None  # no FA2 number: no ratio
        assert row.ratio_best() == pytest.approx(1.0)  # against FA4, the peer that ran
        assert bench_report.result_text(fa2) == "n/a (wants one head dim for q, k and v)"
    assert calls == [] and "FA2" not in timer.calls
    assert timer.calls.count("cutefa") == 2  # the forward cell's rounds (backward callables carry no name)
    same = bench_grid.Cell("bf16", 16, True, 40, "fwd", 4, 2, 2)
    row = bench_run.run_cell(same, backends, Timer(), rounds=1, device="cpu")
    assert row.results["FA2"].status == "ok" and calls == [16, 16, 16]  # warm-up, checked call, one round


def test_a_refusal_check_that_raises_leaves_the_decision_to_the_call():
    def broken(*a):
        raise RuntimeError("no such check here")

    row = bench_run.run_cell(
        _pair_cell("fwd"), [_fake("x", _exact, refuses=broken)], Timer(), rounds=1, device="cpu"
    )
    assert row.results["x"].status == "ok"


def test_when_every_backend_refuses_nothing_is_computed():
    row = bench_run.run_cell(
        _pair_cell("bwd"), [_fake("FA2", _exact, refuses=_one_head_dim)], Timer(), rounds=1, device="cpu"
    )
    assert row.results["FA2"].status == "n/a"


def test_the_report_shows_na_with_the_reason_and_notes_it_once():
    rows = []
    for causal in (False, True):
        row = bench_grid.Row(bench_grid.Cell("bf16", 192, causal, 8192, "fwd", hdim_v=128))
        row.results["cutefa"] = bench_grid.Result("ok", ms=1.0, tflops=500.0)
        row.results["FA2"] = bench_grid.Result("n/a", error="Flash attention requires q,k,v to have the same "
                                               "last dimension. Got Query.size(-1): 192 | Value: 128")  # fmt: skip
        rows.append(row)
    table = bench_report.markdown_table(rows, ["cutefa", "FA2"])
    assert "| fwd | bf16 | 192:128 | 0 | 8192 | 2 x 10/10 | 500 | n/a (Flash attention requires q,k,v to have the same " \
           "last dimension) |  |  |" in table  # fmt: skip
    notes = bench_report.not_taken_notes(rows)
    assert notes == [
        (
            "FA2 n/a on 2 cell(s) (fwd bf16 hd192v128 causal=0 s=8192, ...): Flash attention requires q,k,v to "
            "have the same last dimension. Got Query.size(-1): 192 | Value: 128"
        )
    ]
    text = bench_report.report_markdown({"rounds": 3, "slices": 3}, rows, ["cutefa", "FA2"], notes)
    assert "2*b*h*s^2*(d_qk + d_v)" in text and "n/a (why)" in text
    cell = bench_report.report_json({}, rows, [])["cells"][0]
    assert (cell["hdim"], cell["hdim_v"], cell["flops"]) == (192, 128, 2.0 * 2 * 10 * 8192**2 * 320)
    assert cell["results"]["FA2"]["status"] == "n/a"
    assert len(bench_report.short_reason("x" * 300)) == bench_report.REASON_CHARS


def test_plot_panels_keep_a_v_head_dim_of_its_own_apart():
    rows = [
        bench_grid.Row(bench_grid.Cell("bf16", 192, False, 8192)),
        bench_grid.Row(bench_grid.Cell("bf16", 192, False, 8192, hdim_v=128)),
    ]
    panels = bench_report.plot_panels(rows)
    assert list(panels) == [("fwd", "bf16", "192", False, ""), ("fwd", "bf16", "192:128", False, "")]
    assert bench_report.panel_title(("fwd", "bf16", "192:128", False, "")) == "fwd bf16 hd192:128 non-causal"


# ---------------------------------------------------------------------------------------------
# the real backends' checks (their libraries' own rules)


def test_cutefa_takes_its_head_dims_and_names_what_it_does_not():
    refuses = bench_backends._cutefa_refuses

    def dims(d, dv):
        return torch.empty(1, 8, 2, d), torch.empty(1, 8, 2, d), torch.empty(1, 8, 2, dv)

    for d, dv in ((80, 80), (112, 112), (192, 128), (64, 64), (256, 256)):
        assert refuses(*dims(d, dv), True) is None, (d, dv)
    why = refuses(*dims(128, 64), False)
    assert "head_dim_v=64" in why and "(192, 128)" in why
    assert "multiple of 8" in refuses(*dims(100, 100), False)
    loaded = bench_backends.load_backends(["cutefa"])[0]
    assert loaded.refuses is bench_backends._cutefa_refuses
    variant = bench_backends.bwd_variant_backend("cutefa_sm80_bwd_bf16_hd192v128_64x128_s1_w8", loaded)
    assert variant.refuses is loaded.refuses


def test_sdpa_backends_are_asked_only_where_v_has_its_own_head_dim(monkeypatch):
    """One head dim: called as before (no check). Another v head dim: torch's dispatcher check of
    that backend, its warning the reason ("Triggered internally" cut off); no warning: a plain one."""
    import warnings

    import torch.backends.cuda as tbc

    asked = []

    def flash(params, debug):
        asked.append(debug)
        warnings.warn(
            "Flash attention requires q,k,v to have the same last dimension and to be less than or equal "
            "to 256. Got Query.size(-1): 24, Key.size(-1): 24, Value.size(-1): 16 instead. (Triggered "
            "internally at sdp_utils.cpp:123.)",
            UserWarning,
            stacklevel=1,
        )
        return False

    monkeypatch.setattr(tbc, "can_use_flash_attention", flash)
    monkeypatch.setattr(tbc, "can_use_cudnn_attention", lambda params, debug: True)
    monkeypatch.setattr(tbc, "can_use_efficient_attention", lambda params, debug: False)
    q, k = torch.empty(1, 8, 4, 24), torch.empty(1, 8, 2, 24)
    v, v_same = torch.empty(1, 8, 2, 16), torch.empty(1, 8, 2, 24)
    fa2 = bench_backends.sdpa_refuses("FA2")
    assert fa2(q, k, v_same, True) is None and asked == []
    assert fa2(q, k, v, True) == (
        "Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256. "
        "Got Query.size(-1): 24, Key.size(-1): 24, Value.size(-1): 16 instead."
    )
    assert asked == [True]
    assert bench_backends.sdpa_refuses("cuDNN")(q, k, v, False) is None
    assert bench_backends.sdpa_refuses("efficient")(q, k, v, False) == (
        "torch's can_use_efficient_attention is False for this problem"
    )


def test_fa4_is_asked_through_its_own_validation(monkeypatch):
    """FA4's _validate_head_dims (an AssertionError: n/a with its message); an FA4 without it: the
    call decides."""
    import sys
    import types

    seen = []

    def validate(head_dim, head_dim_v, compute_capability, alignment):
        seen.append((head_dim, head_dim_v, compute_capability, alignment))
        if head_dim_v > 128:  # FA4 asserts (raised by hand here: pytest rewrites this file's asserts)
            raise AssertionError(
                f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM100/SM110."
            )

    module = types.ModuleType("flash_attn.cute.interface")
    module._validate_head_dims = validate
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    bf16 = {"dtype": torch.bfloat16}
    q, k = torch.empty(1, 8, 2, 192, **bf16), torch.empty(1, 8, 2, 192, **bf16)
    assert bench_backends._fa4_refuses(q, k, torch.empty(1, 8, 2, 128, **bf16), True) is None
    why = bench_backends._fa4_refuses(q, k, torch.empty(1, 8, 2, 192, **bf16), True)
    assert why == "FA4: (head_dim, head_dim_v)=(192, 192) is not supported on SM100/SM110."
    assert seen == [(192, 128, 10, 8), (192, 192, 10, 8)]
    monkeypatch.setitem(
        sys.modules, "flash_attn.cute.interface", types.ModuleType("flash_attn.cute.interface")
    )
    assert bench_backends._fa4_refuses(q, k, torch.empty(1, 8, 2, 192, **bf16), True) is None
