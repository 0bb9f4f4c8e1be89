"""GPU fuzz: random problems through cutefa's public functions and autograd, against a float32
reference, with every option cutefa has.

Each case is drawn from its own seed (printed with the case on failure; run it alone with
``CUTEFA_FUZZ_SEED=<seed> CUTEFA_FUZZ_CASES=1``): fp16 or bf16; head dim 64, 96, 128, 192 or 256;
batch 1-4; seqlens 1-2100 (log-uniform, seqlen_q != seqlen_k on dense calls); query heads over key/value
heads in the ratio 1, 2, 4 or 8, or MQA; causal or not; the log-sum-exp returned or not; the backward
(dQ, dK, dV, and d sinks) through ``out.backward`` most of the time. Where ``cutefa`` has them, also
``flash_attn_varlen_func`` (packed sequences of their own lengths, sometimes ``seqused_q/k`` below
the spans and packed rows past the last sequence), and ``window_size``, ``softcap``, ``alibi_slopes``
((heads,) or (batch, heads)) and ``sinks``: each is probed once with a tiny call, and one whose call
raises NotImplementedError is left out (forward and backward probed apart), which the run prints once
(and warns). 24 cases, 200 with ``CUTEFA_FULL_GPU_TESTS=1`` (the full GPU suite), any count with
``CUTEFA_FUZZ_CASES``.

Every output is poisoned (allocations NaN-filled) before cutefa writes it, and NaN never passes.
Bars: O, dQ, dK, dV and d sinks within 3x the error of the same reference computed in the inputs'
16-bit dtype (plus 1e-3 relative), O also in largest-element error (3x plus 2 roundings of the
dtype); the float32 log-sum-exp within 8x the float32 reference's error against float64, plus 32
float32 ulps of its magnitude, the exp2 polynomial's error of the variants that use one, and with a
softcap the tanh approximation's (2^-11 of the cap). Rows that attend no key: out 0, lse -inf (the
sink with sinks), zero gradients; packed rows of no sequence likewise.

The kernels a run needs are compiled first in ``CUTEFA_FUZZ_JOBS`` processes (default: half the CPU
cores, at most 8; 1: no warm-up), each running a share of the cases once without checks, so the
cases themselves load them from the cache. The cases' bounds and the reference itself (against
autograd of plain attention, and the sinks' gradient against finite differences) are tested on the
CPU here too (no ``gpu`` marker).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

GPU = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

FULL = os.environ.get("CUTEFA_FULL_GPU_TESTS", "") not in ("", "0")
COUNT = int(os.environ.get("CUTEFA_FUZZ_CASES") or (200 if FULL else 24))
BASE_SEED = int(os.environ.get("CUTEFA_FUZZ_SEED") or 1000)
JOBS = int(os.environ.get("CUTEFA_FUZZ_JOBS") or max(1, min(8, (os.cpu_count() or 2) // 2)))
OPTIONS = ("varlen", "window", "softcap", "alibi", "sinks")
HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MAX_SCORES = 60_000_000  # score elements per case (the references hold a few times that)
FACTOR = 3
REL_FLOOR = 1e-3
LSE_FACTOR, LSE_ULPS, FLOAT32_ULP = 8, 32, 2.0**-23
EXP2_POLY_ERROR = 7.5e-5  # cutefa/kernels/common/exp2.py's polynomial (relative)
TANH_APPROX_ERROR = 2.0**-11  # tanh.approx.f32 (relative), cutefa/kernels/common/score_mods.py


@dataclass(frozen=True)
class Case:
    seed: int
    dtype: str
    head_dim: int
    seqlens_q: tuple[int, ...]  # per sequence (dense: batch copies of one length)
    seqlens_k: tuple[int, ...]
    heads_q: int
    heads_kv: int
    causal: bool
    return_lse: bool
    backward: bool
    varlen: bool = False
    used_q: tuple[int, ...] | None = None  # seqused_q (varlen), else the spans
    used_k: tuple[int, ...] | None = None
    extra_rows: int = 0  # packed q rows past the last sequence (varlen)
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: str | None = None  # "heads": (heads_q,) slopes; "batch": (batch, heads_q)
    sinks: bool = False

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    def options(self) -> set[str]:
        on = {"varlen": self.varlen, "window": self.window is not None, "softcap": bool(self.softcap),
              "alibi": self.alibi is not None, "sinks": self.sinks}  # fmt: skip
        return {name for name, used in on.items() if used}

    def describe(self) -> str:
        return (
            f"fuzz case seed={self.seed} (CUTEFA_FUZZ_SEED={self.seed} CUTEFA_FUZZ_CASES=1): "
            + json.dumps(
                {k: v for k, v in asdict(self).items() if v not in (None, False, 0, 0.0) or k == "causal"}
            )
        )


def _length(rng: random.Random) -> int:
    return max(1, min(2100, round(math.exp(rng.uniform(0.0, math.log(2100))))))


def draw(seed: int) -> Case:
    """The case of ``seed``, every option drawn (the same draws whatever is available)."""
    rng = random.Random(seed)
    dtype = rng.choice(sorted(DTYPES))
    head_dim = rng.choice(HEAD_DIMS)
    ratio = rng.choice([1, 2, 4, 8, "mqa"])
    if ratio == "mqa":
        heads_kv, heads_q = 1, rng.choice([2, 3, 6, 12])
    else:
        heads_kv = rng.choice([1, 2, 3] if ratio <= 4 else [1, 2])
        heads_q = ratio * heads_kv
    batch = rng.randint(1, 4)
    varlen = rng.random() < 0.3
    sq, sk = _length(rng), _length(rng)
    while sk == sq:
        sk = _length(rng)
    spans_q = tuple(_length(rng) for _ in range(batch)) if varlen else (sq,) * batch
    spans_k = tuple(_length(rng) for _ in range(batch)) if varlen else (sk,) * batch
    seqused = varlen and rng.random() < 0.3
    used_q = tuple(rng.randint(1, s) for s in spans_q) if seqused else None
    used_k = tuple(rng.randint(1, s) for s in spans_k) if seqused else None
    extra_rows = rng.choice([0, 0, 7]) if varlen else 0
    causal = rng.random() < 0.5
    window = None
    if rng.random() < 0.25:
        left = rng.choice([-1, 0, rng.randint(1, 400)])
        right = 0 if causal else rng.choice([-1, 0, rng.randint(1, 400)])
        if left == -1 and right in (-1, 0):
            left = rng.randint(1, 400)  # (-1, -1) is no window and (-1, 0) the causal mask
        window = (left, right)
    softcap = rng.choice([5.0, 30.0, 50.0]) if rng.random() < 0.25 else 0.0
    alibi = rng.choice(["heads", "batch"]) if rng.random() < 0.25 else None
    sinks = rng.random() < 0.25
    case = Case(
        seed, dtype, head_dim, spans_q, spans_k, heads_q, heads_kv, causal, rng.random() < 0.5, rng.random() < 0.7,
        varlen, used_q, used_k, extra_rows, window, softcap, alibi, sinks,
    )  # fmt: skip
    return _shrink(case)


def _shrink(case: Case) -> Case:
    """Fewer sequences, then shorter ones, until the case's scores fit :data:`MAX_SCORES`."""
    while True:
        uq = case.used_q or case.seqlens_q
        uk = case.used_k or case.seqlens_k
        if case.heads_q * sum(a * b for a, b in zip(uq, uk)) <= MAX_SCORES:
            return case
        if case.batch > 1:
            drop = {f: getattr(case, f)[:-1] for f in ("seqlens_q", "seqlens_k", "used_q", "used_k")
                    if getattr(case, f) is not None}  # fmt: skip
            case = replace(case, **drop)
            continue
        half = {f: tuple(max(1, x // 2) for x in getattr(case, f))
                for f in ("seqlens_q", "seqlens_k", "used_q", "used_k") if getattr(case, f) is not None}  # fmt: skip
        case = replace(case, **half)


def restrict(case: Case, available: dict[str, str]) -> Case:
    """``case`` without the options ``available`` lacks (option -> "fwd+bwd" | "fwd" | "off"), and
    forward-only where an option it keeps has no backward."""
    off = {o for o in case.options() if available.get(o, "off") == "off"}
    if off:
        changes = {}
        if "varlen" in off:  # one length for every sequence, queries != keys
            n, sq, sk = case.batch, case.seqlens_q[0], case.seqlens_k[0]
            sk = sk if sk != sq else sk + 1 if sk < 2100 else sk - 1
            changes |= {"varlen": False, "used_q": None, "used_k": None, "extra_rows": 0,
                        "seqlens_q": (sq,) * n, "seqlens_k": (sk,) * n}  # fmt: skip
        changes |= {"window": None} if "window" in off else {}
        changes |= {"softcap": 0.0} if "softcap" in off else {}
        changes |= {"alibi": None} if "alibi" in off else {}
        changes |= {"sinks": False} if "sinks" in off else {}
        case = _shrink(replace(case, **changes))
    if case.backward and any(available.get(o) == "fwd" for o in case.options()):
        case = replace(case, backward=False)
    return case


# ---------------------------------------------------------------------------------------------
# inputs and the call


def inputs(case: Case, device="cuda") -> dict:
    """The case's tensors, packed: q (total_q, hq, d), k, v (total_k, hkv, d), dout; cu_seqlens,
    seqused; slopes and sinks where the case has them."""
    gen = torch.Generator(device=device).manual_seed(case.seed)
    dt = DTYPES[case.dtype]
    total_q = sum(case.seqlens_q) + case.extra_rows
    total_k = sum(case.seqlens_k)
    d, hq, hkv = case.head_dim, case.heads_q, case.heads_kv

    def randn(*shape, dtype=dt):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    t = {"q": randn(total_q, hq, d), "k": randn(total_k, hkv, d), "v": randn(total_k, hkv, d)}
    t["dout"] = randn(total_q, hq, d)
    t["cu_q"] = ints([0, *torch.tensor(case.seqlens_q).cumsum(0).tolist()])
    t["cu_k"] = ints([0, *torch.tensor(case.seqlens_k).cumsum(0).tolist()])
    if case.used_q is not None:
        t["used_q"], t["used_k"] = ints(case.used_q), ints(case.used_k)
    if case.alibi is not None:
        base = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], device=device)
        if case.alibi == "batch":
            base = base * (1 + torch.rand(case.batch, hq, generator=gen, device=device))
        t["slopes"] = base
    if case.sinks:
        t["sinks"] = randn(hq, dtype=torch.float32)
    return t


