"""tools/bench_fp8.py's side-by-side mode picks its columns on the CPU: the default e4m3 variant
first, then the requested (or every committed and measured) alternative, one column per causal pair."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from cpu_support import all_variants, load_tool, reference

from cutefa.model.defaults import default_spec
from cutefa.model.rules import why_invalid

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench_fp8.py"


def _bench():
    spec = importlib.util.spec_from_file_location("cutefa_tools_bench_fp8", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_all_variants_cover_every_e4m3_variant():
    columns = _bench().variant_columns(None, [128, 256])
    variants = [s for s in all_variants("sm90", "fwd") if s.dtype == "e4m3" and s.head_dim in (128, 256)]
    shown = {s.replace(causal=c) for specs in columns.values() for s in specs for c in (False, True)}
    shown = {s for s in shown if why_invalid(s) is None}  # any mask twin the rules refuse
    assert shown == set(variants)
    for hdim, specs in columns.items():
        default = specs[0]
        assert default not in load_tool("alternatives").fp8_alternative_specs()
        assert default == default_spec("sm90", "fwd", "e4m3", hdim)
        assert all(not s.causal and s.head_dim == hdim for s in specs)
        assert len(set(specs)) == len(specs)


def test_named_variants_get_the_default_beside_them():
    alt = next(s for s in load_tool("alternatives").fp8_alternative_specs() if s.head_dim == 256 and s.causal)
    columns = _bench().variant_columns([alt.name], None)
    assert list(columns) == [256]
    assert columns[256][1] == alt.replace(causal=False)
    assert columns[256][0] == default_spec("sm90", "fwd", "e4m3", 256)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp", "not an sm90 e4m3 forward variant"),
        (
            "cutefa_sm90_fwd_e4m3_hd128_64x128_s2_w8_ov_pp",
            "cannot be built: pingpong needs two or three consumer",
        ),
    ],
)
def test_bad_variant_names_raise(name, match):
    with pytest.raises(ValueError, match=match):
        _bench().variant_columns([name], None)


def test_fp8_accuracy_reference_is_plain_attention():
    """tools/fp8_accuracy.py's float32 reference is plain attention (causal bottom-right, sq < sk
    too), and its emulation rounds P to e4m3 only: within e4m3's rounding of the reference."""
    from cpu_support import rand, reference

    tool = load_tool_fp8_accuracy()
    q, k, v = rand(1, 5, 2, 16, seed=1), rand(1, 9, 2, 16, seed=2), rand(1, 9, 2, 16, seed=3) + 1.0
    for causal in (False, True):
        expect, _ = reference(q, k, v, causal, 0.25)
        got = tool._reference(q, k, v, causal, 0.25, p_e4m3=False)
        assert torch.allclose(got, expect, atol=1e-5), causal
        emul = tool._reference(q, k, v, causal, 0.25, p_e4m3=True)
        assert 0 < tool._rel_l2(emul, expect) < 2.0**-4, causal


def test_fp8_accuracy_takes_e4m3_forwards_only():
    tool = load_tool_fp8_accuracy()
    with pytest.raises(SystemExit):
        tool.main(["--variants", "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp"])


def load_tool_fp8_accuracy():
    from cpu_support import load_tool

    return load_tool("fp8_accuracy")


def test_fp8_columns_are_checked_against_the_dequantized_inputs():
    """The main table's checks on the CPU: the attention of the dequantized e4m3 inputs (rounded to
    bf16, as a kernel stores it) passes the fp8 check; the same with its centered v's mean left out
    fails the v_mean check; a NaN fails; the bar comes from the e4m3 rounding of P."""
    tool = _bench()
    from cutefa.fp8 import dequantize_fp8

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 96, 2, 32, generator=gen) for _ in range(3))
    v = v + 0.5
    ex = tool._expectations(torch, cutefa_module(), q, k, v, True, 2)
    _, quant, (vc, vcd), v_mean = ex["inputs"]
    deq = [dequantize_fp8(x, d) for x, d in quant]
    out, lse = reference(*deq, True, 1 / 32**0.5)
    assert tool._judge(ex["fp8"])((out.bfloat16(), lse)).ok
    assert tool._judge(ex["bf16"])((out.bfloat16(), lse)).errors["O"]["rel"] > 0  # other inputs
    centered, lse_c = reference(deq[0], deq[1], dequantize_fp8(vc, vcd), True, 1 / 32**0.5)
    assert not tool._judge(ex["v_mean"])((centered.bfloat16(), lse_c)).ok
    assert tool._judge(ex["v_mean"])(((centered + v_mean[:, None]).bfloat16(), lse_c)).ok
    bad = out.bfloat16().clone()
    bad[0, 5, 1, 3] = float("nan")
    assert not tool._judge(ex["fp8"])((bad, lse)).ok
    bar = ex["fp8"].bars["O"]
    assert 3 * 2.0**-9 < bar.rel < 0.2  # P in e4m3 (3 mantissa bits) is far coarser than bf16
    info = {}
    tool._judge(ex["fp8"], ex["exact"], info, "fp8")((out.bfloat16(), lse))
    assert 0 < info["fp8"] < 0.2  # what quantizing the inputs costs


def cutefa_module():
    import cutefa

    return cutefa
