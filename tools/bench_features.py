"""Feature benchmark: cutefa's sliding window, softcap, attention sinks and ALiBi beside FA4,
FlexAttention and cuDNN, forward and backward, and each feature's cost against cutefa's same call
without it.

Cells (issue 36's grid): bf16, head dim 128, 16 heads, causal, seqlen 8192 (batch 4) and 32768
(batch 1); features ``window1k`` and ``window4k`` (window_size=(w, 0): causal sliding window),
``softcap`` (50), ``sinks`` (one float32 logit per head), ``alibi`` (the standard slopes
2^(-8 (h + 1) / heads)); forward and backward.

Sides: ``cutefa`` (``flash_attn_func`` with the feature); ``cutefa-base``: the same call without the
feature (the dense causal call for a window), checked against its own reference; ``FA4``
(``flash_attn.cute.flash_attn_func``: ``window_size``, ``softcap``, ``learnable_sink`` (bf16),
found in its signature; no ALiBi argument); ``Flex``: FlexAttention compiled once
(``torch.compile(flex_attention)``) with the equivalent mask_mod and block mask (window) or
score_mod (softcap, ALiBi; sinks have no equivalent); ``cuDNN``: SDPA's cuDNN backend where SDPA
can express the feature, ALiBi as an additive bias (1, heads, s, s) when it fits in
:data:`BIAS_LIMIT` bytes (no lse: output only). A side that cannot run a cell is "n/a (why)".

Checks and timing as tools/bench_varlen.py (tools/bench_check.py, tools/bench_run.py). TFLOP/s count
the unmasked work (a window's band only). Columns: "cost" = cutefa's time over cutefa-base's minus
1 (softcap, sinks, ALiBi; goal <= 5%); for a window, "vs dense causal" = cutefa's TFLOP/s over the
dense causal call's (goal >= 0.9).

    python tools/bench_features.py --out DIR --precompile           # the grid
    python tools/bench_features.py --quick --out DIR --precompile   # seqlen 8192 only

Writes DIR/bench_features.md, .json and .png (with matplotlib).
"""

import argparse
import contextlib
import inspect
import math
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

import bench_check
from bench_grid import tflops
from bench_sides import Line, NotApplicable, Side, notes, plot, precompile, run_line, table, write_json

HDIM = 128
HEADS = 16
TOKENS = 32768
SEQLENS = (8192, 32768)
QUICK_SEQLENS = (8192,)
FEATURES = ("window1k", "window4k", "softcap", "sinks", "alibi")
WINDOWS = {"window1k": 1024, "window4k": 4096}
SOFTCAP = 50.0
BIAS_LIMIT = 4 << 30
SIDES = ("cutefa", "cutefa-base", "FA4", "Flex", "cuDNN")


def alibi_slopes(heads: int) -> list[float]:
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def window_pairs(seqlen: int, left: int) -> int:
    """Pairs of a causal window (left, 0) over seqlen queries = keys: row i sees min(i, left) + 1 keys."""
    inside = min(seqlen, left + 1)
    return inside * (inside + 1) // 2 + (seqlen - inside) * (left + 1)


@dataclass(frozen=True)
class Problem:
    feature: str
    seqlen: int
    pass_: str

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def window(self):
        return (WINDOWS[self.feature], 0) if self.feature in WINDOWS else None

    @property
    def label(self) -> str:
        return f"{self.pass_} {self.feature} s={self.seqlen}"

    def pairs(self, with_feature: bool = True) -> int:
        if with_feature and self.window is not None:
            return window_pairs(self.seqlen, self.window[0])
        return self.seqlen * (self.seqlen + 1) // 2

    def flops(self, with_feature: bool = True) -> float:
        f = 4.0 * self.batch * HEADS * HDIM * self.pairs(with_feature)
        return f * 2.5 if self.pass_ == "bwd" else f

    def values(self, device="cuda") -> dict:
        """The feature's keyword values for the reference (``window``, ``softcap``, ``slopes``, ``sinks``)."""
        import torch

        if self.feature == "softcap":
            return {"softcap": SOFTCAP}
        if self.feature == "alibi":
            return {"slopes": torch.tensor(alibi_slopes(HEADS), device=device)}
        if self.feature == "sinks":  # bf16-representable values: FA4 takes them in bf16
            gen = torch.Generator().manual_seed(36)
            return {"sinks": torch.randn(HEADS, generator=gen).bfloat16().float().to(device)}
        return {"window": self.window}