def call(case: Case, t: dict, poisoned) -> dict:
    """cutefa on the case (outputs and gradients NaN-poisoned when allocated): {"O", "LSE" (hq,
    total_q) or None, "dQ", "dK", "dV", "dsinks"} in the packed layout."""
    import cutefa

    q, k, v = (t[n].detach().requires_grad_(case.backward) for n in ("q", "k", "v"))
    sinks = t["sinks"].detach().requires_grad_(case.backward) if case.sinks else None
    opts = {}
    if case.window is not None:
        opts["window_size"] = case.window
    if case.softcap:
        opts["softcap"] = case.softcap
    if case.alibi is not None:
        opts["alibi_slopes"] = t["slopes"]
    if sinks is not None:
        opts["sinks"] = sinks
    b, sq = case.batch, case.seqlens_q[0]
    with poisoned():
        if case.varlen:
            res = cutefa.flash_attn_varlen_func(
                q, k, v, t["cu_q"], t["cu_k"], max(case.seqlens_q), max(case.seqlens_k), causal=case.causal,
                return_lse=case.return_lse, seqused_q=t.get("used_q"), seqused_k=t.get("used_k"), **opts,
            )  # fmt: skip
        else:
            dense = [x.view(b, -1, *x.shape[1:]) for x in (q, k, v)]
            res = cutefa.flash_attn_func(*dense, causal=case.causal, return_lse=case.return_lse, **opts)
        out, lse = res if case.return_lse else (res, None)
        if case.backward:
            out.backward(t["dout"].view(out.shape))
    got = {"O": out.detach().reshape(-1, case.heads_q, case.head_dim)}
    if lse is not None:
        got["LSE"] = (
            lse.detach() if case.varlen else lse.detach().transpose(0, 1).reshape(case.heads_q, b * sq)
        )
    if case.backward:
        got |= {"dQ": q.grad, "dK": k.grad, "dV": v.grad}
        if sinks is not None:
            got["dsinks"] = sinks.grad
    return got


