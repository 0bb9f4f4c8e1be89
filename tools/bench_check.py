"""What the benchmarks check before they time anything (tools/bench*.py): every output a timed call
gives (O and LSE forward; dQ, dK and dV backward) against a float32 reference, on a sample of each
cell, with the outputs poisoned (NaN) first.

The sample: a few (batch, head) slices of the cell (:func:`sample_slices`: the first, the last, and
seeded random ones); forward slices are query heads, backward slices are key/value heads with all
the query heads that share them (dK and dV sum over those). v may have a head dim d_v of its own
(q and k of d_qk): O, dout and dV then have d_v columns, dQ and dK d_qk. The reference of a slice is computed
here in row blocks (:func:`attend`), twice: in float32 (the truth) and in the inputs' own precision
(every matmul's result rounded to the 16-bit dtype, P and dS rounded to it before their matmuls,
the softmax statistics kept in float32 as every flash kernel keeps them; for fp8 inputs: the
dequantized inputs, P times 2^8 rounded to e4m3 for P V and its row sums, :func:`round_e4m3`).

The bar of an output is set from the error of that low-precision reference against the float32
one (:func:`bar_for`)::

    relative L2 bar = FACTOR * rel_l2(low precision, float32) + eps / 2
    max-abs bar     = FACTOR * max_abs(low precision, float32) + eps * max |float32|

with ``eps`` the machine epsilon of the output's dtype (16-bit outputs; float32 for the LSE) and
FACTOR = 3. An output passes when every element of the whole tensor is finite (an LSE may be
``-inf`` only where the reference's is) and its sampled slices are within both bars; NaN never
passes. The relative L2 error's denominator is at least 1e-6 per element, so an all-zero
reference slice does not divide by zero.
"""

# No `from __future__ import annotations`: tools load this file by path, not always registering it
# in sys.modules, and dataclasses cannot resolve string annotations then.
import contextlib
import math
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

FACTOR = 3
SLICES = 3
# Scores per row block of the reference: 2**24 float32 scores (64 MiB, a few times that in temporaries).
BLOCK_ELEMENTS = 1 << 24
NORM_FLOOR = 1e-6  # per element, in the relative L2 error's denominator
E4M3_SCALE = 256.0  # P (at most 1 against the row max) times this before rounding to e4m3
# The relative precision of an e4m3 kernel's scores: Hopper's fp8 tensor cores add their products
# in fewer bits than float32 (about 14 significant bits kept), which no rounding of the reference
# reproduces. Where P's rounding is small (one key) the LSE bar would otherwise stand at float32's
# epsilon. 2**-10 leaves room for the sum over a row's k-blocks; a wrong tile errs by O(1).
E4M3_SCORE_EPS = 2.0**-10


def sample_slices(batch: int, heads: int, count: int = SLICES, seed: int = 0) -> list[tuple[int, int]]:
    """Up to ``count`` distinct (batch, head) pairs: (0, 0), the last one, then seeded random ones
    (all of them when there are no more than ``count``)."""
    every = [(b, h) for b in range(batch) for h in range(heads)]
    if count <= 0 or not every:
        return []
    if len(every) <= count:
        return every
    chosen = [every[0], every[-1]][:count]
    rest = [p for p in every if p not in chosen]
    chosen += random.Random(seed).sample(rest, count - len(chosen))
    return chosen


@contextlib.contextmanager
def exact_matmuls() -> Iterator[None]:
    """float32 matmuls in float32 (no TF32) and 16-bit matmuls without reduced-precision reductions,
    within the block: a float32 reference that is one, and a low-precision one that rounds each
    result once."""
    import torch

    cuda = torch.backends.cuda.matmul
    saved = (
        cuda.allow_tf32, torch.backends.cudnn.allow_tf32,
        cuda.allow_bf16_reduced_precision_reduction, cuda.allow_fp16_reduced_precision_reduction,
    )  # fmt: skip
    cuda.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cuda.allow_bf16_reduced_precision_reduction = cuda.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        (
            cuda.allow_tf32, torch.backends.cudnn.allow_tf32,
            cuda.allow_bf16_reduced_precision_reduction, cuda.allow_fp16_reduced_precision_reduction,
        ) = saved  # fmt: skip


