"""tools/bench_decode.py on the CPU: the grid's cells and their sizes, the ``--variants`` items read
as the API reads its environment, and ``--precompile`` compiling exactly the decode variant each
cell's call runs (the copy layout is chosen per call from the cache's size)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from cpu_support import load_tool

from cutefa.api import kvcache
from cutefa.model import policy_decode

bench_decode = load_tool("bench_decode")
ROWS = policy_decode.DecodeSchedule.ROWS
LINES, SECTORS = policy_decode.DecodeCopy.LINES, policy_decode.DecodeCopy.SECTORS


def _args(**over):
    fields = {"grid": "quick", "batches": None, "caches": None, "heads": None, "tokens": None, "layouts": None}
    return argparse.Namespace(**{**fields, **over})


def test_the_quick_grid_and_its_sizes():
    cells = bench_decode.cells_of(_args())
    assert [c.name for c in cells] == [
        "b1 L8192 h32/8 q1 dense", "b64 L8192 h32/8 q1 dense", "b1 L8192 h32/8 q1 16", "b64 L8192 h32/8 q1 16"
    ]  # fmt: skip
    assert cells[1].kv_bytes == 64 * 8192 * 8 * 128 * 2 * 2  # K and V, bf16
    assert cells[2].page == 16 and cells[0].page is None
    over = bench_decode.cells_of(_args(batches="8", caches="1024,32768", layouts="64", tokens="4"))
    assert [c.name for c in over] == ["b8 L1024 h32/8 q4 64", "b8 L32768 h32/8 q4 64"]


PAGE_ROWS, CHUNKS = policy_decode.DecodePages.ROWS, policy_decode.DecodePages.CHUNKS


@pytest.mark.parametrize(
    ("item", "expected"),
    [("rows", (ROWS, None, CHUNKS)), ("rows/lines", (ROWS, LINES, CHUNKS)),
     ("rows/sectors", (ROWS, SECTORS, CHUNKS)), ("keys", (policy_decode.DecodeSchedule.KEYS, None, CHUNKS)),
     ("rows/lines/chunks", (ROWS, LINES, CHUNKS)), ("rows/lines/rows", (ROWS, LINES, PAGE_ROWS)),
     ("rows//rows", (ROWS, None, PAGE_ROWS))],
)  # fmt: skip
def test_variant_items_are_read_as_the_api_reads_them(monkeypatch, item, expected):
    monkeypatch.setenv(kvcache.COPY_ENV, "lines")  # the caller's own setting comes back afterwards
    assert bench_decode.variant_choice(item) == expected
    assert os.environ[kvcache.COPY_ENV] == "lines"
    with pytest.raises(ValueError, match="decode copy layout"):
        bench_decode.variant_choice("rows/words")
    with pytest.raises(ValueError, match="at most schedule/copy/pages"):
        bench_decode.variant_choice("rows/lines/chunks/more")


def test_precompile_builds_what_each_cell_runs(monkeypatch):
    """Per cell, the precompiled variant is the one the call picks from the same shapes: a small
    paged cache (batch 1 x 1k, 4 MiB) the sector copies, the others the line copies; a forced copy
    layout (``rows/sectors``) for every cell."""
    import cutefa.compile
    from cutefa import dispatch

    built = []
    monkeypatch.setattr(dispatch, "current_target", lambda device=None: "sm_90a")
    monkeypatch.setattr(cutefa.compile, "compile_variants", lambda specs, **kw: built.append(list(specs)) or [])
    monkeypatch.delenv(kvcache.COPY_ENV, raising=False)
    cells = bench_decode.cells_of(_args(batches="1,64", caches="1024", layouts="dense,16"))
    bench_decode.precompile(cells, 1, ["rows"])
    lines = {s.options.line_copy for s in built[-1]}
    assert lines == {True, False} and len(built[-1]) == 3  # dense (any size), paged b64, paged b1
    for cell in cells:
        q = torch.zeros(cell.batch, cell.tokens, cell.hq, 128, dtype=torch.bfloat16)
        if cell.page is None:
            cache, table = torch.zeros(cell.batch, cell.cache, cell.hkv, 128, dtype=torch.bfloat16), None
        else:
            pages = cell.cache // cell.page
            cache = torch.zeros(1, cell.page, cell.hkv, 128, dtype=torch.bfloat16)
            table = torch.zeros(cell.batch, pages, dtype=torch.int32)
        assert kvcache.decode_spec(q, cache, table, False, False, 0.0) in built[-1], cell.name
    small_paged = kvcache.decode_spec(
        torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16), torch.zeros(1, 16, 8, 128, dtype=torch.bfloat16),
        torch.zeros(1, 64, dtype=torch.int32), False, False, 0.0,
    )  # fmt: skip
    assert not small_paged.options.line_copy
    bench_decode.precompile(cells, 1, ["rows/sectors"])
    assert {s.options.line_copy for s in built[-1]} == {False}
    # page reads per chunk: the paged cells' line-copy variants (pages of 16), the dense one as it was
    bench_decode.precompile(cells, 1, ["rows/lines/chunks"])
    assert sorted((s.features.paged_kv, s.options.page_chunks) for s in built[-1]) == [(False, False), (True, True)]


def test_forced_split_counts_are_columns_of_their_own(monkeypatch):
    """``--splits 1,3``: a cutefa column each with num_splits forced, after the variants' columns and
    before the peers; a count under 1 is refused."""
    sides = bench_decode.columns(["rows", "rows/sectors"], [1, 3])
    names = list(sides)
    assert names[:4] == ["cutefa", "cutefa[rows/sectors]", "cutefa[splits=1]", "cutefa[splits=3]"]
    assert names[4:] == list(bench_decode.PEERS) and all(bench_decode.ours(n) for n in names[:4])
    calls = []
    monkeypatch.setattr(bench_decode.kvcache, "flash_attn_with_kvcache", lambda *a, **kw: calls.append(kw))
    cell = argparse.Namespace(q=None, k=None, v=None, seqlens=None, table=None, tokens=1)
    sides["cutefa[splits=3]"](cell)()
    sides["cutefa"](cell)()
    assert [kw["num_splits"] for kw in calls] == [3, 0]
    with pytest.raises(ValueError, match="at least 1"):
        bench_decode.columns(["rows"], [0])
    # no --variants: the plain cutefa side, which leaves the caller's decode environment alone
    assert bench_decode.columns([], [2])["cutefa"] is bench_decode.cutefa_backend