# ---------------------------------------------------------------------------------------------
# the reference


def _segment(qs, ks, vs, case: Case, slopes, sinks, dtype):
    """One sequence's attention in ``dtype`` (differentiable): (out (sq, hq, d), lse (hq, sq))."""
    sq, hq, _ = qs.shape
    sk = ks.shape[0]
    g = hq // ks.shape[1]
    scale = 1.0 / math.sqrt(case.head_dim)
    qh = qs.to(dtype).transpose(0, 1)
    kh = ks.to(dtype).transpose(0, 1).repeat_interleave(g, 0)
    vh = vs.to(dtype).transpose(0, 1).repeat_interleave(g, 0)
    s = (qh @ kh.transpose(1, 2)) * scale
    if case.softcap:
        s = case.softcap * torch.tanh(s / case.softcap)
    rows = torch.arange(sq, device=qs.device)[:, None]
    cols = torch.arange(sk, device=qs.device)[None, :]
    before = rows + (sk - sq) - cols  # > 0: the key is left of the row's diagonal
    if slopes is not None:
        s = s - slopes.to(dtype)[:, None, None] * before.abs().to(dtype)
    left, right = case.window if case.window is not None else (-1, -1)
    right = 0 if case.causal else right
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=qs.device)
    if right >= 0:
        allowed &= before >= -right
    if left >= 0:
        allowed &= before <= left
    s = s.masked_fill(~allowed, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(dtype)[:, None, None]
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    out = (e @ vh) / denom.clamp_min(torch.finfo(dtype).tiny)
    return out.transpose(0, 1), (m + torch.log(denom)).squeeze(-1)


def reference(case: Case, t: dict, dtype, grads: bool) -> dict:
    """The case's attention in ``dtype``, sequence by sequence, in the packed layout (rows of no
    sequence: out 0, lse -inf, no gradient); with ``grads`` autograd's gradients of ``out . dout``."""
    total_q, hq, d = t["q"].shape
    device = t["q"].device
    res = {"O": torch.zeros(total_q, hq, d, dtype=torch.float64, device=device),
           "LSE": torch.full((hq, total_q), -math.inf, dtype=torch.float64, device=device)}  # fmt: skip
    if grads:
        res |= {
            n: torch.zeros(t[x].shape, dtype=torch.float64, device=device)
            for n, x in (("dQ", "q"), ("dK", "k"), ("dV", "v"))
        }
        if case.sinks:
            res["dsinks"] = torch.zeros(hq, dtype=torch.float64, device=device)
    cu_q, cu_k = t["cu_q"].tolist(), t["cu_k"].tolist()
    for b in range(case.batch):
        nq = case.used_q[b] if case.used_q else case.seqlens_q[b]
        nk = case.used_k[b] if case.used_k else case.seqlens_k[b]
        rq, rk = slice(cu_q[b], cu_q[b] + nq), slice(cu_k[b], cu_k[b] + nk)
        leaves = [
            t[n][r].detach().to(dtype).requires_grad_(grads) for n, r in (("q", rq), ("k", rk), ("v", rk))
        ]
        sink = t["sinks"].detach().to(dtype).requires_grad_(grads) if case.sinks else None
        slopes = None
        if case.alibi is not None:
            slopes = t["slopes"] if t["slopes"].dim() == 1 else t["slopes"][b]
        with torch.set_grad_enabled(grads):
            out, lse = _segment(*leaves, case, slopes, sink, dtype)
        res["O"][rq] = out.detach().double()
        res["LSE"][:, rq] = lse.detach().double()
        if grads:
            out.backward(t["dout"][rq].to(dtype))
            for name, leaf, rows in zip(("dQ", "dK", "dV"), leaves, (rq, rk, rk)):
                res[name][rows] = leaf.grad.double()
            if sink is not None:
                res["dsinks"] += sink.grad.double()
    return res


# ---------------------------------------------------------------------------------------------
# the check


def _diff(x, ref):
    x, ref = x.double(), ref.double()
    d = torch.where(x == ref, torch.zeros_like(x), (x - ref).abs())  # equal infinities: 0
    return torch.nan_to_num(d, nan=math.inf, posinf=math.inf)


def rel(x, ref) -> float:
    """Relative L2 error, the denominator at least 1e-3 per element; NaN or a wrong infinity: inf."""
    d = _diff(x, ref)
    if torch.isinf(d).any():
        return math.inf
    floor = 1e-3 * math.sqrt(max(1, ref.numel()))
    return (d.norm() / max(ref.double().nan_to_num(0.0, 0.0, 0.0).norm().item(), floor)).item()


def max_abs(x, ref) -> float:
    return 0.0 if ref.numel() == 0 else _diff(x, ref).max().item()


def check(case: Case, got: dict, exact: dict, low: dict, lse64) -> list[str]:
    """What is wrong with ``got`` (cutefa's outputs) against the float32 reference ``exact``, with bars
    from ``low`` (the 16-bit reference) and, for the lse, ``lse64`` (see the module docstring)."""
    problems = []
    dt = DTYPES[case.dtype]
    for name, x in got.items():
        if x is None:
            problems.append(f"{name}: not computed")
            continue
        if name == "LSE":
            continue
        if not torch.isfinite(x).all():
            problems.append(f"{name}: {int((~torch.isfinite(x)).sum())} of {x.numel()} elements not finite")
        err, bar = rel(x, exact[name]), FACTOR * rel(low[name], exact[name]) + REL_FLOOR
        if not err <= bar:
            problems.append(f"{name}: rel L2 {err:.3g} > {bar:.3g}")
        if name == "O":
            rounding = (exact[name].to(dt).double() - exact[name]).abs().max().item() if x.numel() else 0.0
            worst, abs_bar = max_abs(x, exact[name]), FACTOR * max_abs(low[name], exact[name]) + 2 * rounding
            if not worst <= abs_bar:
                problems.append(f"O: max abs error {worst:.3g} > {abs_bar:.3g}")
    if "LSE" in got:
        lse = got["LSE"]
        exact32 = exact["LSE"]
        magnitude = max(
            1.0, lse64[torch.isfinite(lse64)].abs().max().item() if torch.isfinite(lse64).any() else 1.0
        )
        bar = (LSE_FACTOR * max_abs(exact32, lse64) + LSE_ULPS * FLOAT32_ULP * magnitude + EXP2_POLY_ERROR
               + TANH_APPROX_ERROR * case.softcap)  # fmt: skip
        worst = max_abs(lse, lse64)  # a NaN, or a -inf where a finite value belongs (or back), is inf
        if not worst <= bar:
            problems.append(
                f"LSE: max abs error {worst:.3g} > {bar:.3g} (float32 reference {max_abs(exact32, lse64):.3g})"
            )
    return problems


# ---------------------------------------------------------------------------------------------
# what cutefa has, probed once; the kernels compiled ahead in several processes


def probe(option: str) -> tuple[str, str]:
    """("fwd+bwd" | "fwd" | "off", why) for one option, from a tiny call (bf16, head dim 64) and
    its backward: NotImplementedError leaves it out (or its backward); anything else propagates."""
    import cutefa

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for n, h in ((8, 2), (12, 1), (12, 1)))  # fmt: skip
    if option == "varlen" and not hasattr(cutefa, "flash_attn_varlen_func"):
        return "off", "cutefa has no flash_attn_varlen_func"
    try:
        if option == "varlen":
            cu_q = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0, 12], dtype=torch.int32, device="cuda")
            out = cutefa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 12)
        else:
            extra = {"window": {"window_size": (4, 2)}, "softcap": {"softcap": 20.0},
                     "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25], device="cuda")},
                     "sinks": {"sinks": torch.zeros(2, device="cuda")}}[option]  # fmt: skip
            out = cutefa.flash_attn_func(q[None], k[None], v[None], **extra)
    except NotImplementedError as exc:
        return "off", f"NotImplementedError: {exc}"
    try:
        out.float().sum().backward()
    except NotImplementedError as exc:
        return "fwd", f"backward: NotImplementedError: {exc}"
    return "fwd+bwd", ""


