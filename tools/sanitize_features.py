"""The feature and decode kernels of tools/sanitize.py: which variants, on which cases, and the driver
that launches them (``sanitize.py --drive`` hands a feature or decode spec to :func:`drive`).

The groups (``--kernels``), each the default variant of its family and head dim with the feature
axes the dispatcher adds for such a call (:func:`feature_spec`):

- ``sm90_fwd_varlen``: the sm90 forward over packed sequences (its causal twin for causal cases);
- ``sm90_fwd_local``: the sm90 forward with a sliding window (causal cases: right bound 0);
- ``sm80_bwd_varlen``, ``sm80_bwd_local``: the sm80 backward with those axes, the backward a Hopper
  GPU runs for them;
- ``sm80_decode``: the decode kernel (paged K/V, split keys and their combine, a kv head's query
  rows packed into one tile), the variant :mod:`cutefa.model.policy_decode` picks for 4 packed rows.

Cases (every tool but racecheck), lengths 1, 17 and 1000 with an empty sequence inside each packed
batch; racecheck: one launch of 200 rows and keys, causal, 2 query heads over 1 key/value head:

- varlen: (lengths_q, lengths_k, heads_q, heads_kv, causal): the packed spans follow one another,
  seqused equals each span;
- local: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, window_left, window_right),
  including windows that leave some rows without a key;
- decode: (cache lengths, new tokens, heads_q, heads_kv, page size, splits, causal): page sizes 16
  and 64 in scrambled page order, 1 split and 3 (the combine runs), 4 and 8 query heads per kv head.

Outputs are judged as tools/bench_check.py judges a packed problem (the decode's query rows as one
packed sequence per cache entry), every (sequence, head) slice.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

# label -> (family, direction, what): "varlen" | "local" | "decode"
FEATURE_KERNELS = {
    "sm90_fwd_varlen": ("sm90", "fwd", "varlen"),
    "sm90_fwd_local": ("sm90", "fwd", "local"),
    "sm80_bwd_varlen": ("sm80", "bwd", "varlen"),
    "sm80_bwd_local": ("sm80", "bwd", "local"),
    "sm80_decode": ("sm80", "fwd", "decode"),
}
DECODE_ROWS = 4  # packed query rows per kv head of the decode variant (group x new tokens)

VARLEN_CASES = (
    ((1, 17, 0, 1000), (1, 17, 0, 1000), 2, 2, False),
    ((1, 17, 0, 1000), (1, 17, 0, 1000), 2, 2, True),
    ((17, 1000, 0, 1), (1000, 17, 5, 0), 8, 2, False),  # seqlen_q != seqlen_k, keys without rows, GQA
    ((17, 1000, 0, 1), (1000, 17, 5, 0), 8, 2, True),  # causal rows without a key
)
LOCAL_CASES = (
    (1, 1, 1, 2, 2, False, 0, 0),
    (1, 17, 17, 2, 2, False, 4, 3),
    (1, 1000, 1000, 2, 2, False, 100, 50),
    (1, 1000, 1000, 2, 2, True, 256, 0),
    (1, 1000, 17, 2, 2, False, 3, 3),  # most rows have no key
    (2, 17, 1000, 8, 2, True, 64, 0),  # GQA, the band inside a longer key range
)
DECODE_CASES = (
    ((1, 17, 1000, 0), 1, 4, 1, 16, 1, False),
    ((1, 17, 1000, 0), 1, 4, 1, 64, 3, False),
    ((1000, 17), 1, 8, 2, 16, 3, False),
    ((1000, 17), 4, 4, 4, 64, 1, True),  # DECODE_ROWS rows from 4 tokens of one query head each
)
RACE_CASES = {
    "varlen": (((200,), (200,), 2, 1, True),),
    "local": ((1, 200, 200, 2, 1, True, 64, 0),),
    "decode": (((200,), 1, 4, 1, 16, 2, False),),
}
CASES = {"varlen": VARLEN_CASES, "local": LOCAL_CASES, "decode": DECODE_CASES}


def kind_of(kernel: str) -> str:
    return FEATURE_KERNELS[kernel][2]


def cases_for(kernel: str, tool: str) -> tuple:
    kind = kind_of(kernel)
    return RACE_CASES[kind] if tool == "racecheck" else CASES[kind]


def feature_spec(kernel: str, hdim: int, target: str):
    """The variant of a feature group at ``hdim`` that runs on ``target`` (non-causal); (None, why)
    where there is none."""
    from cutefa.model import policy_decode
    from cutefa.model.defaults import default_spec
    from cutefa.model.options import Mask
    from cutefa.model.rules import fitting_variant, why_invalid, why_not_on
    from cutefa.model.spec import Features

    arch, direction, kind = FEATURE_KERNELS[kernel]
    if kind == "decode":
        try:
            spec = policy_decode.decode_spec("bf16", hdim, DECODE_ROWS, paged=True)
        except ValueError as exc:
            return None, str(exc)
    else:
        spec = default_spec(arch, direction, "bf16", hdim)
        if spec is None:
            return None, f"no default {arch} {direction} bf16 kernel at head dim {hdim}"
        spec = fitting_variant(spec, target) or spec
        spec = (
            spec.replace(features=Features(varlen=True))
            if kind == "varlen"
            else spec.replace(mask=Mask.LOCAL)
        )
    why = why_invalid(spec) or why_not_on(spec, target)
    return (None, why) if why else (spec, None)


# ---------------------------------------------------------------------------------------------
# the driver


def _kind(spec) -> str:
    from cutefa.model.options import Mask

    if spec.features.split_kv:
        return "decode"
    return "varlen" if spec.features.varlen else "local" if spec.mask is Mask.LOCAL else "dense"


def drive(payload: dict, wrong_status: int) -> int:
    """Launch the feature or decode kernel ``payload["spec"]`` on every case (its causal twin for
    causal varlen and decode cases); with ``payload["check"]`` judge the outputs. 0, or
    ``wrong_status`` when a case's outputs failed."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_check

    from cutefa.dispatch import current_target
    from cutefa.model.spec import parse_name

    base = parse_name(payload["spec"])
    kind = _kind(base)
    run = {"varlen": _varlen, "local": _local, "decode": _decode}[kind]
    target = current_target()
    gen = torch.Generator(device="cuda").manual_seed(0)
    wrong = 0
    for case in payload["cases"]:
        poison = bench_check.poisoned_allocations("cuda") if payload["poison"] else _nothing()
        label, outputs, judge = run(bench_check, base, target, case, gen, poison, payload["check"])
        torch.cuda.synchronize()
        if not payload["check"]:
            print(f"{label}: launched", flush=True)
            continue
        verdict = judge(outputs)
        print(f"{label}: {'ok' if verdict.ok else 'WRONG: ' + verdict.message}", flush=True)
        wrong += not verdict.ok
    return wrong_status if wrong else 0


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _randn(gen, *shape):
    import torch

    return torch.randn(*shape, generator=gen, device="cuda").bfloat16()


