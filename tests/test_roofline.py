"""The CTA-pair terms of the sm100 paper model (tools/roofline.py): what a pair changes per SM."""

from __future__ import annotations

from cpu_support import load_tool

from cutefa.model.spec import VariantSpec

SINGLE = VariantSpec("sm100", "fwd", "bf16", 128, 256, 128, 3, 16)
PAIR = SINGLE.replace(cta_pair=True)


def test_pair_halves_kv_traffic_per_sm():
    roof = load_tool("roofline")
    q_bytes = 128 * 128 * 2
    kv_bytes = 2 * 128 * 128 * 2  # K and V of one 128-key block
    # Reads Q and K/V, plus the TMA fill of K/V shared by the CTA's two Q tiles.
    assert roof.smem_clk(SINGLE) == (q_bytes + kv_bytes + kv_bytes / 2) / 128
    assert roof.smem_clk(PAIR) == (q_bytes + kv_bytes / 2 + kv_bytes / 4) / 128
    assert roof.l2_kv_bytes(PAIR, 8192, 128) * 2 == roof.l2_kv_bytes(SINGLE, 8192, 128)


def test_pair_keeps_the_mma_rate_and_never_predicts_slower():
    roof = load_tool("roofline")
    rows = roof.pair_rows(8192, 128)
    assert {p.head_dim for p, _, _ in rows} == set(load_tool("alternatives").PAIR_ALTERNATIVES)
    for pair, single, n in rows:
        assert pair.options.cta_pair and not single.options.cta_pair and single.replace(cta_pair=True) == pair
        assert roof.predict(pair, 8192, 128).clk_mma == roof.predict(single, 8192, 128).clk_mma
        assert n["smem_pair"] < n["smem_single"]
        assert n["tflops_pair"] >= n["tflops_single"]
        assert n["causal_waste"] == pair.tile_m / 8192
    assert roof.pair_causal_waste(SINGLE, 8192) == 0.0