def problems(seqlens, features, passes) -> list[Problem]:
    return [Problem(f, s, p) for p in passes for s in seqlens for f in features]


# ---------------------------------------------------------------------------------------------
# sides: make(problem) -> fwd(q, k, v) -> (out (b, s, h, d), lse (b, h, s) or None)


def _cutefa(name: str, with_feature: bool) -> Side:
    try:
        import cutefa
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Side(name, None, f"cutefa not importable: {exc}")

    def make(p: Problem):
        values = p.values() if with_feature else {}
        kwargs = {}
        if "window" in values:
            kwargs["window_size"] = values["window"]
        if "softcap" in values:
            kwargs["softcap"] = values["softcap"]
        if "slopes" in values:
            kwargs["alibi_slopes"] = values["slopes"]
        if "sinks" in values:
            kwargs["sinks"] = values["sinks"]
        return lambda q, k, v: cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True, **kwargs)

    return Side(name, make)


def _fa4() -> Side:
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:  # noqa: BLE001 - absent or broken
        return Side("FA4", None, f"flash_attn.cute not importable: {type(exc).__name__}")
    try:
        params = set(inspect.signature(fa4).parameters)
    except (TypeError, ValueError):
        params = set()

    def make(p: Problem):
        values = p.values()
        kwargs = {"return_lse": True} if "return_lse" in params else {}
        wanted = {"window": "window_size", "softcap": "softcap", "sinks": "learnable_sink"}
        for key, value in values.items():
            arg = wanted.get(key)
            if arg is None or arg not in params:
                raise NotApplicable(f"no {key} argument")
            kwargs[arg] = value.bfloat16() if key == "sinks" else value

        def fwd(q, k, v):
            res = fa4(q, k, v, causal=True, **kwargs)
            return (res[0], res[1]) if isinstance(res, tuple) else (res, None)

        return fwd

    return Side("FA4", make)


_FLEX: dict = {}


def _flex() -> Side:
    try:
        import torch
        from torch.nn.attention import flex_attention as fa
    except Exception as exc:  # noqa: BLE001
        return Side("Flex", None, f"FlexAttention not available: {type(exc).__name__}")
    if "compiled" not in _FLEX:
        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 512))
        _FLEX["compiled"] = torch.compile(fa.flex_attention, dynamic=False)
    flex, aux = _FLEX["compiled"], getattr(fa, "AuxRequest", None)

    def make(p: Problem):
        values = p.values()
        if "sinks" in values:
            raise NotApplicable("no sink logit in FlexAttention")
        left = values["window"][0] if "window" in values else None

        def mask_mod(b, h, i, j):
            ok = j <= i
            return ok & (i - j <= left) if left is not None else ok

        score_mod = None
        if "softcap" in values:
            cap = values["softcap"]

            def score_mod(s, b, h, i, j):
                return cap * torch.tanh(s / cap)

        elif "slopes" in values:
            slopes = values["slopes"]

            def score_mod(s, b, h, i, j):
                return s - slopes[h] * (i - j).abs()

        block_mask = fa.create_block_mask(mask_mod, None, None, p.seqlen, p.seqlen, device="cuda")
        lse_kw = {"return_aux": aux(lse=True)} if aux is not None else {"return_lse": True}

        def fwd(q, k, v):
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            out, extra = flex(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, **lse_kw)
            return out.transpose(1, 2), getattr(extra, "lse", extra)

        return fwd

    return Side("Flex", make)


