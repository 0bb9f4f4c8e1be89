"""Packed-sequence benchmark: cutefa.flash_attn_varlen_func beside FA4's varlen call, cuDNN and FA2,
forward and backward, TFLOP/s of the unmasked work.

Cells (issue 35's grid), each in bf16 and fp16, head dims 64/128/256 (2048 / head_dim heads), causal
and not, forward and backward:

- (a) ``longtail``: 16384 tokens of documents whose lengths are drawn from a long-tailed
  distribution (log-normal, many short and a few long, 1..8192 tokens; fixed seed);
- (b) ``8x2k``: 8 sequences of 2048, beside cutefa's own dense call on the same tokens viewed as
  (8, 2048, heads, head_dim) (``cutefa-dense``): the varlen overhead;
- (c) ``64x100-300``: 64 sequences of 100 to 300 tokens (fixed seed).

Sides: ``cutefa`` (``flash_attn_varlen_func``); ``cutefa:TAIL`` for each ``--variants`` entry
(forward only: the variant named ``cutefa_sm90_fwd_<dtype>_hd<hdim>_TAIL`` with ``causal_`` before
``varlen`` in causal cells, run directly with the varlen calling convention; e.g.
``128x128_s2_w12_varlen_ov_pp_lpt``); ``FA4`` (``flash_attn.cute.flash_attn_varlen_func``,
its packed lse (heads, total)); ``FA2``: PyTorch's FlashAttention-2 on the packed sequences
(``torch.ops.aten._flash_attention_forward`` with ``cum_seq_q``/``cum_seq_k``, what SDPA runs for
nested tensors, differentiable): SDPA's flash backend on the padded equivalent cannot mask the
padding keys (it takes no mask), so it would compute another problem; ``cuDNN``: SDPA on jagged
nested tensors (``torch.nested.nested_tensor_from_jagged``) under the cuDNN backend, output only
(it returns no lse). A side that cannot run a cell is "n/a (why)".

Every side's outputs are checked before they are timed (tools/bench_check.py's way: outputs
NaN-poisoned, O and lse forward, dQ, dK and dV backward, against a float32 reference computed
sequence by sequence on a sample of (sequence, head) slices, the bar from the 16-bit reference's own
error); a wrong side is FAIL and gets no speed. Timing: tools/bench_run.py (every side in turns,
``--rounds`` rounds, the median). TFLOP/s counts 4 * heads * head_dim * (attended pairs) per
sequence, 2.5x backward; causal counts the pairs below the bottom-right diagonal only.

    python tools/bench_varlen.py --out DIR --precompile        # the grid, ~6 minutes on an H100/H200
    python tools/bench_varlen.py --quick --out DIR --precompile  # bf16 hd128, (a) and (b)
    python tools/bench_varlen.py --quick --pass fwd --precompile --out DIR \
        --variants 128x128_s2_w12_varlen_ov_pp_lpt,128x128_s2_w12_varlen_ov_pp_hfirst  # beside today's

Writes DIR/bench_varlen.md, .json and .png (with matplotlib).
"""

import argparse
import contextlib
import math
import os
import random
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

import bench_check
from bench_sides import Line, NotApplicable, Side, notes, plot, precompile, ratio, run_line, table, write_json

TOKENS = 16384
MODEL_DIM = 2048
MAX_DOC = 8192
GROUPS = ("longtail", "8x2k", "64x100-300")
DTYPES = ("bf16", "fp16")
HDIMS = (64, 128, 256)
QUICK = {"groups": ("longtail", "8x2k"), "dtypes": ("bf16",), "hdims": (128,)}
SIDES = ("cutefa", "cutefa-dense", "FA4", "FA2", "cuDNN")
FAMILY_PREFIX = "cutefa_sm90_fwd_{dtype}_hd{hdim}_"  # + a --variants tail
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


