"""The example mods (document masking over a packed batch, prefix-LM, a relative-position bias
table, softcap written as a score_mod) and what they compute, checked on the CPU: each traces, and
the traced expression evaluated with torch equals the function run on torch tensors. The GPU test
(tests/gpu/test_mods.py) and the compile test import these examples."""

from __future__ import annotations

import torch

from cutefa.mods import trace_mods
from cutefa.mods.evaluate import evaluate

SOFTCAP = 30.0


def document_mask(doc_ids: torch.Tensor, causal: bool = False):
    """mask_mod: a query attends the keys of its own document (``doc_ids`` (batch, seqlen))."""

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    return mask_mod


def prefix_lm(prefix: int):
    """mask_mod: every query attends the first ``prefix`` keys, and the keys before it (causal)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    return mask_mod


def relative_bias(table: torch.Tensor, seqlen_k: int):
    """score_mod: adds ``table[h, q_idx - kv_idx + seqlen_k - 1]`` (``table`` (heads, 2 * L - 1))."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k - 1]

    return score_mod


def softcap_mod(cap: float = SOFTCAP):
    """score_mod: the built-in ``softcap=cap``, written as a mod."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


def grids(batch: int, heads: int, sq: int, sk: int) -> dict[str, torch.Tensor]:
    return {
        "b": torch.arange(batch).view(-1, 1, 1, 1),
        "h": torch.arange(heads).view(1, -1, 1, 1),
        "q_idx": torch.arange(sq).view(1, 1, -1, 1),
        "kv_idx": torch.arange(sk).view(1, 1, 1, -1),
    }


def random_docs(batch: int, seqlen: int, docs: int, seed: int = 0) -> torch.Tensor:
    """int32 (batch, seqlen) document ids, non-decreasing, ``docs`` documents of random lengths."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(1, seqlen, (batch, docs - 1), generator=g), dim=1).values
    ids = torch.zeros(batch, seqlen, dtype=torch.int32)
    for b in range(batch):
        for c in cuts[b]:
            ids[b, int(c) :] += 1
    return ids


def test_examples_trace_and_evaluate_like_torch():
    batch, heads, sq, sk = 2, 3, 37, 45
    g = grids(batch, heads, sq, sk)
    doc = random_docs(batch, max(sq, sk), 4)
    table = torch.randn(heads, 2 * sk - 1)
    score = torch.randn(batch, heads, sq, sk)
    for mask in (document_mask(doc), document_mask(doc, causal=True), prefix_lm(7)):
        traced = trace_mods(None, mask)
        got = evaluate(traced.mask, g, traced.tensors)
        want = mask(g["b"], g["h"], g["q_idx"], g["kv_idx"])
        assert torch.equal(got.expand(batch, heads, sq, sk), want.expand(batch, heads, sq, sk))
    # relative bias: q - kv + sk - 1 stays inside the table for sq <= sk
    for mod in (relative_bias(table, sk), softcap_mod()):
        traced = trace_mods(mod, None)
        got = evaluate(traced.score, {**g, "score": score}, traced.tensors)
        want = mod(score, g["b"], g["h"], g["q_idx"], g["kv_idx"])
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
