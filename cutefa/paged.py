"""A small page allocator for a paged KV cache: :class:`PagedKVCache`.

The cache is a pool of fixed-size pages, ``k_cache``/``v_cache`` (num_layers, num_pages,
page_size, heads_kv, head_dim); a sequence owns a list of pages, allocated as it grows and given
back when it ends, so that no memory is reserved for the longest possible sequence (vLLM's
PagedAttention). The bookkeeping is on the host; :meth:`PagedKVCache.step` hands the kernels the
device tensors they take: the batch's ``page_table`` int32 (batch, max_pages) and
``cache_seqlens`` int32 (batch,). It is a helper for tests and examples, not a scheduler::

    cache = PagedKVCache(num_pages=1024, page_size=16, heads_kv=8, head_dim=128, max_seqs=64)
    seqs = [cache.add() for _ in prompts]
    table, lens = cache.step(seqs, new_tokens=prompt_len)      # room for the prompt
    for layer in range(num_layers):
        k_cache, v_cache = cache.layer(layer)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, page_table=table,
                                      causal=True)
    ...
    cache.free(seqs[0])                                         # its pages go back to the pool

Tables handed out earlier stay valid until a sequence is freed (its pages may then be given to
another sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than a step needs."""


class PagedKVCache:
    """A pool of ``num_pages`` pages of ``page_size`` tokens (a power of two) for ``num_layers``
    layers, and up to ``max_seqs`` sequences of at most ``max_pages_per_seq`` pages each (default:
    all of them)."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        heads_kv: int,
        head_dim: int,
        max_seqs: int,
        max_pages_per_seq: int | None = None,
        num_layers: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages), ("page_size", page_size), ("heads_kv", heads_kv), ("head_dim", head_dim),
            ("max_seqs", max_seqs), ("num_layers", num_layers),
        ):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        if page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two; got {page_size}")
        max_pages_per_seq = num_pages if max_pages_per_seq is None else max_pages_per_seq
        if (
            isinstance(max_pages_per_seq, bool)
            or not isinstance(max_pages_per_seq, int)
            or max_pages_per_seq < 1
        ):
            raise ValueError(f"max_pages_per_seq must be a positive int; got {max_pages_per_seq!r}")
        device = torch.device("cuda" if device is None else device)
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.device = device
        shape = (num_layers, num_pages, page_size, heads_kv, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._free_pages = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    # -- the pool ---------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[1]

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def capacity(self) -> int:
        """The most tokens one sequence can hold: max_pages_per_seq * page_size."""
        return self.max_pages_per_seq * self.page_size

    def layer(self, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer: (num_pages, page_size, heads_kv, head_dim) views."""
        return self.k_cache[index], self.v_cache[index]

    # -- sequences --------------------------------------------------------------------------------

    def add(self) -> int:
        """A new, empty sequence; returns its id."""
        if not self._free_slots:
            raise OutOfPagesError(f"all {len(self._pages)} sequence slots are in use (max_seqs)")
        seq = self._free_slots.pop()
        self._pages[seq], self._lengths[seq] = [], 0
        return seq

    def free(self, seq: int) -> None:
        """End sequence ``seq``: its pages and its id go back to the pool."""
        pages = self._pages.pop(self._known(seq))
        del self._lengths[seq]
        self._free_pages.extend(reversed(pages))
        self._free_slots.append(seq)

    def length(self, seq: int) -> int:
        """The tokens sequence ``seq`` holds."""
        return self._lengths[self._known(seq)]

    def pages(self, seq: int) -> list[int]:
        """The pages of sequence ``seq``, in token order."""
        return list(self._pages[self._known(seq)])

    def reserve(self, seq: int, tokens: int) -> None:
        """Make sure sequence ``seq`` has pages for ``tokens`` tokens in all; raises
        :class:`OutOfPagesError` (allocating nothing) when the pool or the sequence's table is short."""
        pages = self._pages[self._known(seq)]
        needed = -(-tokens // self.page_size) - len(pages)
        if tokens > self.capacity:
            raise OutOfPagesError(f"sequence {seq} would hold {tokens} tokens, over capacity {self.capacity}")
        if needed > len(self._free_pages):
            raise OutOfPagesError(
                f"sequence {seq} needs {needed} more pages; {len(self._free_pages)} are free"
            )
        for _ in range(max(needed, 0)):
            pages.append(self._free_pages.pop())

    def step(self, seqs: Sequence[int], new_tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for ``new_tokens`` more tokens in each of ``seqs`` (pages allocated as needed), and
        their lengths advanced. Returns (page_table int32 (len(seqs), max_pages_per_seq),
        cache_seqlens int32 (len(seqs),): the lengths before this step, where the new tokens go), on
        the cache's device: what flash_attn_with_kvcache takes with ``k``/``v`` of ``new_tokens``."""
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 0:
            raise ValueError(f"new_tokens must be an int >= 0; got {new_tokens!r}")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs must name each sequence once; got {list(seqs)}")
        before = [self.length(s) for s in seqs]
        for s, n in zip(seqs, before):
            if n + new_tokens > self.capacity:
                raise OutOfPagesError(
                    f"sequence {s} would hold {n + new_tokens} tokens, over capacity {self.capacity}"
                )
        needed = sum(
            max(-(-(n + new_tokens) // self.page_size) - len(self._pages[s]), 0) for s, n in zip(seqs, before)
        )
        if needed > len(self._free_pages):
            raise OutOfPagesError(f"the step needs {needed} more pages; {len(self._free_pages)} are free")
        for s, n in zip(seqs, before):
            self.reserve(s, n + new_tokens)
            self._lengths[s] = n + new_tokens
        return self.page_table(seqs), self._to_device(before)

    def page_table(self, seqs: Sequence[int]) -> torch.Tensor:
        """int32 (len(seqs), max_pages_per_seq) on the cache's device: each row the sequence's pages,
        then zeros (entries past a sequence's length are never read)."""
        rows = [
            self._pages[self._known(s)] + [0] * (self.max_pages_per_seq - len(self._pages[s])) for s in seqs
        ]
        return (
            torch.tensor(rows, dtype=torch.int32).reshape(len(seqs), self.max_pages_per_seq).to(self.device)
        )

    def cache_seqlens(self, seqs: Sequence[int]) -> torch.Tensor:
        """int32 (len(seqs),) on the cache's device: the tokens each sequence holds now."""
        return self._to_device([self.length(s) for s in seqs])

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        page_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        *,
        layer: int = 0,
    ) -> None:
        """Write ``k``, ``v`` (batch, n, heads_kv, head_dim) into ``layer``'s pages at
        ``cache_seqlens`` through ``page_table`` (what :meth:`step` returned): the in-place append of
        flash_attn_with_kvcache without the attention (a prefill run by another kernel)."""
        from cutefa.api.kvcache_reference import append_kv

        k_cache, v_cache = self.layer(layer)
        if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
            raise TypeError(f"k and v must be {k_cache.dtype} like the cache; got {k.dtype} and {v.dtype}")
        append_kv(k_cache, v_cache, k, v, cache_seqlens, None, page_table, None, None, True)

    def gather(self, seq: int, *, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of sequence ``seq`` in ``layer`` as dense (length, heads_kv,
        head_dim) tensors (a reference for tests)."""
        n = self.length(seq)
        index = torch.tensor(self._pages[seq], dtype=torch.long, device=self.device)
        k_cache, v_cache = self.layer(layer)
        return tuple(c[index].flatten(0, 1)[:n] for c in (k_cache, v_cache))  # type: ignore[return-value]

    def check(self, page_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
        """Validate a page table and lengths against this pool (reads them back: a host sync; for
        tests and debugging): int32, every length within the table's pages, every page a sequence
        uses in range and used by one sequence only. Raises ValueError naming the first problem."""
        if page_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32:
            raise ValueError(
                f"page_table and cache_seqlens must be int32; got {page_table.dtype}, {cache_seqlens.dtype}"
            )
        table, lengths = page_table.cpu().tolist(), cache_seqlens.cpu().tolist()
        seen: dict[int, int] = {}
        for b, (row, n) in enumerate(zip(table, lengths)):
            if not 0 <= n <= len(row) * self.page_size:
                raise ValueError(f"sequence {b}: length {n} is outside [0, {len(row) * self.page_size}]")
            for page in row[: -(-n // self.page_size)]:
                if not 0 <= page < self.num_pages:
                    raise ValueError(f"sequence {b}: page {page} is outside [0, {self.num_pages})")
                if seen.setdefault(page, b) != b:
                    raise ValueError(f"page {page} is used by sequences {seen[page]} and {b}")

    def _known(self, seq: int) -> int:
        if seq not in self._pages:
            raise KeyError(f"no sequence {seq!r} in this cache (add() returns the ids)")
        return seq

    def _to_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(self.device)
