"""The tuner's table building and timing order (CPU: a fake timer, no GPU)."""

import math

from cutefa.model.options import OAccum, Quant
from cutefa.model.spec import parse_name
from cutefa.tune import Measurement, _time_in_rounds, _timed_if_correct, gpu_token, table_entries


def _m(seqlen, variant, tflops, causal=False, head_dim=128):
    return Measurement("bf16", head_dim, causal, seqlen, variant, tflops, 1e-3)


def test_winner_per_length_and_buckets():
    ms = [
        _m(1024, "a", 300.0), _m(1024, "b", 310.0),
        _m(4096, "a", 350.0), _m(4096, "b", 340.0),
        _m(16384, "a", 360.0), _m(16384, "b", 355.0),
    ]  # fmt: skip
    assert table_entries(ms) == [
        {"dtype": "bf16", "head_dim": 128, "causal": False, "max_seqlen_k": 1024, "variant": "b"},
        {"dtype": "bf16", "head_dim": 128, "causal": False, "max_seqlen_k": None, "variant": "a"},
    ]


def test_wrong_variants_never_win_and_groups_stay_apart():
    ms = [_m(1024, "fast_but_wrong", None), _m(1024, "slow", 100.0), _m(1000, "c", 50.0, causal=True)]
    entries = table_entries(ms)
    assert [e["variant"] for e in entries] == ["slow", "c"]
    assert all(e["max_seqlen_k"] is None for e in entries)  # one length each: it covers everything


def test_non_power_of_two_lengths_round_up():
    ms = [_m(1000, "a", 1.0), _m(3000, "b", 1.0), _m(9000, "a", 1.0)]
    assert [e["max_seqlen_k"] for e in table_entries(ms)] == [1024, 4096, None]