def lengths_of(group: str, seed: int = 0) -> list[int]:
    """The sequence lengths of a cell group (module docstring), the same for the same seed."""
    rng = random.Random(seed)
    if group == "8x2k":
        return [2048] * 8
    if group == "64x100-300":
        return [rng.randint(100, 300) for _ in range(64)]
    if group != "longtail":
        raise ValueError(f"unknown group {group!r}; known: {GROUPS}")
    lengths, total = [], 0
    while total < TOKENS:
        n = max(1, min(MAX_DOC, int(rng.lognormvariate(5.0, 1.5))))
        n = min(n, TOKENS - total)
        lengths.append(n)
        total += n
    return lengths


def attended_pairs(lq: int, lk: int, causal: bool) -> int:
    """(query, key) pairs attended in one sequence; causal bottom-right: row i sees keys <= i + lk - lq."""
    if not causal:
        return lq * lk
    return sum(max(0, min(lk, i + lk - lq + 1)) for i in range(lq))


def flops(lengths: list[int], heads: int, hdim: int, causal: bool, pass_: str) -> float:
    f = 4.0 * heads * hdim * sum(attended_pairs(n, n, causal) for n in lengths)
    return f * 2.5 if pass_ == "bwd" else f


@dataclass(frozen=True)
class Problem:
    """One cell: packed sequences of ``lengths`` (queries = keys), ``heads`` query and key/value heads."""

    group: str
    dtype: str
    hdim: int
    causal: bool
    pass_: str
    lengths: tuple
    heads_: int | None = None  # None: MODEL_DIM // hdim

    @property
    def heads(self) -> int:
        return self.heads_ if self.heads_ is not None else max(1, MODEL_DIM // self.hdim)

    @property
    def label(self) -> str:
        return f"{self.pass_} {self.group} {self.dtype} hd{self.hdim} causal={int(self.causal)}"

    @property
    def flops(self) -> float:
        return flops(list(self.lengths), self.heads, self.hdim, self.causal, self.pass_)


def problems(groups, dtypes, hdims, causals, passes) -> list[Problem]:
    return [
        Problem(g, dt, hd, c, p, tuple(lengths_of(g)))
        for p in passes for g in groups for dt in dtypes for hd in hdims for c in causals
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# sides: make(problem) -> fwd(q, k, v) -> (out (total, h, d), lse (h, total) or None)


def _cu(problem: Problem, device="cuda"):
    import torch

    cu = [0]
    for n in problem.lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _cutefa() -> Side:
    try:
        import cutefa
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Side("cutefa", None, f"cutefa not importable: {exc}")

    def make(p: Problem):
        cu, m = _cu(p), max(p.lengths)
        return lambda q, k, v: cutefa.flash_attn_varlen_func(
            q, k, v, cu, cu, m, m, causal=p.causal, return_lse=True
        )

    return Side("cutefa", make)


def _cutefa_dense() -> Side:
    try:
        import cutefa
    except Exception as exc:  # noqa: BLE001
        return Side("cutefa-dense", None, f"cutefa not importable: {exc}")

    def make(p: Problem):
        if len(set(p.lengths)) != 1:
            raise NotApplicable("unequal lengths")
        b, n = len(p.lengths), p.lengths[0]

        def fwd(q, k, v):
            dense = [x.view(b, n, *x.shape[1:]) for x in (q, k, v)]
            out, lse = cutefa.flash_attn_func(*dense, causal=p.causal, return_lse=True)
            return out.view(q.shape[0], *out.shape[2:]), lse.permute(1, 0, 2).reshape(lse.shape[1], -1)

        return fwd

    return Side("cutefa-dense", make)


def variant_name(tail: str, p: Problem) -> str:
    """The full name of a ``--variants`` tail in cell ``p``: its dtype and head dim in front,
    ``causal_`` before ``varlen`` when the cell is causal."""
    if "varlen" not in tail.split("_"):
        raise ValueError(f"--variants entry {tail!r} names no varlen variant (its tokens lack 'varlen')")
    tokens = [t for t in tail.split("_") if t != "causal"]
    if p.causal:
        tokens.insert(tokens.index("varlen"), "causal")
    return FAMILY_PREFIX.format(dtype=p.dtype, hdim=p.hdim) + "_".join(tokens)


def _direct(name: str, spec_of) -> Side:
    """A side running one variant (``spec_of(problem)``) directly with the varlen calling
    convention (cutefa/api/features.py), the outputs prepared as the varlen call prepares them."""
    try:
        from cutefa import dispatch
        from cutefa.api.check_lengths import assert_lengths_async
        from cutefa.api.feature_ops import empty_outputs
        from cutefa.api.launch import aligned, call_on
        from cutefa.loader import get_kernel
        from cutefa.model.rules import why_invalid, why_not_on
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Side(name, None, f"cutefa not importable: {exc}")

    def make(p: Problem):
        if p.pass_ != "fwd":
            raise NotApplicable("forward only")
        spec = spec_of(p)
        target = dispatch.current_target()
        why = why_invalid(spec) or why_not_on(spec, target)
        if why:
            raise NotApplicable(why)
        kernel = get_kernel(spec, target)
        cu, m = _cu(p), max(p.lengths)
        scale = 1.0 / math.sqrt(p.hdim)

        def fwd(q, k, v):
            # the varlen call's own work around the kernel, so that the sides differ by the kernel only
            assert_lengths_async(cu, None, q.shape[0], m, "q")
            assert_lengths_async(cu, None, k.shape[0], m, "k")
            used = cu[1:] - cu[:-1]  # seqused from the spans, as the call makes it
            out, lse = empty_outputs(q, True)  # rows of no sequence: the kernel's module fills them
            call_on(q.device, kernel, aligned(q), aligned(k), aligned(v), out, lse, scale, cu, cu, used, used, m)
            return out, lse

        return fwd

    return Side(name, make)


def variant_sides(tails) -> list[Side]:
    """A ``cutefa:TAIL`` side per ``--variants`` entry."""
    from cutefa.model.spec import parse_name

    return [_direct(f"cutefa:{t}", lambda p, t=t: parse_name(variant_name(t, p))) for t in tails]


def packed_lse(lse, heads: int, total: int):
    """A side's packed lse as (heads, total): a (total, heads) one transposed, unit dims dropped;
    None for a shape it is not."""
    if lse is None:
        return None
    x = lse.squeeze()
    if tuple(x.shape) == (heads, total):
        return x
    if tuple(x.shape) == (total, heads):
        return x.transpose(0, 1)
    return None


def _fa4() -> Side:
    try:
        import inspect

        from flash_attn.cute import flash_attn_varlen_func as fa4
    except Exception as exc:  # noqa: BLE001 - absent or broken
        return Side("FA4", None, f"flash_attn.cute not importable: {type(exc).__name__}")
    try:
        takes_lse = "return_lse" in inspect.signature(fa4).parameters
    except (TypeError, ValueError):
        takes_lse = False
    extra = {"return_lse": True} if takes_lse else {}

    def make(p: Problem):
        cu, m = _cu(p), max(p.lengths)

        def fwd(q, k, v):
            # by name: FA4's varlen call takes qv before cu_seqlens_q
            res = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=p.causal, **extra)
            out, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
            return out, packed_lse(lse, q.shape[1], q.shape[0])

        return fwd

    return Side("FA4", make)


def _fa2() -> Side:
    import torch

    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return Side("FA2", None, "torch has no _flash_attention_forward")

    def make(p: Problem):
        cu, m = _cu(p), max(p.lengths)

        def fwd(q, k, v):
            res = op(q, k, v, cu, cu, m, m, 0.0, p.causal, False, scale=1.0 / math.sqrt(q.shape[-1]))
            return res[0], packed_lse(res[1], q.shape[1], q.shape[0])

        return fwd

    return Side("FA2", make)


def _cudnn() -> Side:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not hasattr(torch.nested, "nested_tensor_from_jagged"):
        return Side("cuDNN", None, "torch has no jagged nested tensors")

    def make(p: Problem):
        offsets = _cu(p).long()

        def fwd(q, k, v):
            nq, nk, nv = (
                torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (q, k, v)
            )
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(nq, nk, nv, is_causal=p.causal)
            return out.transpose(1, 2).values(), None

        return fwd

    return Side("cuDNN", make)


def load_sides(names) -> list[Side]:
    makers = {
        "cutefa": _cutefa, "cutefa-dense": _cutefa_dense, "FA4": _fa4, "FA2": _fa2,
        "cuDNN": _cudnn,
    }  # fmt: skip
    return [makers[n]() for n in names]


# ---------------------------------------------------------------------------------------------
# the run


def inputs_of(p: Problem, device="cuda"):
    """q, k, v (total, heads, hdim) and, backward, dout: unit normal in the cell's dtype, seeded per cell."""
    import torch

    dtype = getattr(torch, DTYPE_NAMES[p.dtype])
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(p.label.encode()))
    shape = (sum(p.lengths), p.heads, p.hdim)
    count = 4 if p.pass_ == "bwd" else 3
    return [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(count)]


