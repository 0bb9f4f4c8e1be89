"""The sm90 forward's longest-first tile order (the persistent scheduler and the 1-D grid,
cutefa/kernels/sm90/parts.py), checked on the CPU: the index arithmetic the kernel traces is plain
Python over ints here."""

from __future__ import annotations

import pytest

parts = pytest.importorskip("cutefa.kernels.sm90.parts")


@pytest.mark.parametrize(("num_m", "heads", "batch", "group"), [(8, 16, 4, 3), (1, 1, 1, 1), (5, 3, 2, 4), (16, 7, 1, 2)])
def test_every_tile_once_longest_first(num_m, heads, batch, group):
    pairs = heads * batch
    order = [parts.lpt_tile(t, num_m, heads, pairs, group) for t in range(num_m * pairs)]
    assert sorted(order) == sorted((m, h, b) for m in range(num_m) for h in range(heads) for b in range(batch))
    # Inside each section of `group` (head, batch) pairs the query blocks come last-first, so a
    # causal problem starts its longest tiles first; sections do not interleave.
    for start in range(0, pairs, group):
        width = min(group, pairs - start)
        section = order[start * num_m : (start + width) * num_m]
        assert {h + b * heads for _, h, b in section} == set(range(start, start + width))
        m_blocks = [m for m, _, _ in section]
        assert m_blocks == sorted(m_blocks, reverse=True)


def test_group_keeps_kv_in_l2():
    # hd128 bf16 at 16k keys: 8 MiB of K and V per (head, batch) pair -> 3 pairs in 24 MiB.
    assert parts.lpt_group(16384, 128, 2) == 3
    assert parts.lpt_group(1024, 64, 2) == parts.L2_KV_BUDGET // (1024 * 256)
    assert parts.lpt_group(10**7, 256, 2) == 1
    assert parts.lpt_group(0, 128, 2) >= 1


def test_causal_grid_is_one_section_of_every_pair():
    """The causal 1-D grid (lpt_grid) passes every (head, batch) pair as one section: the whole grid
    runs last query block first across all pairs, so no pair's longest tile waits for the tail; the
    non-causal one keeps the L2 sections (templates/fwd_sm90.py.j2)."""
    from cutefa import codegen
    from cutefa.spec import parse_name

    num_m, heads, batch = 6, 4, 3
    pairs = heads * batch
    order = [parts.lpt_tile(t, num_m, heads, pairs, pairs) for t in range(num_m * pairs)]
    m_blocks = [m for m, _, _ in order]
    assert m_blocks == sorted(m_blocks, reverse=True)
    assert order[:pairs] == [(num_m - 1, p % heads, p // heads) for p in range(pairs)]
    one_section = "parts.lpt_tile(bx, num_m, heads_q, heads_q * batch_size, heads_q * batch_size)"
    for name, causal in (
        ("cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_pcvt_lpt", True),
        ("cutefa_sm90_fwd_bf16_hd128_128x160_s2_w12_causal_ov_pp_pcvt_lpt", True),
        ("cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_ov_pcvt_lpt", False),
    ):
        source = codegen.render_source(parse_name(name))
        assert (one_section in source) == causal, name
        assert ("parts.lpt_group(seqlen_k" in source) != causal, name