@contextlib.contextmanager
def poisoned_allocations(device) -> Iterator[None]:
    """Every tensor torch allocates uninitialized within the block (``torch.empty`` and the
    allocations inside torch's own ops: a call's outputs) comes filled with NaN (integers with their
    largest value), so an element a kernel never writes reads NaN and fails the check. torch's
    deterministic mode with ``fill_uninitialized_memory``, warnings only (no op changes its
    algorithm), around the checked call alone."""
    import torch

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
            probe = torch.empty(8, device=device)
            if not torch.isnan(probe).all():
                raise RuntimeError("uninitialized allocations are not NaN-filled: outputs cannot be poisoned")
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def round_e4m3(p):
    """P (float32, at most 1) rounded as an e4m3 kernel feeds it to P V: times 2^8, to e4m3 and back."""
    import torch

    return (p * E4M3_SCALE).to(torch.float8_e4m3fn).float() / E4M3_SCALE


def attend(q, k, v, *, causal: bool, scale: float, dtype=None, p_round: Callable | None = None, dout=None,
           window: tuple[int, int] | None = None, softcap: float = 0.0, slopes=None, sinks=None):  # fmt: skip
    """Attention of a group of query heads sharing one key/value head, in row blocks.

    q (g, sq, d), k (sk, d), v (sk, dv) and dout (g, sq, dv) or None, any float dtype; causal masking
    bottom-right (row i attends key j iff j <= i + sk - sq). The features (tools/bench_features.py):
    ``window`` (left, right), -1 unbounded: row i attends key j iff i + sk - sq - left <= j <= i + sk
    - sq + right (with ``causal`` too, right is at most 0); ``softcap`` c > 0: a score is c *
    tanh(scale * q.k / c); ``slopes`` (g,) ALiBi: - slope * |i + sk - sq - j| added after the cap;
    ``sinks`` (g,): one more logit per head in each row's denominator (a row with no key: O 0, LSE
    the sink). ``dtype`` None: float32 throughout;
    a 16-bit dtype: the inputs in it, every matmul's result rounded to it, P and dS rounded to it
    before their matmuls, the statistics (row max, row sum, lse) in float32. ``p_round``: how P
    (against the row max) is rounded for P V and its row sums (default: to ``dtype``, or not at
    all in float32). Returns float32 ``{"O": (g, sq, dv), "LSE": (g, sq)}`` and with dout also
    ``{"dQ": (g, sq, d), "dK": (sk, d), "dV": (sk, dv)}``. A row that attends no key: O 0, LSE
    -inf, no gradient.
    """
    import torch

    cdt = torch.float32 if dtype is None else dtype
    if p_round is None:
        p_round = (lambda p: p) if cdt == torch.float32 else (lambda p: p.to(cdt).float())
    g, sq, _ = q.shape
    sk = k.shape[0]
    device = q.device
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    out = torch.zeros(g, sq, v.shape[-1], device=device)
    lse = torch.full((g, sq), -math.inf, device=device)
    result = {"O": out, "LSE": lse}
    if sq == 0 or sk == 0:
        if dout is not None:
            result |= {"dQ": torch.zeros(q.shape, device=device), "dK": torch.zeros(k.shape, device=device),
                       "dV": torch.zeros(v.shape, device=device)}  # fmt: skip
        return result
    step = max(1, BLOCK_ELEMENTS // sk)
    cols = torch.arange(sk, device=device)
    left, right = window_bounds(causal, window)

    def scores(h: int, r0: int, r1: int):
        """(scores, d score / d raw score or None) of rows r0:r1 of head h."""
        s = (qc[h, r0:r1] @ kc.T).float() * scale
        slope = None
        if softcap:
            t = torch.tanh(s / softcap)
            s, slope = softcap * t, 1.0 - t * t
        diag = torch.arange(r0, r1, device=device)[:, None] + (sk - sq)  # key j == row i's diagonal
        if slopes is not None:
            s = s - float(slopes[h]) * (diag - cols[None, :]).abs().float()
        if left is not None:
            s = s.masked_fill(cols[None, :] < diag - left, -math.inf)
        if right is not None:
            s = s.masked_fill(cols[None, :] > diag + right, -math.inf)
        return s, slope

    for h in range(g):
        sink = None if sinks is None else torch.tensor(float(sinks[h]), device=device)
        for r0 in range(0, sq, step):
            r1 = min(sq, r0 + step)
            s, _ = scores(h, r0, r1)
            m = s.amax(dim=-1)
            if sink is not None:
                m = torch.maximum(m, sink)
            live = torch.isfinite(m)
            m = torch.where(live, m, torch.zeros_like(m))
            p = p_round(torch.exp(s - m[:, None]))
            total = p.sum(dim=-1)
            if sink is not None:
                total = total + torch.exp(sink - m)
            o = (p.to(cdt) @ vc).float() if cdt != torch.float32 else p @ vc
            out[h, r0:r1] = torch.where(
                live[:, None], o / total.clamp_min(1e-30)[:, None], torch.zeros_like(o)
            )
            lse[h, r0:r1] = torch.where(live, m + torch.log(total), torch.full_like(m, -math.inf))
    if dout is None:
        return result

    doc = dout.to(cdt)
    dq = torch.zeros(q.shape, device=device)
    dk = torch.zeros(k.shape, device=device)
    dv = torch.zeros(v.shape, device=device)
    for h in range(g):
        for r0 in range(0, sq, step):
            r1 = min(sq, r0 + step)
            s, capped = scores(h, r0, r1)
            row_lse = lse[h, r0:r1]
            p = torch.exp(
                s - torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))[:, None]
            )
            p = torch.where(torch.isfinite(row_lse)[:, None], p, torch.zeros_like(p))
            do_b = doc[h, r0:r1]
            o_b = out[h, r0:r1].to(cdt).float()
            delta = (do_b.float() * o_b).sum(dim=-1)
            dp = (do_b @ vc.T).float()
            ds = p * (dp - delta[:, None])
            if capped is not None:
                ds = ds * capped
            dq[h, r0:r1] = (ds.to(cdt) @ kc).float() * scale
            dk += (ds.to(cdt).T @ qc[h, r0:r1]).float() * scale
            dv += (p.to(cdt).T @ do_b).float()
    return result | {"dQ": dq, "dK": dk, "dV": dv}