def _cu(lengths) -> torch.Tensor:  # noqa: F821 - torch is imported lazily
    import torch

    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def _packed_forward(bench_check, q, k, v, lengths_q, lengths_k, causal, scale, window=None):
    """(out bf16 (total_q, hq, d), lse float32 (hq, total_q)) of float32 attention per sequence: the
    backward's inputs."""
    import torch

    hq, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((hq, q.shape[0]), -math.inf, device=q.device)
    q0 = k0 = 0
    with bench_check.exact_matmuls():
        for lq, lk in zip(lengths_q, lengths_k):
            for h in range(hq):
                r = bench_check.attend(q[q0 : q0 + lq, h : h + 1].transpose(0, 1), k[k0 : k0 + lk, h // group],
                                       v[k0 : k0 + lk, h // group], causal=causal, scale=scale, window=window)  # fmt: skip
                out[q0 : q0 + lq, h] = r["O"][0].to(q.dtype)
                lse[h, q0 : q0 + lq] = r["LSE"][0]
            q0, k0 = q0 + lq, k0 + lk
    return out, lse


def _varlen(bench_check, base, target, case, gen, poison, check):
    import torch

    from cutefa.api import feature_bwd
    from cutefa.api.features import FeatureArgs
    from cutefa.api.launch import call_on
    from cutefa.loader import get_kernel

    lengths_q, lengths_k, hq, hkv, causal = case
    spec = base.replace(causal=bool(causal))
    d, scale = spec.head_dim, 1.0 / math.sqrt(spec.head_dim)
    q, k, v = (
        _randn(gen, sum(lengths_q), hq, d),
        _randn(gen, sum(lengths_k), hkv, d),
        _randn(gen, sum(lengths_k), hkv, d),
    )
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    f = FeatureArgs(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=cu_q[1:] - cu_q[:-1], seqused_k=cu_k[1:] - cu_k[:-1],
                    max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))  # fmt: skip
    label = f"{spec.name} lengths_q={list(lengths_q)} lengths_k={list(lengths_k)} hq={hq} hkv={hkv} causal={int(causal)}"
    dout = None
    if spec.direction == "bwd":
        dout = _randn(gen, *q.shape)
        out, lse = _packed_forward(bench_check, q, k, v, lengths_q, lengths_k, bool(causal), scale)
        with poison:
            outputs = feature_bwd.gradients(
                dout, q, k, v, out, lse, None, bool(causal), scale, False, f, spec=spec
            )
    else:
        with poison:
            out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
            lse = torch.empty(hq, q.shape[0], device="cuda")
        call_on(q.device, get_kernel(spec, target), q, k, v, out, lse, scale, *f.kernel_args(bool(causal)))
        outputs = (out, lse)
    expect = (lambda: bench_check.packed_expectation(
        q, k, v, lengths_q, lengths_k, causal=bool(causal), scale=scale, dout=dout, slices=len(lengths_q) * hq,
    )) if check else None  # fmt: skip
    return label, outputs, (lambda o: expect().judge(o))


def _local(bench_check, base, target, case, gen, poison, check):
    import torch

    from cutefa.api import feature_bwd
    from cutefa.api.features import FeatureArgs
    from cutefa.api.launch import call_on
    from cutefa.loader import get_kernel

    batch, sq, sk, hq, hkv, causal, left, right = case
    spec, window = base, (left, right)
    d, scale = spec.head_dim, 1.0 / math.sqrt(spec.head_dim)
    q, k, v = _randn(gen, batch, sq, hq, d), _randn(gen, batch, sk, hkv, d), _randn(gen, batch, sk, hkv, d)
    f = FeatureArgs(window=window)
    label = f"{spec.name} b={batch} sq={sq} sk={sk} hq={hq} hkv={hkv} causal={int(causal)} window={window}"
    dout = None
    if spec.direction == "bwd":
        dout = _randn(gen, *q.shape)
        out, lse = zip(*(_packed_forward(bench_check, q[b], k[b], v[b], [sq], [sk], bool(causal), scale, window)
                         for b in range(batch)))  # fmt: skip
        out, lse = torch.stack(out), torch.stack(lse)
        with poison:
            outputs = feature_bwd.gradients(
                dout, q, k, v, out, lse, None, bool(causal), scale, False, f, spec=spec
            )
    else:
        with poison:
            out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
            lse = torch.empty(batch, hq, sq, device="cuda")
        call_on(q.device, get_kernel(spec, target), q, k, v, out, lse, scale, *f.kernel_args(bool(causal)))
        outputs = (out, lse)
    per = hq if dout is None else hkv
    expect = (lambda: bench_check.expectation(
        q, k, v, causal=bool(causal), scale=scale, dout=dout, slices=batch * per, window=window,
    )) if check else None  # fmt: skip
    return label, outputs, (lambda o: expect().judge(o))


def _decode_call(kvcache, q, k_cache, v_cache, seqlens, page_table, scale, causal, splits, spec, target):
    """``kvcache.decode`` with no new tokens, rotary or window, by keyword (the arguments it takes)."""
    import inspect

    given = {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "k": None, "v": None, "rotary_cos": None, "rotary_sin": None,
        "seqlens": seqlens, "cache_batch_idx": None, "cache_leftpad": None, "page_table": page_table,
        "seqlen_new": 0, "softmax_scale": scale, "causal": causal, "window_left": -1, "window_right": -1,
        "softcap": 0.0, "rotary_interleaved": True, "num_splits": splits, "spec": spec, "target": target,
    }  # fmt: skip
    takes = inspect.signature(kvcache.decode).parameters
    return kvcache.decode(**{name: value for name, value in given.items() if name in takes})


def _decode(bench_check, base, target, case, gen, poison, check):
    import torch

    from cutefa.api import kvcache

    lengths, tokens, hq, hkv, page, splits, causal = case
    spec = base.replace(causal=bool(causal))
    d, scale = spec.head_dim, 1.0 / math.sqrt(spec.head_dim)
    batch = len(lengths)
    per_seq = max(1, -(-max(lengths) // page))
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(page)).int()
    table = order.reshape(batch, per_seq).cuda()
    k_pool, v_pool = (_randn(gen, batch * per_seq, page, hkv, d) for _ in range(2))
    q = _randn(gen, batch, tokens, hq, d)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    label = (f"{spec.name} cache={list(lengths)} tokens={tokens} hq={hq} hkv={hkv} page={page} "
             f"splits={splits} causal={int(causal)}")  # fmt: skip
    with poison:
        out, lse = _decode_call(
            kvcache, q, k_pool, v_pool, seqlens, table, scale, bool(causal), splits, spec, target
        )
    # the judged form: one packed sequence per cache entry, its keys gathered from the pages
    packed_out = out.reshape(batch * tokens, hq, d)
    packed_lse = lse.permute(1, 0, 2).reshape(hq, batch * tokens)

    def gather(pool):
        return torch.cat([pool[table[b].long()].flatten(0, 1)[: lengths[b]] for b in range(batch)])

    expect = (lambda: bench_check.packed_expectation(
        q.reshape(batch * tokens, hq, d), gather(k_pool), gather(v_pool), [tokens] * batch, list(lengths),
        causal=bool(causal), scale=scale, slices=batch * hq,
    )) if check else None  # fmt: skip
    return label, (packed_out, packed_lse), (lambda o: expect().judge(o))