def _cudnn() -> Side:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(p: Problem):
        if p.feature != "alibi":
            raise NotApplicable(f"SDPA gives cuDNN no {p.feature} argument")
        if HEADS * p.seqlen**2 * 2 > BIAS_LIMIT:
            raise NotApplicable(f"the ({HEADS}, {p.seqlen}, {p.seqlen}) bias is over {BIAS_LIMIT >> 30} GiB")
        slopes = p.values()["slopes"]
        pos = torch.arange(p.seqlen, device="cuda")
        dist = (pos[:, None] - pos[None, :]).float()
        bias = (-slopes[:, None, None] * dist.abs()).masked_fill(dist < 0, -math.inf)[None].bfloat16()

        def fwd(q, k, v):
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=bias.expand(q.shape[0], -1, -1, -1)
                )
            return out.transpose(1, 2), None

        return fwd

    return Side("cuDNN", make)


def load_sides(names) -> list[Side]:
    makers = {
        "cutefa": lambda: _cutefa("cutefa", True), "cutefa-base": lambda: _cutefa("cutefa-base", False),
        "FA4": _fa4, "Flex": _flex, "cuDNN": _cudnn,
    }  # fmt: skip
    return [makers[n]() for n in names]


# ---------------------------------------------------------------------------------------------
# the run


def inputs_of(p: Problem, device="cuda"):
    import torch

    gen = torch.Generator(device=device).manual_seed(zlib.crc32(p.label.encode()))
    shape = (p.batch, p.seqlen, HEADS, HDIM)
    return [torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(4 if p.pass_ == "bwd" else 3)]  # fmt: skip


def run_problem(p: Problem, sides, time_ms, rounds: int, slices: int, device="cuda") -> Line:
    q, k, v, *rest = inputs_of(p, device)
    common = {"causal": True, "scale": 1.0 / math.sqrt(HDIM), "dout": rest[0] if rest else None, "slices": slices,
              "seed": zlib.crc32(p.label.encode())}  # fmt: skip
    expect = bench_check.expectation(q, k, v, **common, **p.values(device))
    judges = {}
    if any(s.name == "cutefa-base" for s in sides):
        judges["cutefa-base"] = bench_check.expectation(q, k, v, **common)
    line = Line(p.label, p.pass_, p.flops(), p.feature)
    run_line(line, sides, p, [q, k, v, *rest], expect, time_ms, rounds, device, judges)
    base = line.results.get("cutefa-base")
    if base is not None and base.ms is not None:
        base.tflops = tflops(p.flops(with_feature=False), base.ms)
    return line


def cost(line: Line) -> str:
    """cutefa's time over the same call without the feature, minus 1 (not for a window)."""
    mine, base = line.results.get("cutefa"), line.results.get("cutefa-base")
    if line.group in WINDOWS or mine is None or base is None or not mine.ms or not base.ms:
        return "-"
    return f"{mine.ms / base.ms - 1:+.1%}"


def versus_dense(line: Line) -> str:
    """A window's TFLOP/s (band only) over the dense causal call's."""
    if line.group not in WINDOWS:
        return "-"
    mine, base = line.tflops("cutefa"), line.tflops("cutefa-base")
    return f"{mine / base:.2f}" if mine and base else "-"


