"""The packed rows of no sequence in a varlen forward's outputs on a CUDA GPU: out exactly 0 and lse
-inf there, written by the fill kernel every varlen forward module launches before its attention
kernel (cutefa/kernels/common/varlen_fill.py); every other row the float32 reference's; nothing NaN.
The API allocates its outputs with ``torch.empty`` and clears nothing; the calls run with torch's
uninitialized allocations NaN-filled (:func:`nan_allocations`), so a row nothing writes reads NaN.

Layouts: (a) rows past ``cu_seqlens_q[-1]`` (a tail, no seqused), (b) seqused_q shorter than the
spans, (c) empty sequences (a span all slack, no query row, no key), (d) batch 1 and no gap, (e) a
tail long enough for many fill CTAs, (f) more sequences than ``varlen_fill.SEQUENCE_CTAS`` (one fill
CTA each). Through the public call (the dispatched family), the sm80-family kernel called directly
(on any GPU from sm_80 on), the e4m3 call (Hopper), and a CUDA graph replayed on other lengths: the
gaps move between replays and the static outputs are NaN-filled before each one.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason, sm90_kernel_skip_reason

from cutefa.api import fp8 as fp8_api
from cutefa.dispatch import current_target
from cutefa.kernels.common import varlen_fill
from cutefa.loader import get_kernel
from cutefa.model.defaults import default_spec
from cutefa.model.spec import Features

ref = _load("reference")
tv = _load("test_varlen")
graphs = _load("test_graphs")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(sm80_skip_reason() is not None, reason=str(sm80_skip_reason())),
]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@contextlib.contextmanager
def nan_allocations():
    """Every floating-point tensor torch allocates uninitialized inside (``torch.empty``,
    ``empty_like``: the call's outputs) comes NaN-filled: torch's deterministic mode with
    ``fill_uninitialized_memory``, warnings only (no op changes its algorithm). Unlike filling the
    caching allocator's free blocks, this does not depend on which block an allocation gets."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "... does not have a deterministic implementation"
            probe = torch.empty(8, device="cuda")
            assert probe.isnan().all(), "uninitialized allocations are not NaN-filled"
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


# Layouts: (per-sequence (seqlen_q, seqlen_k), per-sequence slack (rows past seqused) or None,
# rows past the last span (q, k)).
LAYOUTS = {
    "tail": ([(300, 300), (17, 500), (700, 700)], None, (77, 5)),
    "seqused": ([(300, 500), (17, 1000), (64, 64), (1000, 17)], [(5, 3), (0, 40), (64, 0), (1, 1)], (0, 0)),
    "empty": (
        [(0, 0), (40, 40), (0, 5), (5, 0), (0, 0), (129, 129)],
        [(3, 2), (0, 0), (0, 0), (2, 0), (0, 0), (0, 1)],
        (9, 0),
    ),
    "one": ([(1000, 1000)], None, (0, 0)),
    "long_tail": ([(100, 100), (37, 200)], None, (8000, 0)),
}
HAS_GAP = {"tail": True, "seqused": True, "empty": True, "one": False, "long_tail": True, "many": True}


def _many():
    """More sequences than SEQUENCE_CTAS (one fill CTA each): short ones, random slack, a few tail rows."""
    n = varlen_fill.SEQUENCE_CTAS + 88
    cpu = torch.Generator().manual_seed(600)
    lengths = [(int(a), int(b)) for a, b in torch.randint(0, 25, (n, 2), generator=cpu)]
    slack = [(int(a), int(b)) for a, b in torch.randint(0, 4, (n, 2), generator=cpu)]
    return lengths, slack, (5, 3)


def _packed(gen, name, heads, head_dim, dtype):
    lengths, slack, tail = _many() if name == "many" else LAYOUTS[name]
    p = tv.make_packed(gen, lengths, *heads, head_dim, dtype, slack=slack, tail=tail)
    assert bool((~p.rows_q()).any()) == HAS_GAP[name], name
    return p


def check_rows(tag, p, out, lse, *, causal):
    """No NaN; the rows of no sequence 0 / -inf; the others the float32 reference's
    (test_varlen.judge_forward's bars)."""
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"{tag}: NaN in out (a row nothing wrote)"
    assert not lse.isnan().any(), f"{tag}: NaN in lse (a row nothing wrote)"
    rows = p.rows_q()
    gap = ~rows
    assert (out[gap] == 0).all(), f"{tag}: rows of no sequence must be 0"
    assert torch.isneginf(lse[:, gap]).all(), f"{tag}: rows of no sequence must have lse -inf"
    with torch.no_grad():
        exact, exact_lse = p.reference(causal=causal)
    tv.judge_forward(
        tag, out[rows], lse[:, rows], exact[rows], exact_lse[:, rows], p.has_keys(causal)[rows],
        v_absmax=tv.absmax(p.v[p.rows_k()]),
    )  # fmt: skip


CASES = [*LAYOUTS, "many"]
VARIANTS = [("bf16", 128, False), ("fp16", 64, True)]


def _ids(v) -> str:
    return f"{v[0]}-hd{v[1]}-{'causal' if v[2] else 'full'}"


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
@pytest.mark.parametrize("name", CASES)
def test_api(gen, name, variant):
    """The public call (the dispatched family's kernel) into NaN memory."""
    dtype, head_dim, causal = variant
    p = _packed(gen, name, (4, 2), head_dim, DTYPES[dtype])
    p.call(causal=causal)  # warm: the kernel loaded (or compiled) first
    with nan_allocations():
        out, lse = p.call(causal=causal)
    check_rows(f"api {name} {_ids(variant)}", p, out, lse, causal=causal)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
@pytest.mark.parametrize("name", CASES)
def test_sm80_kernel(gen, name, variant):
    """The sm80-family module called directly (it runs on any GPU from sm_80 on): its fill too."""
    dtype, head_dim, causal = variant
    spec = default_spec("sm80", "fwd", dtype, head_dim, causal=causal).replace(features=Features(varlen=True))
    kernel = get_kernel(spec, current_target())
    p = _packed(gen, name, (6, 2), head_dim, DTYPES[dtype])
    used_q = p.cu_q[1:] - p.cu_q[:-1] if p.used_q is None else p.used_q
    used_k = p.cu_k[1:] - p.cu_k[:-1] if p.used_k is None else p.used_k
    with nan_allocations():
        out = torch.empty_like(p.q)
        lse = torch.empty((p.q.shape[1], p.q.shape[0]), dtype=torch.float32, device="cuda")
    assert out.isnan().all() and lse.isnan().all()
    kernel(p.q, p.k, p.v, out, lse, ref.default_scale(head_dim), p.cu_q, p.cu_k, used_q, used_k, p.max_q)
    check_rows(f"{spec.name} {name}", p, out, lse, causal=causal)


@pytest.mark.skipif(sm90_kernel_skip_reason("fp8 forward") is not None, reason="the e4m3 forward is Hopper's")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_e4m3_api(gen, causal):
    """The e4m3 call (its outputs torch.empty, no memset): slack and a tail 0 / -inf, the
    sequences as test_fp8_varlen_gpu judges them."""
    fp8v = _load("test_fp8_varlen_gpu")
    hq, hkv, d = 4, 2, 128
    seqs, fp8s, descales, meta = fp8v._packed_batch(gen, hq, hkv, d)
    cu_q, cu_k, used_q, used_k = meta
    tail = torch.full((23, hq, d), 448.0, device="cuda").to(torch.float8_e4m3fn)
    q = torch.cat([fp8s[0], tail])  # rows past cu_seqlens_q[-1]
    max_q, max_k = (max(s[i] + s[i + 2] for s in fp8v.SEQUENCES) for i in (0, 1))

    def call():
        return fp8_api.fp8_varlen_forward(
            q, fp8s[1], fp8s[2], cu_q, cu_k, max_q, max_k, causal=causal, seqused_q=used_q, seqused_k=used_k,
            q_descale=descales[0], k_descale=descales[1], v_descale=descales[2], return_lse=True,
        )  # fmt: skip

    call()
    with nan_allocations():
        out, lse = call()
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any(), "a row nothing wrote"
    used = ref.used_rows(cu_q, used_q, q.shape[0])
    assert (~used).sum() >= 23
    assert (out[~used] == 0).all() and torch.isneginf(lse[:, ~used]).all(), (
        "rows of no sequence: not 0 / -inf"
    )
    fp8v._check_sequences(
        out, lse, seqs, fp8s, descales, meta, causal=causal, scale=ref.default_scale(d), what="e4m3 api"
    )


# The graph's layouts: 4 sequences, q 1100 and k 1600 packed rows each; the gaps move.
GRAPH_LAYOUTS = [
    ([(300, 300), (0, 0), (17, 500), (700, 700)], [(20, 0), (5, 5), (0, 0), (3, 0)]),
    ([(500, 500), (17, 500), (0, 3), (400, 400)], [(0, 0), (0, 0), (9, 0), (100, 2)]),
    ([(1, 1), (1000, 1000), (0, 0), (16, 16)], [(0, 0), (0, 0), (0, 0), (0, 0)]),
]
GRAPH_TOTALS = (1100, 1600)


def _graph_layout(gen, lengths, slack, dtype):
    spans_q = sum(sq + eq for (sq, _), (eq, _) in zip(lengths, slack))
    spans_k = sum(sk + ek for (_, sk), (_, ek) in zip(lengths, slack))
    tail = (GRAPH_TOTALS[0] - spans_q, GRAPH_TOTALS[1] - spans_k)
    return tv.make_packed(gen, lengths, 4, 2, 128, dtype, slack=slack, tail=tail)


def test_cuda_graph_replays_move_the_gaps(gen, monkeypatch):
    """Captured once on the first layout; each replay after other lengths (and so other rows of no
    sequence) are copied into the static inputs, into static outputs NaN-filled first, gives 0 / -inf
    on the new gaps, the reference elsewhere, and bitwise an eager call's result."""
    dtype = torch.bfloat16
    p = _graph_layout(gen, *GRAPH_LAYOUTS[0], dtype)
    p.max_q = p.max_k = 1024  # bounds every length of every layout

    def forward():
        return p.call(causal=True)

    graphs._warm_up(forward)
    graph = torch.cuda.CUDAGraph()
    with graphs.nothing_compiles(monkeypatch), torch.cuda.graph(graph):
        static_out, static_lse = forward()
    for replay, layout in enumerate([*GRAPH_LAYOUTS[1:], GRAPH_LAYOUTS[0]]):
        fresh = _graph_layout(gen, *layout, dtype)
        for static, new in zip(
            (p.q, p.k, p.v, p.cu_q, p.cu_k, p.used_q, p.used_k),
            (fresh.q, fresh.k, fresh.v, fresh.cu_q, fresh.cu_k, fresh.used_q, fresh.used_k),
        ):
            assert static.shape == new.shape
            static.copy_(new)
        p.lengths = fresh.lengths
        static_out.fill_(math.nan)
        static_lse.fill_(math.nan)
        graph.replay()
        check_rows(f"replay {replay}", p, static_out, static_lse, causal=True)
        out, lse = forward()
        torch.cuda.synchronize()
        assert torch.equal(static_out, out), f"replay {replay}: output differs from an eager call"
        assert torch.equal(static_lse, lse), f"replay {replay}: lse differs from an eager call"