_AVAILABLE: dict[str, str] = {}


def _subprocess(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                                   os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    return subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)  # fmt: skip


def available() -> dict[str, str]:
    """option -> "fwd+bwd" | "fwd" | "off", probed once (in JOBS processes at once when JOBS > 1,
    which then also compile every case's kernels ahead); what is left out is printed and warned once."""
    if _AVAILABLE:
        return _AVAILABLE
    found: dict[str, tuple[str, str]] = {}
    if JOBS > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(JOBS, len(OPTIONS))) as pool:
            for option, proc in zip(OPTIONS, pool.map(lambda o: _subprocess(["--probe", o], 3600), OPTIONS)):
                try:
                    found[option] = tuple(json.loads(proc.stdout.strip().splitlines()[-1]))
                except (IndexError, ValueError):  # crashed: probe here, where it raises visibly
                    found[option] = probe(option)
    else:
        found = {o: probe(o) for o in OPTIONS}
    _AVAILABLE.update({o: status for o, (status, _) in found.items()})
    for option, (status, why) in found.items():
        if status != "fwd+bwd":
            line = f"fuzz: {option} {'left out' if status == 'off' else 'fuzzed forward only'} ({why})"
            print(line)
            warnings.warn(line, stacklevel=1)
    if JOBS > 1 and COUNT > 1:
        blob = json.dumps(_AVAILABLE)
        from concurrent.futures import ThreadPoolExecutor

        jobs = min(JOBS, COUNT)
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda i: _subprocess(["--warm", str(i), str(jobs), blob], 7200), range(jobs)))
    return _AVAILABLE


