"""The sm90 e4m3 forward on packed sequences (templates/fwd_sm90_fp8.py.j2 with the varlen axis,
cutefa.api.fp8.fp8_varlen_forward) on a Hopper GPU, sequence by sequence against a float32
reference of the unquantized inputs, with the bars of test_fp8.py (its module docs): out's
relative L2 error at most 1.25x that of the float32 emulation of the same quantization steps plus
0.005, the lse within 0.02 of the emulation's, rows with no key 0 / -inf.

Each sequence is quantized on its own (descales per (sequence, kv head)). Lengths 1, 17, 1000 and
4097, an empty sequence, a sequence with no key, seqlen_q != seqlen_k per sequence, seqused below
the spans (slack rows of no sequence), GQA and MQA. The kernel is called directly on NaN-poisoned
outputs: every used row must be right and every other row 0 / -inf (the attention kernel never
writes them, a tile's rows past its sequence belong to the next one; the module's fill kernel,
cutefa/kernels/common/varlen_fill.py, does), through the API call too.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm90_kernel_skip_reason

import cutefa
from cutefa.api import fp8 as fp8_api
from cutefa.dispatch import current_target
from cutefa.loader import get_kernel
from cutefa.model.defaults import default_spec
from cutefa.model.spec import Features

ref = _load("reference")
fp8_tests = _load("test_fp8")


def _skip_reason() -> str | None:
    return sm90_kernel_skip_reason("fp8 forward")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

# (used q, used k, slack q, slack k) per sequence: lengths 1/17/1000/4097, an empty sequence, a
# sequence with no key, seqlen_q != seqlen_k both ways, spans longer than seqused.
SEQUENCES = (
    (1, 1, 0, 3),
    (17, 17, 5, 0),
    (0, 9, 2, 1),
    (1000, 1000, 0, 0),
    (6, 0, 1, 4),
    (4097, 4097, 31, 7),
    (17, 1000, 3, 2),
    (1000, 17, 0, 9),
)
HEADS = ((4, 2), (3, 1))  # (heads_q, heads_kv): GQA, MQA


def _packed_batch(gen, hq, hkv, d):
    """Per sequence: unquantized (q, k, v) of its used rows, and the packed e4m3 tensors with each
    sequence quantized on its own (descales (batch, heads_kv)), slack rows holding other values."""
    cu_q, cu_k, used_q, used_k = [0], [0], [], []
    seqs, qs, ks, vs, descales = [], [], [], [], []
    for nq, nk, slack_q, slack_k in SEQUENCES:
        q, k, v = fp8_tests.make_inputs(gen, 1, nq + slack_q, nk + slack_k, hq, hkv, d)
        used = (q[:, :nq], k[:, :nk], v[:, :nk])
        seqs.append(used)
        quantized = []
        for x, group in zip(used, (hq // hkv, 1, 1)):
            if x.shape[1]:
                xq, xd = cutefa.quantize_fp8(x, "head", group=group)
            else:
                xq, xd = x.to(torch.float8_e4m3fn), torch.ones(1, x.shape[2] // group, device="cuda")
            quantized.append((xq, xd))
        # slack rows: e4m3 garbage (large values) that must not leak into any sequence
        qs.append(torch.cat([quantized[0][0][0], torch.full_like(q[0, nq:], 448.0).to(torch.float8_e4m3fn)]))
        ks.append(torch.cat([quantized[1][0][0], torch.full_like(k[0, nk:], 448.0).to(torch.float8_e4m3fn)]))
        vs.append(torch.cat([quantized[2][0][0], torch.full_like(v[0, nk:], -448.0).to(torch.float8_e4m3fn)]))
        descales.append(tuple(xd for _, xd in quantized))
        cu_q.append(cu_q[-1] + nq + slack_q)
        cu_k.append(cu_k[-1] + nk + slack_k)
        used_q.append(nq)
        used_k.append(nk)
    meta = tuple(torch.tensor(x, dtype=torch.int32, device="cuda") for x in (cu_q, cu_k, used_q, used_k))
    qd, kd, vd = (torch.cat([d[i] for d in descales]).contiguous() for i in range(3))
    fp8s = (torch.cat(qs), torch.cat(ks), torch.cat(vs))
    return seqs, fp8s, (qd, kd, vd), meta


def _check_sequences(out, lse, seqs, fp8s, descales, meta, *, causal, scale, what):
    """Every sequence against its own float32 reference and emulation (test_fp8.check)."""
    cu_q, cu_k, used_q, used_k = (m.tolist() for m in meta)
    for b, (q, k, v) in enumerate(seqs):
        nq, nk = used_q[b], used_k[b]
        if nq == 0:
            continue
        rows = slice(cu_q[b], cu_q[b] + nq)
        o, l = out[rows][None], lse[:, rows][None]
        if nk == 0:
            assert torch.all(o == 0) and torch.all(torch.isneginf(l)), f"{what} seq {b}: no key, not 0 / -inf"
            continue
        keys = slice(cu_k[b], cu_k[b] + nk)
        seq_fp8 = (fp8s[0][rows][None], fp8s[1][keys][None], fp8s[2][keys][None])
        seq_descales = tuple(d[b : b + 1] for d in descales)
        exact, exact_lse = ref.attention_ref(q, k, v, causal=causal)
        emul, emul_lse = fp8_tests.emulate(seq_fp8, seq_descales, causal=causal, scale=scale)
        fp8_tests.check(o, l, exact, exact_lse, emul, emul_lse, what=f"{what} seq {b} ({nq}, {nk})")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
def test_kernel_on_poisoned_outputs(gen, head_dim, causal, heads):
    """The dispatched varlen variant called directly: used rows right, the others 0 / -inf."""
    hq, hkv = heads
    spec = default_spec("sm90", "fwd", "e4m3", head_dim, causal=causal).replace(
        features=Features(varlen=True)
    )
    seqs, fp8s, descales, meta = _packed_batch(gen, hq, hkv, head_dim)
    total_q = fp8s[0].shape[0]
    out = torch.full((total_q, hq, head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((hq, total_q), math.nan, device="cuda")
    scale = ref.default_scale(head_dim)
    max_q = max(s[0] for s in SEQUENCES)
    get_kernel(spec, current_target())(*fp8s, out, lse, *descales, scale, *meta, max_q)
    torch.cuda.synchronize()
    used = ref.used_rows(meta[0], meta[2], total_q)
    assert torch.all(out[~used] == 0) and torch.all(torch.isneginf(lse[:, ~used])), (
        "a row of no sequence is not 0 / -inf"
    )
    _check_sequences(out, lse, seqs, fp8s, descales, meta, causal=causal, scale=scale, what=spec.name)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_api(gen, head_dim, causal):
    """fp8_varlen_forward: the same results, 0 / -inf on the rows of no sequence; per-tensor v
    descale broadcast; seqused omitted means the whole spans."""
    hq, hkv = HEADS[0]
    seqs, fp8s, descales, meta = _packed_batch(gen, hq, hkv, head_dim)
    cu_q, cu_k, used_q, used_k = meta
    max_q, max_k = (max(s[i] + s[i + 2] for s in SEQUENCES) for i in (0, 1))
    out, lse = fp8_api.fp8_varlen_forward(
        *fp8s, cu_q, cu_k, max_q, max_k, causal=causal, seqused_q=used_q, seqused_k=used_k,
        q_descale=descales[0], k_descale=descales[1], v_descale=descales[2], return_lse=True,
    )  # fmt: skip
    scale = ref.default_scale(head_dim)
    used = ref.used_rows(cu_q, used_q, fp8s[0].shape[0])
    assert torch.all(out[~used] == 0) and torch.all(torch.isneginf(lse[:, ~used]))
    _check_sequences(out, lse, seqs, fp8s, descales, meta, causal=causal, scale=scale, what="api")
    # Without seqused the spans are the sequences: the slack rows are then part of them.
    whole = fp8_api.fp8_varlen_forward(*fp8s, cu_q, cu_k, max_q, max_k, causal=causal)
    assert not torch.isnan(whole).any() and whole.shape == out.shape