def cutefa_specs(ps: list[Problem]) -> list:
    """The variants cutefa's calls of the grid dispatch to (for --precompile)."""
    import torch

    from cutefa import dispatch
    from cutefa.api import backward, feature_bwd
    from cutefa.api.features import FeatureArgs

    target = dispatch.current_target()
    specs = []
    for p in ps:
        values = p.values("cpu")
        f = FeatureArgs(window=values.get("window"), softcap=values.get("softcap", 0.0),
                        alibi_slopes=values.get("slopes"), sinks=values.get("sinks"))  # fmt: skip
        common = {"target": target, "dtype": torch.bfloat16, "causal": True}
        shape = {"head_dim": HDIM, "seqlen_q": p.seqlen, "seqlen_k": p.seqlen, "batch": p.batch, "heads_q": HEADS,
                 "heads_kv": HEADS}  # fmt: skip
        picks = (
            (dispatch.choose, {**common, **shape, "local": f.window is not None, "features": f.features()}),
            (dispatch.choose, {**common, **shape}),
            (feature_bwd.choose_bwd, {**common, "head_dim": HDIM, "f": f, "seqlen_k": p.seqlen}),
            (backward.choose_bwd, {**common, "head_dim": HDIM, "seqlen_k": p.seqlen}),
        )
        for pick, kwargs in picks:
            with contextlib.suppress(Exception):  # a problem with no kernel shows as err in its cell
                chosen = pick(**kwargs)
                specs.append(getattr(chosen, "spec", chosen))
    return specs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="seqlen 8192 only")
    ap.add_argument("--seqlen", default=None, help="comma-separated of 8192,32768")
    ap.add_argument("--features", default=None, help=f"comma-separated of {','.join(FEATURES)}")
    ap.add_argument("--pass", dest="passes", default="fwd,bwd", help="fwd, bwd or fwd,bwd")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated of {','.join(SIDES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slices", type=int, default=bench_check.SLICES, help="(batch, head) slices checked")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--precompile", action="store_true", help="compile cutefa's variants in parallel first")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args(argv)

    def listed(text, allowed, default, convert=str):
        if text is None:
            return list(default)
        try:
            values = [convert(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or any(v not in allowed for v in values):
            ap.error(f"expected a comma-separated list of {list(allowed)}, got {text!r}")
        return values

    args.seqlen = listed(args.seqlen, SEQLENS, QUICK_SEQLENS if args.quick else SEQLENS, int)
    args.features = listed(args.features, FEATURES, FEATURES)
    args.passes = listed(args.passes, ("fwd", "bwd"), ("fwd", "bwd"))
    args.sides = listed(args.sides, SIDES, SIDES)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def report(lines: list[Line], names: list[str], meta: dict) -> str:
    extra = {"cost vs without": cost, "window vs dense causal": versus_dense}
    head = (
        f"# Features, bf16 hd{HDIM} {HEADS} heads causal, {meta.get('gpu', '')}\n\ntorch {meta.get('torch')}, "
        f"timer {meta.get('timer')}, {meta.get('rounds')} rounds in turns. TFLOP/s of the unmasked work "
        "(cutefa-base: the same call without the feature, its own work); FAIL: an output off the float32 "
        "reference (no speed); n/a: the side cannot run the cell.\n\n"
    )
    found = notes(lines)
    return head + table(lines, names, extra) + (f"\n\nFailures and errors:\n{found}" if found else "") + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench_backends import environment, make_timer

    ps = problems(args.seqlen, args.features, args.passes)
    if args.precompile:
        for failure in precompile(cutefa_specs(ps), args.jobs):
            print(f"compile failed: {failure}", file=sys.stderr)
    timer, time_ms = make_timer(10, 40)
    sides = load_sides(args.sides)
    lines = []
    for p in ps:
        line = run_problem(p, sides, time_ms, args.rounds, args.slices)
        lines.append(line)
        print(p.label, {n: r.status if r.tflops is None else f"{r.tflops:.0f}" for n, r in line.results.items()},
              flush=True)  # fmt: skip
    meta = environment() | {"timer": timer, "rounds": args.rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(lines, args.sides, meta)
    (args.out / "bench_features.md").write_text(text)
    write_json(args.out / "bench_features.json", meta, lines)
    drew = plot(lines, args.sides, args.out / "bench_features.png", f"features, bf16 hd{HDIM}")
    print(text)
    print(f"wrote {args.out / 'bench_features.md'}" + ("" if drew else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
