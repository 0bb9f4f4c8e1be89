"""Block masks: which key blocks each query block needs, computed once from a ``mask_mod``.

FlexAttention's BlockMask idea. For a (batch, head, query block, key block) the mask_mod's values
make the block *empty* (no pair attends: never loaded nor computed), *full* (every pair attends: no
per-element mask) or *partial*. :func:`create_block_mask` evaluates the mask_mod with torch (on the
GPU, or the CPU) one stripe of query blocks at a time, so a long sequence never holds a dense
(seqlen_q, seqlen_k) mask per head.

The sm80 and sm90 forwards visit, per query block, one contiguous run of key blocks ``[n_first, n_last)``
(from the first to the last non-empty block) of which ``[u_first, u_last)`` (the longest run of
full blocks) runs without any per-element mask; the other blocks of the run get the mask_mod per
element (:meth:`BlockMask.ranges`). The sm80 backward visits, per key block, the query blocks
from the first to the last non-empty one, of which the longest run of full ones runs without the
mask_mod (:meth:`BlockMask.query_ranges`). Document masks, prefix-LM, causal and sliding windows have such
runs; a mask with holes between its blocks is still exact, with less skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_BLOCK = 128
_STRIPE_ELEMENTS = 1 << 26  # mask elements evaluated at once (a stripe of query blocks)


def _blocks(n: int, size: int) -> int:
    return (n + size - 1) // size


def block_kinds(
    mask_fn: Callable[..., Any], batch: int, heads: int, q_len: int, kv_len: int, block_q: int, block_kv: int,
    device: torch.device | str, *, ragged_partial: bool = False,
) -> torch.Tensor:  # fmt: skip
    """int8 (batch, heads, query blocks, key blocks): EMPTY, PARTIAL or FULL from ``mask_fn(b, h,
    q_idx, kv_idx)`` evaluated on broadcast int64 index tensors. Pairs past ``q_len``/``kv_len``
    count as not attending; with ``ragged_partial`` a block reaching past ``kv_len`` is never FULL
    (a kernel masks the key-length residue in its masked blocks only)."""
    device = torch.device(device)
    m_blocks, n_blocks = _blocks(q_len, block_q), _blocks(kv_len, block_kv)
    kinds = torch.empty((batch, heads, m_blocks, n_blocks), dtype=torch.int8, device=device)
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    kv_pad = n_blocks * block_kv
    kv = torch.arange(kv_pad, device=device).view(1, 1, 1, kv_pad)
    kv_ok = kv < kv_len
    kv_safe = torch.clamp(kv, max=max(kv_len - 1, 0))
    stripe = max(1, _STRIPE_ELEMENTS // max(1, batch * heads * block_q * kv_pad))
    for m0 in range(0, m_blocks, stripe):
        m1 = min(m_blocks, m0 + stripe)
        q = torch.arange(m0 * block_q, m1 * block_q, device=device).view(1, 1, -1, 1)
        q_ok = q < q_len
        q_safe = torch.clamp(q, max=max(q_len - 1, 0))
        mask = torch.as_tensor(mask_fn(b, h, q_safe, kv_safe), device=device).to(torch.bool)
        valid = q_ok & kv_ok
        mask = (mask & valid).expand(batch, heads, q.shape[2], kv_pad)
        tiles = mask.reshape(batch, heads, m1 - m0, block_q, n_blocks, block_kv)
        count = tiles.sum(dim=(3, 5), dtype=torch.int64)
        possible = valid.expand(1, 1, q.shape[2], kv_pad).reshape(1, 1, m1 - m0, block_q, n_blocks, block_kv)
        cells = possible.sum(dim=(3, 5), dtype=torch.int64)
        full = (count == cells) & (count > 0)
        if ragged_partial and kv_len % block_kv:
            full[..., -1] = False
        kinds[:, :, m0:m1] = torch.where(count == 0, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)
    return kinds


def kinds_to_ranges(kinds: torch.Tensor) -> torch.Tensor:
    """int32 (..., 4) ``[n_first, n_last, u_first, u_last]`` of block kinds (..., key blocks): the run
    from the first to the last non-empty block, and inside it the longest run of FULL blocks
    (``u_first == u_last == n_last`` when there is none; ``0, 0, 0, 0`` for no block at all)."""
    n = kinds.shape[-1]
    idx = torch.arange(n, device=kinds.device)
    nonempty = kinds != EMPTY
    any_block = nonempty.any(dim=-1)
    first = torch.where(nonempty, idx, n).amin(dim=-1)
    last = torch.where(nonempty, idx, -1).amax(dim=-1) + 1
    first = torch.where(any_block, first, 0)
    last = torch.where(any_block, last, 0)
    run = torch.zeros_like(first)
    best = torch.zeros_like(first)
    best_end = torch.zeros_like(first)
    for j in range(n):
        run = torch.where(kinds[..., j] == FULL, run + 1, 0)
        better = run > best
        best = torch.where(better, run, best)
        best_end = torch.where(better, j + 1, best_end)
    u_last = torch.where(best > 0, best_end, last)
    u_first = torch.where(best > 0, best_end - best, last)
    return torch.stack([first, last, u_first, u_last], dim=-1).to(torch.int32)


def causal_and(mask_fn: Callable[..., Any], q_len: int, kv_len: int) -> Callable[..., Any]:
    """``mask_fn`` and the bottom-right causal mask (key j <= i + kv_len - q_len)."""

    def both(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.as_tensor(mask_fn(b, h, q_idx, kv_idx)) & (kv_idx <= q_idx + kv_len - q_len)

    return both


@dataclass(eq=False)
class BlockMask:
    """A mask_mod's blocks for (B, H, Q_LEN, KV_LEN) (B or H of 1: the same for every batch or head).

    ``kinds``: int8 (B, H, query blocks, key blocks) of EMPTY/PARTIAL/FULL at ``BLOCK_SIZE`` (query
    rows, keys). A kernel whose tile differs gets its own blocks from the same mask_mod, computed
    once per tile (:meth:`ranges`)."""

    mask_mod: Callable[..., Any]
    B: int
    H: int
    Q_LEN: int
    KV_LEN: int
    BLOCK_SIZE: tuple[int, int]
    kinds: torch.Tensor
    _ranges: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def kv_num_blocks(self) -> torch.Tensor:
        """int32 (B, H, query blocks): the key blocks each query block needs (partial or full)."""
        return (self.kinds != EMPTY).sum(dim=-1, dtype=torch.int32)

    @property
    def full_kv_num_blocks(self) -> torch.Tensor:
        """int32 (B, H, query blocks): the key blocks that need no per-element mask."""
        return (self.kinds == FULL).sum(dim=-1, dtype=torch.int32)

    def sparsity(self) -> float:
        """The fraction of blocks that are empty."""
        return float((self.kinds == EMPTY).float().mean())

    def _tile_kinds(self, tile_m: int, tile_n: int, causal: bool) -> torch.Tensor:
        key = ("kinds", tile_m, tile_n, causal)
        if key not in self._ranges:
            fn = causal_and(self.mask_mod, self.Q_LEN, self.KV_LEN) if causal else self.mask_mod
            self._ranges[key] = block_kinds(
                fn,
                self.B,
                self.H,
                self.Q_LEN,
                self.KV_LEN,
                tile_m,
                tile_n,
                self.kinds.device,
                ragged_partial=True,
            )
        return self._ranges[key]

    def ranges(self, tile_m: int, tile_n: int, causal: bool, batch: int, heads: int) -> torch.Tensor:
        """int32 (batch, heads, ceil(Q_LEN / tile_m), 4): the key-block runs (module docs) of a
        kernel with tiles ``tile_m`` x ``tile_n`` (``causal``: with the bottom-right causal mask),
        for a call of ``batch`` x ``heads``; computed once per tile and call shape."""
        key = ("keys", tile_m, tile_n, causal, batch, heads)
        if key not in self._ranges:
            ranges = kinds_to_ranges(self._tile_kinds(tile_m, tile_n, causal))
            self._ranges[key] = ranges.expand(batch, heads, *ranges.shape[2:]).contiguous()
        return self._ranges[key]

    def query_ranges(self, tile_m: int, tile_n: int, causal: bool, batch: int, heads: int) -> torch.Tensor:
        """int32 (batch, heads, ceil(KV_LEN / tile_n), 4): the same runs over the query blocks of
        each key block (a backward's loop over query blocks per key block: the run it visits, and
        the full ones it computes without the mask_mod)."""
        key = ("queries", tile_m, tile_n, causal, batch, heads)
        if key not in self._ranges:
            ranges = kinds_to_ranges(self._tile_kinds(tile_m, tile_n, causal).transpose(-1, -2))
            self._ranges[key] = ranges.expand(batch, heads, *ranges.shape[2:]).contiguous()
        return self._ranges[key]

    def to_dense(self) -> torch.Tensor:
        """The mask_mod as a bool (B, H, Q_LEN, KV_LEN) tensor (for tests and small problems)."""
        dev = self.kinds.device
        b = torch.arange(self.B, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(self.H, device=dev).view(1, -1, 1, 1)
        q = torch.arange(self.Q_LEN, device=dev).view(1, 1, -1, 1)
        kv = torch.arange(self.KV_LEN, device=dev).view(1, 1, 1, -1)
        mask = torch.as_tensor(self.mask_mod(b, h, q, kv), device=dev).to(torch.bool)
        return mask.expand(self.B, self.H, self.Q_LEN, self.KV_LEN)


def create_block_mask(
    mask_mod: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
    device: torch.device | str = "cuda", BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK,
) -> BlockMask:  # fmt: skip
    """The :class:`BlockMask` of ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's
    signature; ``B`` or ``H`` None: the same for every batch or head). ``mask_mod`` is evaluated
    with torch on ``device``, on int64 index tensors that broadcast."""
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: mask_mod must be a function, got {type(mask_mod).__name__}")
    block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(block) != 2 or not all(isinstance(x, int) and x > 0 for x in block):
        raise ValueError(f"create_block_mask: BLOCK_SIZE={BLOCK_SIZE!r} must be a positive int or two")
    dims = {"B": 1 if B is None else B, "H": 1 if H is None else H, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN}
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"create_block_mask: {name}={value!r} must be a positive int")
    kinds = block_kinds(mask_mod, dims["B"], dims["H"], Q_LEN, KV_LEN, block[0], block[1], device)
    return BlockMask(mask_mod, dims["B"], dims["H"], Q_LEN, KV_LEN, block, kinds)