def window_bounds(causal: bool, window: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """(left, right) distances from the diagonal, None for an unbounded side: causal caps right at 0."""
    left, right = window if window is not None else (-1, -1)
    left = None if left is None or left < 0 else left
    right = None if right is None or right < 0 else right
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def rows_without_keys(sq: int, sk: int, causal: bool, window: tuple[int, int] | None = None) -> bool:
    """Whether some row of a (sq, sk) problem attends no key (its LSE is -inf without sinks)."""
    if sq == 0:
        return False
    if sk == 0:
        return True
    left, right = window_bounds(causal, window)
    for i in (0, sq - 1):  # the band's ends: the first and last rows are the extreme ones
        lo = 0 if left is None else max(0, i + sk - sq - left)
        hi = sk - 1 if right is None else min(sk - 1, i + sk - sq + right)
        if lo > hi:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# errors and bars


def _diff(x, ref):
    """|x - ref| in float64 where equal infinities (an LSE's -inf) count as 0 and NaN as inf."""
    import torch

    x, ref = x.double(), ref.double()
    same = x == ref  # NaN is never equal
    d = (x - ref).abs()
    d = torch.where(same, torch.zeros_like(d), d)
    return torch.nan_to_num(d, nan=math.inf, posinf=math.inf)


def rel_l2(x, ref) -> float:
    """||x - ref|| / max(||ref||, NORM_FLOOR * sqrt(n)) over the finite entries of ref (an infinite
    difference, NaN included, gives inf)."""
    import torch

    if x.shape != ref.shape:
        return math.inf
    if ref.numel() == 0:
        return 0.0
    d = _diff(x, ref)
    if torch.isinf(d).any():
        return math.inf
    finite = torch.isfinite(ref.double())
    norm = torch.linalg.vector_norm(torch.where(finite, ref.double(), torch.zeros_like(d))).item()
    return torch.linalg.vector_norm(d).item() / max(norm, NORM_FLOOR * math.sqrt(ref.numel()))


def max_abs(x, ref) -> float:
    """Largest |x - ref| (inf for NaN or a mismatched infinity)."""
    if x.shape != ref.shape:
        return math.inf
    return 0.0 if ref.numel() == 0 else _diff(x, ref).max().item()


@dataclass(frozen=True)
class Bar:
    rel: float
    abs: float


def bar_for(low, ref, out_dtype) -> Bar:
    """The bar of an output whose low-precision reference is ``low`` and float32 reference ``ref``
    (see the module docstring); ``out_dtype``: the dtype the output is stored in."""
    import torch

    eps = torch.finfo(out_dtype).eps
    finite = ref[torch.isfinite(ref)]
    magnitude = finite.abs().max().item() if finite.numel() else 0.0
    return Bar(FACTOR * rel_l2(low, ref) + eps / 2, FACTOR * max_abs(low, ref) + eps * magnitude)


@dataclass
class Verdict:
    """An output set judged: ok, and per output its errors and bars (rel, rel_bar, abs, abs_bar)."""

    ok: bool
    errors: dict = field(default_factory=dict)
    message: str = ""


def judge(
    got: dict, expect: dict, bars: dict, full: dict | None = None, expect_inf: dict | None = None
) -> Verdict:
    """``got`` and ``expect``: output name -> the sampled values (same shapes); ``bars``: name ->
    :class:`Bar`; ``full``: name -> the whole output tensor (each must be finite, an LSE -inf only
    where ``expect_inf[name]`` allows: a bool, whether any -inf is expected)."""
    import torch

    errors, problems = {}, []
    for name, tensor in (full or {}).items():
        if tensor is None:
            problems.append(f"{name} missing")
            continue
        allow_inf = bool((expect_inf or {}).get(name, False))
        bad = torch.isnan(tensor) | (torch.isinf(tensor) if not allow_inf else torch.isposinf(tensor))
        count = int(bad.sum().item())
        if count:
            problems.append(f"{name}: {count} of {tensor.numel()} elements not finite")
    for name, ref in expect.items():
        x = got.get(name)
        if x is None:
            problems.append(f"{name} missing")
            continue
        rel, worst, bar = rel_l2(x, ref), max_abs(x, ref), bars[name]
        errors[name] = {"rel": rel, "rel_bar": bar.rel, "abs": worst, "abs_bar": bar.abs}
        if not (rel <= bar.rel and worst <= bar.abs):  # NaN fails
            problems.append(
                f"{name} rel {rel:.3g} (bar {bar.rel:.3g}), max abs {worst:.3g} (bar {bar.abs:.3g})"
            )
    return Verdict(not problems, errors, "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# a cell's expectation: the sampled references and their bars


@dataclass
class Expectation:
    """What a backend's outputs must match on one cell: the slices, the float32 references of the
    sampled values and their bars. ``pass_`` fwd: outputs (out (b, sq, hq, dv), lse (b, hq, sq));
    bwd: (dq like q, dk like k, dv like v). Packed sequences (``spans``: per sequence (first q row,
    q rows, first k row, k rows)): out (total_q, hq, dv), lse (hq, total_q), dq like q (total_q, hq,
    d), dk like k (total_k, hkv, d) and dv like v (total_k, hkv, dv); a slice is (sequence, head) and the sampled values are
    flattened and concatenated (the sequences' lengths differ)."""

    pass_: str
    slices: list
    group: int
    expect: dict
    bars: dict
    lse_inf: bool = False
    spans: list | None = None

    def _pieces(self, outputs) -> dict:
        """Output name -> one float32 tensor per slice."""
        g = self.group
        pieces: dict = {}
        for b, h in self.slices:
            if self.spans is None:
                qrows = krows = b
                if self.pass_ == "fwd":
                    out, lse = outputs
                    pieces.setdefault("O", []).append(out[b, :, h].float())
                    if lse is not None:
                        pieces.setdefault("LSE", []).append(lse[b, h].float())
                    continue
                dq, dk, dv = outputs
                pieces.setdefault("dQ", []).append(dq[b, :, h * g : (h + 1) * g].float().transpose(0, 1))
                pieces.setdefault("dK", []).append(dk[b, :, h].float())
                pieces.setdefault("dV", []).append(dv[b, :, h].float())
                continue
            q0, lq, k0, lk = self.spans[b]
            qrows, krows = slice(q0, q0 + lq), slice(k0, k0 + lk)
            if self.pass_ == "fwd":
                out, lse = outputs
                pieces.setdefault("O", []).append(out[qrows, h].float())
                if lse is not None:
                    pieces.setdefault("LSE", []).append(lse[h, qrows].float())
                continue
            dq, dk, dv = outputs
            pieces.setdefault("dQ", []).append(dq[qrows, h * g : (h + 1) * g].float().transpose(0, 1))
            pieces.setdefault("dK", []).append(dk[krows, h].float())
            pieces.setdefault("dV", []).append(dv[krows, h].float())
        return pieces

    def sample(self, outputs) -> dict:
        """The sampled values of a backend's outputs, float32, shaped like :attr:`expect`'s."""
        return {name: combine(parts, self.spans is not None) for name, parts in self._pieces(outputs).items()}

    def judge(self, outputs) -> Verdict:
        """Judge a backend's outputs: whole tensors finite, sampled values within the bars. A
        forward without an LSE (a backend that does not return one) is judged on O alone and says so."""
        got = self.sample(outputs)
        expect = self.expect if "LSE" in got or self.pass_ != "fwd" else {"O": self.expect["O"]}
        names = ("O", "LSE") if self.pass_ == "fwd" else ("dQ", "dK", "dV")
        full = {n: t for n, t in zip(names, outputs) if not (n == "LSE" and t is None)}
        verdict = judge(got, expect, self.bars, full, {"LSE": self.lse_inf})
        if self.pass_ == "fwd" and "LSE" not in got:
            verdict.errors["LSE"] = "not returned"
        return verdict


def combine(parts: list, packed: bool):
    """The slices' values as one tensor: stacked (dense: equal shapes), or flattened and
    concatenated (packed sequences of different lengths)."""
    import torch

    if not packed:
        return torch.stack(parts)
    return torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0)


def _head_values(values, heads: slice):
    """The per-query-head values (slopes (hq,), sinks (hq,)) of the query heads ``heads``, or None."""
    return None if values is None else [float(x) for x in values[heads]]


def _references(pairs, slice_args, pass_: str, low_dtype, p_round, out_dtype, packed: bool, score_eps: float = 0.0,
                **features):  # fmt: skip
    """(expect, bars) over the slices: ``slice_args(b, h)`` -> (q, k, v, dout, heads) of one slice.
    ``score_eps``: the relative precision of the kernel's score sums (:data:`E4M3_SCORE_EPS`); the
    LSE bars grow by the score error it allows, ``score_eps * scale * max sum_i |q_i k_i|`` over the
    sampled slices (an LSE moves by at most its row's largest score error)."""
    import torch

    exact, low = {}, {}
    score_error = 0.0
    with exact_matmuls():
        for b, h in pairs:
            q, k, v, do, heads, slopes = slice_args(b, h)
            if score_eps and q.numel() and k.numel():
                sums = q.float().abs() @ k.float().abs().transpose(-1, -2)
                score_error = max(score_error, score_eps * features["scale"] * sums.max().item())
            sinks = _head_values(features.get("sinks"), heads)
            for into, dtype, rounding in ((exact, None, None), (low, low_dtype, p_round)):
                r = attend(q, k, v, dtype=dtype, p_round=rounding, dout=do, slopes=slopes, sinks=sinks,
                           causal=features["causal"], scale=features["scale"], window=features.get("window"),
                           softcap=features.get("softcap", 0.0))  # fmt: skip
                if pass_ == "fwd":
                    into.setdefault("O", []).append(r["O"][0])
                    into.setdefault("LSE", []).append(r["LSE"][0])
                else:
                    for name in ("dQ", "dK", "dV"):
                        into.setdefault(name, []).append(r[name])
    exact = {n: combine(t, packed) for n, t in exact.items()}
    low = {n: combine(t, packed) for n, t in low.items()}
    bars = {n: bar_for(low[n], exact[n], torch.float32 if n == "LSE" else out_dtype) for n in exact}
    if score_error and "LSE" in bars:
        finite = exact["LSE"][torch.isfinite(exact["LSE"])]
        rms = finite.square().mean().sqrt().item() if finite.numel() else 0.0
        bar = bars["LSE"]
        bars["LSE"] = Bar(bar.rel + score_error / max(rms, NORM_FLOOR), bar.abs + score_error)
    return exact, bars


def _slopes_of(slopes, b: int, heads: slice):
    """ALiBi slopes of batch b's query heads ``heads``: slopes (hq,) or (batch, hq), or None."""
    if slopes is None:
        return None
    row = slopes if slopes.dim() == 1 else slopes[b]
    return [float(x) for x in row[heads]]


def expectation(q, k, v, *, causal: bool, scale: float, dout=None, slices: int = SLICES, seed: int = 0,
                low_dtype=None, p_round: Callable | None = None, out_dtype=None, window=None,
                softcap: float = 0.0, slopes=None, sinks=None, score_eps: float = 0.0) -> Expectation:  # fmt: skip
    """The :class:`Expectation` of attention on q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv,
    dv) (dv may differ from d; dout (b, sq, hq, dv)): forward without ``dout``, backward with it. The low-precision reference runs in ``low_dtype`` (default
    q's dtype) with ``p_round`` (:func:`attend`); ``out_dtype`` is the dtype the outputs are stored
    in (default q's) for the bars' epsilon. ``window``, ``softcap``, ``slopes`` ((hq,) or (b, hq))
    and ``sinks`` (hq,): the features, as :func:`attend` takes them. ``score_eps``: see
    :func:`_references` (e4m3 kernels: :data:`E4M3_SCORE_EPS`)."""
    batch, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    low_dtype = q.dtype if low_dtype is None else low_dtype
    out_dtype = q.dtype if out_dtype is None else out_dtype
    pass_ = "fwd" if dout is None else "bwd"
    pairs = sample_slices(batch, hq if pass_ == "fwd" else hkv, slices, seed)

    def slice_args(b, h):
        heads = slice(h, h + 1) if pass_ == "fwd" else slice(h * group, (h + 1) * group)
        kv = h // group if pass_ == "fwd" else h
        do = None if dout is None else dout[b, :, heads].transpose(0, 1)
        return (
            q[b, :, heads].transpose(0, 1),
            k[b, :, kv],
            v[b, :, kv],
            do,
            heads,
            _slopes_of(slopes, b, heads),
        )

    exact, bars = _references(pairs, slice_args, pass_, low_dtype, p_round, out_dtype, False, score_eps, causal=causal,
                              scale=scale, window=window, softcap=softcap, sinks=sinks)  # fmt: skip
    lse_inf = pass_ == "fwd" and sinks is None and rows_without_keys(sq, sk, causal, window)
    return Expectation(pass_, pairs, group, exact, bars, lse_inf)


def packed_expectation(q, k, v, lengths_q, lengths_k, *, causal: bool, scale: float, dout=None,
                       slices: int = SLICES, seed: int = 0, window=None, softcap: float = 0.0, slopes=None,
                       sinks=None) -> Expectation:  # fmt: skip
    """The :class:`Expectation` of attention over packed sequences: q (total_q, hq, d), k, v
    (total_k, hkv, d), sequence b's rows the next ``lengths_q[b]`` of q and ``lengths_k[b]`` of k
    (host lists: the spans follow one another from row 0); each sequence its own problem, causal
    and windows bottom-right with its own lengths. Features as :func:`expectation`."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    pass_ = "fwd" if dout is None else "bwd"
    spans, q0, k0 = [], 0, 0
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        spans.append((q0, int(lq), k0, int(lk)))
        q0, k0 = q0 + int(lq), k0 + int(lk)
    pairs = sample_slices(len(spans), hq if pass_ == "fwd" else hkv, slices, seed)

    def slice_args(b, h):
        a, lq, c, lk = spans[b]
        rows, keys = slice(a, a + lq), slice(c, c + lk)
        heads = slice(h, h + 1) if pass_ == "fwd" else slice(h * group, (h + 1) * group)
        kv = h // group if pass_ == "fwd" else h
        do = None if dout is None else dout[rows, heads].transpose(0, 1)
        return (
            q[rows, heads].transpose(0, 1),
            k[keys, kv],
            v[keys, kv],
            do,
            heads,
            _slopes_of(slopes, b, heads),
        )

    exact, bars = _references(pairs, slice_args, pass_, q.dtype, None, q.dtype, True, causal=causal, scale=scale,
                              window=window, softcap=softcap, sinks=sinks)  # fmt: skip
    lse_inf = (
        pass_ == "fwd"
        and sinks is None
        and any(rows_without_keys(lq, lk, causal, window) for _, lq, _, lk in spans)
    )
    return Expectation(pass_, pairs, group, exact, bars, lse_inf, spans)