def run_problem(p: Problem, sides, time_ms, rounds: int, slices: int, device="cuda") -> Line:
    q, k, v, *rest = inputs_of(p, device)
    expect = bench_check.packed_expectation(
        q, k, v, list(p.lengths), list(p.lengths), causal=p.causal, scale=1.0 / math.sqrt(p.hdim),
        dout=rest[0] if rest else None, slices=slices, seed=zlib.crc32(p.label.encode()),
    )  # fmt: skip
    line = Line(p.label, p.pass_, p.flops, p.group)
    return run_line(line, sides, p, [q, k, v, *rest], expect, time_ms, rounds, device)


def cutefa_specs(ps: list[Problem], tails=()) -> list:
    """The variants cutefa's calls of the grid dispatch to, and the forward variants of the
    ``--variants`` sides (for --precompile)."""
    import torch

    from cutefa import dispatch
    from cutefa.api import backward, feature_bwd
    from cutefa.api.features import FeatureArgs
    from cutefa.model.spec import Features, parse_name

    target = dispatch.current_target()
    specs = []
    for p in ps:
        dtype = getattr(torch, DTYPE_NAMES[p.dtype])
        m = max(p.lengths)
        shape = {"head_dim": p.hdim, "seqlen_q": m, "seqlen_k": m, "batch": len(p.lengths), "heads_q": p.heads,
                 "heads_kv": p.heads}  # fmt: skip
        f = FeatureArgs(cu_seqlens_q=torch.zeros(2, dtype=torch.int32), max_seqlen_q=m, max_seqlen_k=m)
        picks = [
            (dispatch.choose, {"target": target, "dtype": dtype, "causal": p.causal,
                               "features": Features(varlen=True), "total_q": sum(p.lengths), **shape}),
            (feature_bwd.choose_bwd, {"target": target, "dtype": dtype, "head_dim": p.hdim, "causal": p.causal,
                                      "f": f, "seqlen_k": m}),
        ]  # fmt: skip
        if p.group == "8x2k":
            picks.append((dispatch.choose, {"target": target, "dtype": dtype, "causal": p.causal, **shape}))
            picks.append((backward.choose_bwd, {"target": target, "dtype": dtype, "head_dim": p.hdim,
                                                "causal": p.causal, "seqlen_k": m}))  # fmt: skip
        if p.pass_ == "fwd":
            picks += [(lambda tail, p: parse_name(variant_name(tail, p)), {"tail": t, "p": p}) for t in tails]
        for pick, kwargs in picks:
            with contextlib.suppress(Exception):  # a problem with no kernel shows as err in its cell
                chosen = pick(**kwargs)
                specs.append(getattr(chosen, "spec", chosen))
    return specs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="bf16 hd128, groups (a) and (b)")
    ap.add_argument("--groups", default=None, help=f"comma-separated of {','.join(GROUPS)}")
    ap.add_argument("--dtype", default=None, help="bf16,fp16")
    ap.add_argument("--hdim", default=None, help="64,128,256")
    ap.add_argument("--causal", choices=("0", "1", "both"), default="both")
    ap.add_argument("--pass", dest="passes", default="fwd,bwd", help="fwd, bwd or fwd,bwd")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated of {','.join(SIDES)}")
    ap.add_argument(
        "--variants", default="",
        help="comma-separated variant name tails timed as sides of their own, forward only (module docs), "
        "e.g. 128x176_s2_w12_varlen_ov_pp_hfirst_pcvt",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slices", type=int, default=bench_check.SLICES, help="(sequence, head) slices checked")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--precompile", action="store_true", help="compile cutefa's variants in parallel first")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args(argv)

    def listed(text, allowed, default, convert=str):
        if text is None:
            return list(default)
        values = [convert(x.strip()) for x in text.split(",") if x.strip()]
        if not values or any(v not in allowed for v in values):
            ap.error(f"expected a comma-separated list of {list(allowed)}, got {text!r}")
        return values

    args.groups = listed(args.groups, GROUPS, QUICK["groups"] if args.quick else GROUPS)
    args.dtype = listed(args.dtype, DTYPES, QUICK["dtypes"] if args.quick else DTYPES)
    args.hdim = listed(args.hdim, HDIMS, QUICK["hdims"] if args.quick else HDIMS, int)
    args.passes = listed(args.passes, ("fwd", "bwd"), ("fwd", "bwd"))
    args.sides = listed(args.sides, SIDES, SIDES)
    args.causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    args.variants = [t.strip() for t in args.variants.split(",") if t.strip()]
    for tail in args.variants:
        if "varlen" not in tail.split("_") or tail.startswith("cutefa_"):
            ap.error(f"--variants takes name tails with 'varlen' (e.g. 128x128_s2_w12_varlen_ov_pp_hfirst), got {tail!r}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def report(lines: list[Line], names: list[str], meta: dict) -> str:
    extra = {"cutefa / cutefa-dense": lambda ln: ratio(ln.tflops("cutefa"), ln.tflops("cutefa-dense"))}
    for n in names:
        if n.startswith("cutefa:"):
            extra[f"{n} / cutefa"] = lambda ln, n=n: ratio(ln.tflops(n), ln.tflops("cutefa"))
    head = (
        f"# Packed sequences, {meta.get('gpu', '')}\n\ntorch {meta.get('torch')}, timer {meta.get('timer')}, "
        f"{meta.get('rounds')} rounds in turns. TFLOP/s of the unmasked work; FAIL: an output off the "
        "float32 reference (no speed); n/a: the side cannot run the cell.\n\n"
    )
    body = table(lines, names, extra)
    found = notes(lines)
    return head + body + (f"\n\nFailures and errors:\n{found}" if found else "") + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench_backends import environment, make_timer

    ps = problems(args.groups, args.dtype, args.hdim, args.causals, args.passes)
    if args.precompile:
        for failure in precompile(cutefa_specs(ps, args.variants), args.jobs):
            print(f"compile failed: {failure}", file=sys.stderr)
    timer, time_ms = make_timer(10, 40)
    sides = load_sides(args.sides) + variant_sides(args.variants)
    names = args.sides + [s.name for s in sides[len(args.sides) :]]
    lines = []
    for p in ps:
        line = run_problem(p, sides, time_ms, args.rounds, args.slices)
        lines.append(line)
        print(p.label, {n: r.status if r.tflops is None else f"{r.tflops:.0f}" for n, r in line.results.items()},
              flush=True)  # fmt: skip
    meta = environment() | {"timer": timer, "rounds": args.rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(lines, names, meta)
    (args.out / "bench_varlen.md").write_text(text)
    write_json(args.out / "bench_varlen.json", meta, lines)
    drew = plot(lines, names, args.out / "bench_varlen.png", "packed sequences")
    print(text)
    print(f"wrote {args.out / 'bench_varlen.md'}" + ("" if drew else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
