"""The split-KV combine's layout (cutefa/kernels/sm80/decode_combine.py): a row's warps cover its
columns exactly once at every decode head dim and the 512-wide MLA latent rows, and a CTA holds
whole rows. The kernel itself is compiled in tests/test_compile_decode.py and run on a GPU in
tests/gpu/test_kvcache.py."""

from __future__ import annotations

import pytest

from cutefa.kernels.sm80 import decode_combine as combine
from cutefa.model import policy_decode, policy_mla
from cutefa.model.spec import HEAD_DIMS

WIDTHS = [*HEAD_DIMS, policy_mla.HEAD_DIM_V]


@pytest.mark.parametrize("head_dim", WIDTHS)
def test_the_row_warps_cover_every_column_once(head_dim):
    warps, vec = combine.warps_per_row(head_dim), combine.columns_per_lane(head_dim)
    # thread t of the row (warp t // 32, lane t % 32) stores columns [t * vec, (t + 1) * vec)
    covered = [c for t in range(warps * combine.WARP) for c in range(t * vec, (t + 1) * vec)]
    assert covered == list(range(head_dim))
    assert 1 <= warps <= 8 and vec * 4 <= 16  # a lane's chunk is at most one 16-byte float32 vector


@pytest.mark.parametrize("head_dim", WIDTHS)
def test_a_cta_holds_whole_rows(head_dim):
    threads = combine.threads_per_cta(head_dim, policy_decode.COMBINE_WARPS)
    rows = combine.rows_per_cta(head_dim, policy_decode.COMBINE_WARPS)
    assert threads == rows * combine.warps_per_row(head_dim) * combine.WARP
    assert threads <= 1024 and rows >= 1


@pytest.mark.parametrize("head_dim", [80, 112, 48])
def test_rows_the_warps_cannot_split_evenly_are_refused(head_dim):
    with pytest.raises(ValueError, match="multiple of 32 columns"):
        combine.columns_per_lane(head_dim)
