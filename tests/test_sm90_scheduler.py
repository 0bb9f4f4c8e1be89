"""The sm90 forward's longest-first tile order (the persistent scheduler and the 1-D grid,
cutefa/kernels/sm90/parts.py), checked on the CPU: the index arithmetic the kernel traces is plain
Python over ints here."""

from __future__ import annotations

import pytest

from cutefa.kernels.sm90 import parts  # the CuTe DSL is a dependency: a broken import fails


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
    # hd128 bf16 at 16k keys: 8 MiB of K and V per (head, batch) pair -> 3 pairs in 24 MiB -> 2,
    # the largest power of two (equal sections of the usual batch x heads pair counts)
    assert parts.lpt_group(16384, 128, 2) == 2
    assert parts.lpt_group(1024, 64, 2) == 64  # 96 fit
    assert parts.lpt_group(2048, 256, 2) == 8  # 12 fit
    assert parts.lpt_group(10**7, 256, 2) == 1
    assert parts.lpt_group(0, 128, 2) >= 1
    for seqlen_k in range(1, 70000, 997):
        for head_dim in (64, 96, 128, 192, 256):
            group = parts.lpt_group(seqlen_k, head_dim, 2)
            fit = max(parts.L2_KV_BUDGET // (seqlen_k * 4 * head_dim), 1)
            assert group & (group - 1) == 0 and group <= fit < 2 * group, (seqlen_k, head_dim)