def _warm(start: int, step: int, blob: str) -> None:
    """Run cases start, start + step, ... once, unchecked (compiles their kernels into the cache)."""
    avail = json.loads(blob)
    for index in range(start, COUNT, step):
        case = restrict(draw(BASE_SEED + index), avail)
        with contextlib.suppress(Exception):  # the test itself reports it
            call(case, inputs(case), contextlib.nullcontext)
            torch.cuda.synchronize()


@pytest.mark.parametrize("index", [pytest.param(i, marks=GPU) for i in range(COUNT)])
def test_fuzz(index):
    case = restrict(draw(BASE_SEED + index), available())
    t = inputs(case)
    poisoned = _load("test_fwd_sm80").nan_filled_allocations
    try:
        got = call(case, t, poisoned)
    except NotImplementedError as exc:
        pytest.fail(f"{case.describe()}\nNotImplementedError though the probe found its options: {exc}")
    torch.cuda.synchronize()
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    try:  # each 16-bit product rounded once; float32 exact (conftest keeps TF32 off)
        exact = reference(case, t, torch.float32, case.backward)
        low = reference(case, t, DTYPES[case.dtype], case.backward)
        lse64 = reference(case, t, torch.float64, False)["LSE"]
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved
    problems = check(case, got, exact, low, lse64)
    assert not problems, case.describe() + "\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# the fuzz's own parts on the CPU


