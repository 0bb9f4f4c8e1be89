"""The tuner's table building (CPU: no timing, just the winner and bucket logic)."""

from cutefa.tune import Measurement, gpu_token, table_entries


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
