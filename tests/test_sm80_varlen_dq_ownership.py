"""The deterministic sm80 backward with packed sequences: a host-side model of which dQ accumulator
elements each CTA of the main grid adds into, built on the chunk arithmetic the kernel itself
traces (cutefa.kernels.sm80.varlen.first_chunk). Bitwise-repeatable gradients need every element
added by one CTA only (in it, by one thread in a fixed order): CTA x of a deterministic launch owns
split x, so what is left to hold is that no two sequences of a packed batch share an element of a
split, that the key blocks of each sequence are spread over the CTAs once each, and that the
postprocess reads the chunks the main kernel wrote, inside the workspace the API allocates.
"""

from __future__ import annotations

import math
import random
from collections import Counter

from cutefa.api.backward import dq_splits
from cutefa.api.feature_bwd import _varlen_dq_accum_shape
from cutefa.codegen import render_source
from cutefa.kernels.sm80.varlen import first_chunk
from cutefa.model.options import DqLayout, Mask
from cutefa.model.spec import Features, VariantSpec

BWD = VariantSpec(
    "sm80", "bwd", "bf16", 128, 64, 128, 1, 8, dq_layout=DqLayout.TILE, features=Features(varlen=True)
)


def _batch(rng: random.Random) -> tuple[list[int], list[int], list[int], list[int]]:
    """A ragged packed batch: spans (some empty, some a whole number of tiles) and the used rows
    (seqused <= span) of queries and keys."""
    n = rng.randint(1, 9)
    spans_q = [rng.choice([0, 1, 17, 63, 64, 65, 128, 129, 300, 1000]) for _ in range(n)]
    spans_k = [rng.choice([0, 1, 17, 64, 128, 250, 300, 1000]) for _ in range(n)]
    used_q = [rng.randint(0, s) if rng.random() < 0.3 else s for s in spans_q]
    used_k = [rng.randint(0, s) if rng.random() < 0.3 else s for s in spans_k]
    return spans_q, spans_k, used_q, used_k


def _starts(spans: list[int]) -> list[int]:
    return [sum(spans[:b]) for b in range(len(spans))]


def _key_blocks(bx: int, grid_x: int, n_blocks: int) -> list[int]:
    """The key blocks CTA ``bx`` walks (the template's loop: bx, bx + grid_x, ... below the
    sequence's own block count)."""
    return [bx + it * grid_x for it in range(math.ceil(max(n_blocks - bx, 0) / grid_x))]


def test_tiled_chunks_of_sequences_are_disjoint_and_fit_the_workspace():
    rng = random.Random(0)
    for _ in range(500):
        spans_q, _, used_q, _ = _batch(rng)
        tile_m = rng.choice([64, 128])
        spec = BWD.replace(tile_m=tile_m)
        total_q, n = sum(spans_q), len(spans_q)
        chunks = _varlen_dq_accum_shape(spec, 1, total_q, 1, n)[2]
        owner = {}
        for b, (start, used) in enumerate(zip(_starts(spans_q), used_q)):
            first = first_chunk(start, b, tile_m)
            for m in range(math.ceil(used / tile_m)):
                assert first + m not in owner, (spans_q, used_q, tile_m, b, owner[first + m])
                assert 0 <= first + m < chunks, (spans_q, used_q, tile_m, b, m, chunks)
                owner[first + m] = b


def test_deterministic_grid_adds_each_element_from_one_cta():
    """Every CTA (x, head, sequence) of a deterministic launch with the API's split count: the
    accumulator elements it adds into (split x; the tiled layout's chunks of the sequence's query
    blocks, whole; the row layouts' used rows of the sequence) are no other CTA's, and the
    sequence's key blocks are walked once each."""
    rng = random.Random(1)
    tile_n = 128
    for _ in range(300):
        spans_q, _, used_q, used_k = _batch(rng)
        heads_q = rng.choice([1, 2, 6])
        tile_m = rng.choice([64, 128])
        max_k = max(used_k)
        splits = dq_splits(True, len(spans_q), heads_q, max_k, tile_n, rng.choice([1, 8, 132]))
        assert splits >= 1
        grid_x = splits  # the template's grid x in deterministic mode
        tiled, rows = Counter(), Counter()
        for b, (start_q, uq, uk) in enumerate(zip(_starts(spans_q), used_q, used_k)):
            n_blocks = math.ceil(uk / tile_n)
            walked = Counter()
            for head in range(heads_q):
                for bx in range(grid_x):
                    blocks = _key_blocks(bx, grid_x, n_blocks)
                    walked.update((head, n) for n in blocks)
                    if not blocks:
                        continue
                    split = bx  # bx * deterministic
                    first = first_chunk(start_q, b, tile_m)
                    tiled.update((split, head, first + m) for m in range(math.ceil(uq / tile_m)))
                    rows.update((split, start_q + r, head) for r in range(uq))
            assert walked == Counter((h, n) for h in range(heads_q) for n in range(n_blocks))
        assert all(c == 1 for c in tiled.values()), (spans_q, used_q, splits)
        assert all(c == 1 for c in rows.values()), (spans_q, used_q, splits)


def test_the_kernel_indexes_the_modelled_chunks():
    """The tiled varlen backward's main kernel and postprocess both take the sequence's chunks
    from varlen.first_chunk, and a CTA's split is bx * deterministic in either dQ layout."""
    for spec in (BWD, BWD.replace(mask=Mask.LOCAL, features=Features(varlen=True, softcap=True, alibi=True))):
        source = render_source(spec)
        assert source.count("varlen.first_chunk(offset_q, batch, TILE_M)") == 2, spec.name
        assert "mdQaccum[bx * deterministic, head, None, None]" in source, spec.name
        assert "grid_x = n_blocks + deterministic * (splits - n_blocks)" in source, spec.name
    for layout in (DqLayout.ROWS, DqLayout.QUAD):
        source = render_source(BWD.replace(dq_layout=layout))
        assert "mdQaccum[bx * deterministic, None, head, None]" in source, layout
        assert "first_chunk" not in source, layout