def test_cases_keep_their_bounds():
    ratios = set()
    for i in range(300):
        case = draw(BASE_SEED + i)
        assert case == draw(BASE_SEED + i)  # a seed is its case
        assert all(1 <= x <= 2100 for x in case.seqlens_q + case.seqlens_k)
        assert case.varlen or (len(set(case.seqlens_q)) == 1 and case.seqlens_q[0] != case.seqlens_k[0])
        assert case.heads_q % case.heads_kv == 0 and case.head_dim in HEAD_DIMS
        assert case.window not in ((-1, -1), (-1, 0))
        used = zip(case.used_q or case.seqlens_q, case.used_k or case.seqlens_k)
        assert case.heads_q * sum(a * b for a, b in used) <= MAX_SCORES
        ratios.add(
            "mqa" if case.heads_kv == 1 and case.heads_q in (3, 6, 12) else case.heads_q // case.heads_kv
        )
        dense = restrict(case, {"varlen": "off", "window": "fwd", "softcap": "off"})
        assert not dense.varlen and not dense.softcap and not dense.alibi and not dense.sinks
        assert dense.seqlens_q[0] != dense.seqlens_k[0]
        assert not (dense.window and dense.backward)
    assert {1, 2, 4, 8, "mqa"} <= ratios


def test_reference_is_plain_attention_with_its_gradients():
    """The fuzz's reference (float32) against autograd of plain attention (GQA, bottom-right causal
    with rows that attend no key), and with features: rows of no sequence and rows with no key
    (sinks: lse = sink), and the sinks' gradient against finite differences."""
    from cpu_support import reference as plain

    case = Case(5, "bf16", 16, (9, 9), (6, 6), 4, 2, causal=True, return_lse=True, backward=True)
    t = inputs(case, "cpu")
    ref = reference(case, t, torch.float32, True)
    q, k, v = (t[n].view(2, -1, *t[n].shape[1:]).float().requires_grad_() for n in ("q", "k", "v"))
    o, lse = plain(q, k, v, True, 0.25)
    (o * t["dout"].view(o.shape).float()).sum().backward()
    torch.testing.assert_close(ref["O"].view(o.shape).float(), o.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ref["LSE"].float(), lse.detach().transpose(0, 1).reshape(4, 18))
    for name, leaf in (("dQ", q), ("dK", k), ("dV", v)):
        torch.testing.assert_close(ref[name].view(leaf.shape).float(), leaf.grad, atol=1e-5, rtol=1e-4)
    low = reference(case, t, torch.bfloat16, True)
    got = {n: ref[n].float() for n in ("O", "LSE", "dQ", "dK", "dV")}
    assert check(case, got, ref, low, reference(case, t, torch.float64, False)["LSE"]) == []
    got["dK"] = got["dK"] * 1.1
    assert [p.split(":")[0] for p in check(case, got, ref, low, ref["LSE"])] == ["dK"]

    feat = Case(7, "fp16", 16, (5, 20), (7, 3), 2, 1, causal=True, return_lse=True, backward=True, varlen=True,
                used_q=(4, 18), used_k=(7, 2), extra_rows=3, window=(3, 0), softcap=5.0, alibi="batch",
                sinks=True)  # fmt: skip
    t = inputs(feat, "cpu")
    r = reference(feat, t, torch.float64, True)
    for row in (4, 25, 26, 27):  # past seqused_q, past the last sequence
        assert torch.isneginf(r["LSE"][:, row]).all() and not r["O"][row].any() and not r["dQ"][row].any()
    assert torch.allclose(r["LSE"][:, 5], t["sinks"].double())  # 2 keys under 18 causal rows: no key
    assert not r["O"][5].any()

    def loss(sinks):
        out = reference(feat, t | {"sinks": sinks}, torch.float64, False)["O"]
        return (out * t["dout"].double()).sum().item()

    eye = torch.eye(2, dtype=torch.float64)
    fd = [(loss(t["sinks"].double() + 1e-6 * eye[h]) - loss(t["sinks"].double() - 1e-6 * eye[h])) / 2e-6
          for h in range(2)]  # fmt: skip
    torch.testing.assert_close(r["dsinks"], torch.tensor(fd, dtype=torch.float64), atol=1e-6, rtol=1e-5)


if __name__ == "__main__":  # the probe and warm-up processes of :func:`available`
    if sys.argv[1] == "--probe":
        print(json.dumps(probe(sys.argv[2])))
    elif sys.argv[1] == "--warm":
        _warm(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
