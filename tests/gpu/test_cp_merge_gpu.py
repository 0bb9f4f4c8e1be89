"""Context parallelism's arithmetic on one GPU: the ring's steps (PyTorch's
``context_parallel``: per step a flash call on a key shard, merged by log-sum-exp; per step a
flash backward with the merged out and log-sum-exp, summed), simulated rank by rank in one
process with cutefa's kernels, against the unsharded cutefa call and the float32 reference.

Two ways of calling cutefa per step: its own API (``flash_attn_func``, ``cutefa::flash_bwd``), and
the aten ops the SDPA provider overrides, called the way the ring calls them (by keyword, on the
layouts the ring hands them: (batch, heads, seqlen, head_dim)-contiguous shards, half-shard
views, the merged out and log-sum-exp). The CPU test tests/test_context_parallel.py checks that
the installed torch's ring makes exactly those calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from gpu_support import sm80_skip_reason
from reference import attention_ref, rel_l2

import cutefa
from cutefa import dispatch
from cutefa import torch_sdpa as ts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(sm80_skip_reason() is not None, reason=str(sm80_skip_reason())),
]
aten = torch.ops.aten
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def shard_rows(seqlen: int, world: int, balanced: bool) -> list[torch.Tensor]:
    """Each rank's global positions: a contiguous chunk, or (load-balanced, PyTorch's head-tail
    order) chunks r and 2W-1-r of 2W."""
    if not balanced:
        return list(torch.arange(seqlen).chunk(world))
    chunks = torch.arange(seqlen).chunk(2 * world)
    return [torch.cat([chunks[r], chunks[2 * world - 1 - r]]) for r in range(world)]


def ring_behaviour(rank: int, world: int, i: int, causal: bool, balanced: bool) -> bool | None:
    """is_causal of step i (None: skipped), as PyTorch's ring decides it."""
    if not causal:
        return False
    if i == 0:
        return True
    return False if ((rank - i) % world < rank or balanced) else None


def ring_steps(rank: int, world: int, causal: bool, balanced: bool):
    """(i, source rank, q rows, k rows, is_causal) of each step that runs: slices of the local shard."""
    half = slice(None)
    for i in range(world):
        behaviour = ring_behaviour(rank, world, i, causal, balanced)
        if behaviour is None:
            continue
        rows, keys = half, half
        if i > 0 and balanced and causal:
            rows, keys = (half, "head") if i <= rank else ("tail", half)
        yield i, (rank - i) % world, rows, keys, behaviour


def _part(t: torch.Tensor, which) -> torch.Tensor:
    if which == "head":
        return t.chunk(2, dim=2)[0]
    if which == "tail":
        return t.chunk(2, dim=2)[1]
    return t


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out, block_lse):
    """The log-sum-exp merge of two partial attentions over disjoint keys (float32)."""
    block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
    if out is None:
        return block_out, block_lse
    out = out - torch.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return out, lse


# ---------------------------------------------------------------------------------------------
# The two ways of calling cutefa per step (bhsd tensors in and out)


def api_forward(q, k, v, causal):
    out, lse = cutefa.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal, return_lse=True)
    return out.transpose(1, 2), lse


def api_backward(dout, q, k, v, out, lse, causal):
    scale = HEAD_DIM**-0.5
    grads = torch.ops.cutefa.flash_bwd(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, None, causal, scale, False
    )
    return tuple(g.transpose(1, 2) for g in grads)


_rest: dict[str, object] = {}


def aten_forward(q, k, v, causal):
    out, lse, *rest = aten._scaled_dot_product_flash_attention(
        q, k, v, is_causal=causal, dropout_p=0.0, scale=None
    )
    _rest["fwd"] = rest
    return out, lse


def aten_backward(dout, q, k, v, out, lse, causal):
    cum_q, cum_k, max_q, max_k, seed, offset, _ = _rest["fwd"]
    grads = aten._scaled_dot_product_flash_attention_backward.default(
        grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse, cum_seq_q=cum_q, cum_seq_k=cum_k,
        max_q=max_q, max_k=max_k, dropout_p=0.0, is_causal=causal, philox_seed=seed, philox_offset=offset,
        scale=None,
    )  # fmt: skip
    return grads[:3]