def test_gpu_token():
    assert gpu_token("NVIDIA H200") == "H200"
    assert gpu_token("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_token("NVIDIA A100-SXM4-80GB") == "A100"
    assert gpu_token("Some Card") == "Card"


def test_rounds_are_taken_in_turns_and_the_median_kept():
    """Every run is timed once per round, in order, round after round; each result is the median of
    its own samples, so one outlier sample does not move it."""
    order, samples = [], {"a": iter([5.0, 1.0, 1.2]), "b": iter([2.0, 2.2, 9.0])}

    def timer(run):
        order.append(run())
        return next(samples[order[-1]])

    ms = _time_in_rounds([lambda: "a", lambda: "b"], 3, timer)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert ms == [1.2, 2.2]


def test_only_correct_candidates_are_timed():
    """A candidate whose error is over the tolerance, or NaN, is recorded with no speed and never
    timed; the others get TFLOP/s from their median time."""
    spec = parse_name("cutefa_sm80_bwd_bf16_hd128_64x128_s1_w8_dqtile")
    timed = []

    def timer(run):
        timed.append(run())
        return 2.0  # ms

    cands = [(spec, lambda: "ok", 1e-3), (spec, lambda: "wrong", 0.5), (spec, lambda: "nan", math.nan)]
    out = _timed_if_correct(cands, 4096, 2e-2, 1e9, timer, 2, progress=False)
    assert timed == ["ok", "ok"]
    assert [m.tflops for m in out] == [0.5, None, None]
    assert [m.error for m in out][:2] == [1e-3, 0.5] and math.isnan(out[2].error)


def test_e4m3_entries_accumulate_in_two_levels_or_take_the_means():
    """cutefa tune times every committed e4m3 variant. Where a head dim and mask have two-level
    variants (hd128 on sm90) the plain entries name only those; v_centered entries name only
    variants that take v's column means (v_mean), where there are any; plain entries never do."""
    from cutefa import tune
    from cutefa.model.committed import default_variants

    fp8 = tune.tuning_candidates("sm90", "fwd", ("e4m3",), None, "sm_90a")
    committed = {
        s for s in default_variants("sm90", "fwd") if s.dtype == "e4m3" and s.options.quant is Quant.TENSOR
    }  # fmt: skip
    assert set(fp8) == committed and any(s.options.o_accum is OAccum.TWO_LEVEL for s in fp8) and any(s.options.v_mean for s in fp8)
    plain = "cutefa_sm90_fwd_e4m3_hd128_192x96_s2_w16_ov_hvt_lres"
    tl, tl_persist = plain + "_tlacc", "cutefa_sm90_fwd_e4m3_hd128_192x96_s2_w16_ov_persist_hvt_lres_tlacc"
    hd256 = "cutefa_sm90_fwd_e4m3_hd256_128x96_s2_w12_ov_pp_hvt_lres"
    hd64 = "cutefa_sm90_fwd_e4m3_hd64_192x128_s2_w16_ov"
    ms = [
        Measurement("e4m3", 128, False, 1024, plain, 700.0, 0.05),
        Measurement("e4m3", 128, False, 1024, plain + "_vmean", 690.0, 0.05),
        Measurement("e4m3", 128, False, 1024, tl, 560.0, 0.05),
        Measurement("e4m3", 128, False, 1024, tl_persist, 570.0, 0.05),
        Measurement("e4m3", 128, False, 4096, plain, 850.0, 0.05),
        Measurement("e4m3", 128, False, 4096, plain + "_vmean", 845.0, 0.05),
        Measurement("e4m3", 128, False, 4096, tl, 780.0, 0.05),
        Measurement("e4m3", 128, False, 4096, tl_persist, 750.0, 0.05),
        Measurement("e4m3", 256, False, 4096, hd256, 1000.0, 0.05),
        Measurement("e4m3", 256, False, 4096, hd256 + "_vmean", 990.0, 0.05),
        Measurement("e4m3", 64, False, 4096, hd64, 600.0, 0.05),
    ]
    e4m3 = {"dtype": "e4m3", "causal": False}
    assert table_entries(ms) == [
        {**e4m3, "head_dim": 64, "max_seqlen_k": None, "variant": hd64},
        {**e4m3, "head_dim": 128, "max_seqlen_k": 1024, "variant": tl_persist},
        {**e4m3, "head_dim": 128, "max_seqlen_k": None, "variant": tl},
        {**e4m3, "head_dim": 128, "max_seqlen_k": None, "variant": plain + "_vmean", "v_centered": True},
        {**e4m3, "head_dim": 256, "max_seqlen_k": None, "variant": hd256},
        {**e4m3, "head_dim": 256, "max_seqlen_k": None, "variant": hd256 + "_vmean", "v_centered": True},
    ]
    bf16 = tune.tuning_candidates("sm90", "fwd", ("bf16",), (128,), "sm_90a")
    assert bf16 and not any(hasattr(s.options, "o_accum") or hasattr(s.options, "v_mean") for s in bf16)


def test_tuning_candidates_take_a_pool_with_the_measured_alternatives():
    """``cutefa tune`` times the measured alternatives too (the committed set holds only what
    dispatch can run, so a re-tune could otherwise never pick a new variant): a pool's variants of
    other families, directions, dtypes, head dims, block quantization or that do not fit the
    target are left out."""
    import importlib.util
    import sys

    from cutefa import cli, tune
    from cutefa.model.committed import default_variants

    module_spec = importlib.util.spec_from_file_location("alternatives_for_test", cli.ALTERNATIVES_SCRIPT)
    tool = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = tool
    module_spec.loader.exec_module(tool)
    pool = tool.all_variants(None)
    picked = tune.tuning_candidates("sm90", "fwd", ("bf16",), (128,), "sm_90a", pool)
    committed = set(tune.tuning_candidates("sm90", "fwd", ("bf16",), (128,), "sm_90a"))
    assert committed < set(picked), "the alternatives join the committed variants"
    assert set(default_variants("sm90", "fwd")) >= committed
    assert all((s.arch, s.direction, s.dtype, s.head_dim) == ("sm90", "fwd", "bf16", 128) for s in picked)
    fp8 = tune.tuning_candidates("sm90", "fwd", ("e4m3",), None, "sm_90a", pool)
    assert fp8 and all(s.options.quant is Quant.TENSOR for s in fp8)


def _table(entries, note, measurements=(), gpu="H100"):
    return {"arch": "sm90", "direction": "fwd", "gpu": gpu, "target": "sm_90a", "measured_on": note,
            "entries": list(entries), "measurements": list(measurements)}  # fmt: skip


def _entry(dtype, head_dim, causal, bound, variant):
    return {"dtype": dtype, "head_dim": head_dim, "causal": causal, "max_seqlen_k": bound, "variant": variant}


def test_merge_replaces_the_measured_problems_and_keeps_the_rest(tmp_path):
    """A table measured a few head dims at a time: each part's problems replace the old entries
    (every length of them, even those the new part has no entry for), the rest stay, lengths in
    order with the catch-all last; the measurements follow the entries; the note says which part is
    which; written where the tuner writes."""
    from cutefa.tune import merge_tables, table_path, write_table

    old = _table(
        [_entry("bf16", 128, False, 2048, "old-a"), _entry("bf16", 128, False, None, "old-b"),
         _entry("bf16", 64, True, None, "old-c")],
        "first run",
        [{"dtype": "bf16", "head_dim": 128, "causal": False, "seqlen": 1024}, {"dtype": "bf16", "head_dim": 64,
                                                                              "causal": True, "seqlen": 1024}],
    )  # fmt: skip
    new = _table(
        [_entry("bf16", 128, False, None, "new-b"), _entry("bf16", 128, False, 1024, "new-a")],
        "second run",
        [{"dtype": "bf16", "head_dim": 128, "causal": False, "seqlen": 4096}],
    )  # fmt: skip
    merged = merge_tables(old, new)
    assert [(e["head_dim"], e["max_seqlen_k"], e["variant"]) for e in merged["entries"]] == [
        (64, None, "old-c"), (128, 1024, "new-a"), (128, None, "new-b")
    ]
    assert [m["head_dim"] for m in merged["measurements"]] == [64, 128]
    assert merged["measured_on"] == "first run; bf16 hd128: second run"
    assert old["entries"][0]["variant"] == "old-a"  # the inputs are left as they were
    path = write_table(merged, tmp_path)
    assert path == table_path(new, tmp_path) and path.name == "sm90_h100.json"


def test_merge_refuses_another_gpu_family_or_direction():
    import pytest

    from cutefa.tune import merge_tables

    base = _table([], "x")
    for key, value in (("gpu", "H200"), ("arch", "sm80"), ("direction", "bwd"), ("target", "sm_100a")):
        with pytest.raises(ValueError, match=f"another {key}"):
            merge_tables(base, {**base, key: value})