def ring(q, k, v, dout, world, causal, balanced, forward: Callable, backward: Callable):
    """(out, dq, dk, dv) of the whole sequence, every rank's ring simulated in turn. Inputs and
    results are global (batch, heads, seqlen, head_dim) tensors in sequence order."""
    rows = shard_rows(q.shape[2], world, balanced)
    # what context_parallel leaves in each buffer: (batch, heads, seqlen)-contiguous shards
    local = [[t[:, :, r.to(t.device)].contiguous() for t in (q, k, v, dout)] for r in rows]
    outs, lses = [], []
    for rank in range(world):
        query = local[rank][0]
        out = lse = None
        for _, src, q_rows, k_rows, c in ring_steps(rank, world, causal, balanced):
            key, value = (_part(t, k_rows) for t in local[src][1:3])
            block_out, block_lse = forward(_part(query, q_rows), key, value, c)
            assert block_lse.dtype == torch.float32 and block_lse.shape == _part(query, q_rows).shape[:3]
            if q_rows == "tail":  # the ring merges into the second half only
                o2, l2 = merge(out.chunk(2, 2)[1], lse.chunk(2, 2)[1], block_out, block_lse)
                out = torch.cat([out.chunk(2, 2)[0], o2], 2)
                lse = torch.cat([lse.chunk(2, 2)[0], l2], 2)
            else:
                out, lse = merge(out, lse, block_out, block_lse)
        outs.append(out.to(q.dtype))
        lses.append(lse.squeeze(-1))
    grads = [[torch.zeros_like(t, dtype=torch.float32) for t in local[r][:3]] for r in range(world)]
    for rank in range(world):
        query, dout_l, out, lse = local[rank][0], local[rank][3], outs[rank], lses[rank]
        for _, src, q_rows, k_rows, c in ring_steps(rank, world, causal, balanced):
            key, value = (_part(t, k_rows) for t in local[src][1:3])
            part_lse = _part(lse, q_rows).contiguous()
            dq, dk, dv = backward(_part(dout_l, q_rows), _part(query, q_rows), key, value, _part(out, q_rows),
                                  part_lse, c)  # fmt: skip
            _part(grads[rank][0], q_rows).add_(dq.float())
            _part(grads[src][1], k_rows).add_(dk.float())
            _part(grads[src][2], k_rows).add_(dv.float())
    result = [torch.empty_like(t) for t in (q, q, k, v)]
    for rank, r in enumerate(rows):
        r = r.to(q.device)
        result[0][:, :, r] = outs[rank]
        for j in range(3):
            result[j + 1][:, :, r] = grads[rank][j].to(q.dtype)
    return result


@pytest.fixture
def served(caplog):
    """The provider active with its log on: the names of the ops it served."""
    ts.activate()
    dispatch.set_logging(True)
    caplog.set_level(logging.INFO, logger="cutefa")

    def read():
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cutefa sdpa:")]
        return lines

    yield read
    dispatch.set_logging(False)
    ts.deactivate()


CASES = [  # (seqlen, world, causal, load balanced)
    (8192, 2, True, True), (8192, 4, True, True), (8192, 2, True, False), (8192, 2, False, False),
    (32768, 2, True, True), (32768, 2, False, False),
]  # fmt: skip


@pytest.mark.parametrize("path", ["api", "aten"])
@pytest.mark.parametrize("seqlen,world,causal,balanced", CASES)
def test_ring_merge_matches_the_unsharded_call(gen, request, path, seqlen, world, causal, balanced):
    if path == "aten" and not hasattr(torch.nn.attention, "register_flash_attention_impl"):
        pytest.skip(
            f"torch {torch.__version__} has no flash-attention provider registry (torch 2.10 and later)"
        )
    lines = request.getfixturevalue("served") if path == "aten" else None
    shapes = (HEADS_Q, HEADS_KV, HEADS_KV, HEADS_Q)
    q, k, v, dout = (torch.randn(1, seqlen, h, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
                     .transpose(1, 2) for h in shapes)  # fmt: skip
    fwd, bwd = (api_forward, api_backward) if path == "api" else (aten_forward, aten_backward)
    got = ring(q, k, v, dout, world, causal, balanced, fwd, bwd)
    if lines is not None:
        found = lines()
        assert found and all("served by cutefa" in line for line in found), found[:3]

    # the unsharded cutefa call and the float32 reference (its gradients at 8k only: autograd's memory)
    full_out, full_lse = api_forward(q, k, v, causal)
    full = [full_out, *api_backward(dout, q, k, v, full_out, full_lse, causal)]
    qf, kf, vf = (t.transpose(1, 2).detach().float().requires_grad_(seqlen <= 8192) for t in (q, k, v))
    ref_out, _ = attention_ref(qf, kf, vf, causal=causal)
    refs = [ref_out.transpose(1, 2)]
    if seqlen <= 8192:
        refs += [
            g.transpose(1, 2)
            for g in torch.autograd.grad(ref_out, (qf, kf, vf), dout.transpose(1, 2).float())
        ]
    for name, a, b, ref in zip(("out", "dq", "dk", "dv"), got, full, refs + [None] * 3):
        if ref is not None:
            err, base = rel_l2(a, ref), rel_l2(b, ref)
            assert err <= 2 * base + 2e-3, (name, err, base)
        else:
            assert rel_l2(a, b) <= 2e-2, (name, rel_l2(a, b))
