"""Side-by-side attention benchmark on one GPU: cutefa vs FA4, cuDNN and FA2, in one run.

Grid (as in the anchor figures): layout (batch, seqlen, heads, head_dim) with batch x seqlen =
16384 tokens and heads x head_dim = 2048, random normal inputs, median time of
``triton.testing.do_bench`` (CUDA events when triton is missing). TFLOP/s counts 4*b*h*s^2*d for
the forward, halved when causal. The dense bf16 matmul rate (8192^3) is measured in the same run:
that is the ceiling the attention figures are read against.

Before cutefa is timed on a cell, its output is checked against SDPA; a cell whose relative error
exceeds the tolerance is reported as WRONG and its speed is not. A backend that raises is shown as
"err" with the message in the notes; a backend that is not installed leaves its column empty.

    python3 tools/bench.py                      # full grid, bf16, causal and not
    python3 tools/bench.py --quick              # a few cells
    python3 tools/bench.py --hdim 128 --seqlen 4096,8192 --causal 1 --dtype bf16,fp16
    python3 tools/bench.py --enqueue            # host cost per call, all backends
    python3 tools/bench.py --enqueue --pack DIR # ... with cutefa's kernel from a kernel pack
    python3 tools/bench.py --startup            # import cutefa -> first result from a pack, ms
    python3 tools/bench.py --pass bwd --hdim 128 --seqlen 2048 --causal 0 \
        --bwd-variants cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_ov,cutefa_sm90_bwd_bf16_hd128_64x128_s3_w12

``--bwd-variants NAME,...`` times each named backward variant (or ``sm90`` / ``ARCH``: every
committed backward variant of that family and the measured alternatives, tools/alternatives.py) on
the backward cells whose dtype, head dim and mask it serves, exactly as the cutefa column is timed
(cutefa's forward, then autograd's backward, checked against SDPA) but with the backward forced to
that variant; each gets a row of its own in a "Backward variants" table beside FA4 and the default
cutefa backward of the same cell.

Writes ``bench.md``, ``bench.json`` and ``bench.png`` (``enqueue.md``/``enqueue.json`` for
``--enqueue``, ``startup.md``/``startup.json`` for ``--startup``) under ``--out`` (default
``bench_out/``). ``--pack DIR`` (default for ``--startup``: ``<out>/pack``) names the kernel pack
cutefa runs from; the kernel of the tiny problem is compiled into it first when it lacks it.
"""

# No `from __future__ import annotations`: the `cutefa bench` command loads this file without
# registering it in sys.modules, and dataclasses cannot resolve string annotations then.
import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # tools/alternatives.py, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

TOKENS = 16384
MODEL_DIM = 2048
SEQLENS = (1024, 2048, 4096, 8192, 16384)
HDIMS = (64, 128, 256)
QUICK_SEQLENS = (1024, 4096)
QUICK_HDIMS = (128,)
BACKENDS = ("cutefa", "FA4", "cuDNN", "FA2")
PEERS = ("FA4", "cuDNN", "FA2")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
ENQUEUE_SHAPE = {"batch": 1, "seqlen": 128, "heads": 16, "hdim": 128, "causal": True}


# ----------------------------------------------------------------------------------------------
# arguments and grid


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _dtype_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in DTYPE_NAMES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--dtype takes a list of {sorted(DTYPE_NAMES)}, got {text!r}")
    return values


def _pass_list(text: str) -> list[str]:
    values = ["fwd", "bwd"] if text.strip() == "both" else [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(x not in ("fwd", "bwd") for x in values):
        raise argparse.ArgumentTypeError(f"--pass takes fwd, bwd, fwd,bwd or both, got {text!r}")
    return values


def _backend_list(text: str) -> list[str]:
    by_lower = {b.lower(): b for b in BACKENDS}
    values = [x.strip().lower() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in by_lower]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--backends takes a list of {list(BACKENDS)}, got {text!r}")
    return [by_lower[x] for x in values]


def _bwd_variant_list(text: str) -> list[str]:
    """Backward variant names, checked: a comma list of names and/or family names (sm90: every
    committed sm90 backward variant and the measured alternatives)."""
    from alternatives import all_variants

    from cutefa.model import rules
    from cutefa.model.spec import ARCHS, parse_name

    names: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item in ARCHS:
            names += [s.name for s in all_variants(item, "bwd")]
            continue
        try:
            spec = parse_name(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if spec.direction != "bwd":
            raise argparse.ArgumentTypeError(f"--bwd-variants: {item!r} is not a backward variant")
        why = rules.why_invalid(spec)
        if why is not None:
            raise argparse.ArgumentTypeError(f"--bwd-variants: {item!r} is not valid: {why}")
        names.append(item)
    if not names:
        raise argparse.ArgumentTypeError(f"--bwd-variants takes variant names, got {text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.py",
        description="cutefa vs FA4 / cuDNN / FA2 attention throughput, side by side on one GPU.",
    )
    p.add_argument("--hdim", type=_int_list, default=None, help="head dims, e.g. 64,128,256 (default)")
    p.add_argument("--seqlen", type=_int_list, default=None, help="seqlens (default 1024..16384)")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", type=_dtype_list, default=["bf16"], help="bf16 (default), fp16 or bf16,fp16")
    p.add_argument("--pass", dest="passes", type=_pass_list, default=["fwd"], help="fwd, bwd or both (fwd)")
    p.add_argument("--quick", action="store_true", help="small grid: hdim 128, seqlen 1024,4096")
    p.add_argument("--backends", type=_backend_list, default=list(BACKENDS), help="subset of backends")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder (bench_out/)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument(
        "--rounds", type=_positive_int, default=1,
        help="time every backend of a cell this many times, in turns (backend after backend, round "
        "after round), and report the median: clock and power drift then falls on all backends alike",
    )  # fmt: skip
    p.add_argument("--check-tol", type=float, default=2e-2, help="max rel error of cutefa vs SDPA")
    p.add_argument("--no-plot", action="store_true", help="skip bench.png")
    p.add_argument("--enqueue", action="store_true", help="measure host cost per call instead of the grid")
    p.add_argument("--enqueue-iters", type=int, default=1000, help="calls per enqueue loop")
    p.add_argument(
        "--startup",
        action="store_true",
        help="time from `import cutefa` to the first result from a kernel pack",
    )
    p.add_argument("--startup-runs", type=int, default=7, help="fresh processes timed by --startup")
    p.add_argument("--pack", type=Path, default=None, help="kernel pack for cutefa (--enqueue, --startup)")
    p.add_argument(
        "--bwd-variants",
        type=_bwd_variant_list,
        default=[],
        help="backward variant names (comma-separated), or a family (sm90) for all its committed ones: "
        "each timed on the matching bwd cells, one row per variant (implies --pass bwd)",
    )
    args = p.parse_args(argv)
    if args.bwd_variants and "bwd" not in args.passes:
        args.passes = [*args.passes, "bwd"]
    if args.hdim is None:
        args.hdim = list(QUICK_HDIMS if args.quick else HDIMS)
    if args.seqlen is None:
        args.seqlen = list(QUICK_SEQLENS if args.quick else SEQLENS)
    return args


@dataclass(frozen=True)
class Cell:
    dtype: str
    hdim: int
    causal: bool
    seqlen: int
    pass_: str = "fwd"

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return max(1, MODEL_DIM // self.hdim)

    @property
    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen**2 * self.hdim
        f = f * 2.5 if self.pass_ == "bwd" else f  # backward: 5 matmuls to the forward's 2
        return f / 2 if self.causal else f

    @property
    def label(self) -> str:
        return f"{self.pass_} {self.dtype} hd{self.hdim} causal={int(self.causal)} s={self.seqlen}"


def grid(args: argparse.Namespace) -> list[Cell]:
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    return [
        Cell(dt, hd, c, s, p)
        for p in args.passes
        for dt in args.dtype
        for hd in args.hdim
        for c in causals
        for s in args.seqlen
    ]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------------
# results and their presentation


@dataclass
class Result:
    """One backend on one cell. status: ok | WRONG | err | missing | unchecked (no SDPA to check against)."""

    status: str
    ms: float | None = None
    tflops: float | None = None
    rel_err: float | None = None
    error: str | None = None
    rounds_ms: list[float] = field(default_factory=list)  # --rounds: each round's time

    def text(self) -> str:
        if self.status == "ok" and self.tflops is not None:
            return f"{self.tflops:.0f}"
        if self.status == "unchecked" and self.tflops is not None:
            return f"{self.tflops:.0f} (unchecked)"
        return "" if self.status == "missing" else self.status


@dataclass
class Row:
    cell: Cell
    results: dict[str, Result] = field(default_factory=dict)
    variant: str | None = None
    # --bwd-variants: variant name -> its result on this cell (backward cells it serves only)
    bwd_variants: dict[str, Result] = field(default_factory=dict)

    def value(self, backend: str) -> float | None:
        r = self.results.get(backend)
        return r.tflops if r is not None and r.status == "ok" else None

    def ratio_best(self) -> float | None:
        mine = self.value("cutefa")
        peers = [v for v in (self.value(b) for b in PEERS) if v]
        return mine / max(peers) if mine is not None and peers else None

    def ratio_fa2(self) -> float | None:
        mine, fa2 = self.value("cutefa"), self.value("FA2")
        return mine / fa2 if mine is not None and fa2 else None


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown_table(rows: list[Row], backends: list[str]) -> str:
    head = ["pass", "dtype", "hdim", "causal", "seqlen", "b x h", *backends, "cutefa/best", "cutefa/FA2"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        c = row.cell
        cells = [c.pass_, c.dtype, str(c.hdim), str(int(c.causal)), str(c.seqlen), f"{c.batch} x {c.heads}"]
        cells += [row.results[b].text() if b in row.results else "" for b in backends]
        cells += [_ratio(row.ratio_best()), _ratio(row.ratio_fa2())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def variant_serves(name: str, cell: Cell) -> bool:
    """Whether backward variant ``name`` runs the backward of ``cell`` (dtype, head dim, mask)."""
    from cutefa.model.spec import parse_name

    spec = parse_name(name)
    return (
        cell.pass_ == "bwd"
        and spec.dtype == cell.dtype
        and spec.head_dim == cell.hdim
        and spec.causal == cell.causal
    )


def bwd_variants_table(rows: list[Row]) -> str:
    """One row per (--bwd-variants variant, cell): its TFLOP/s beside FA4 and cutefa's default."""
    head = [
        "variant",
        "hdim",
        "causal",
        "seqlen",
        "TFLOP/s",
        "FA4",
        "variant/FA4",
        "cutefa default",
        "variant/default",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        c = row.cell
        fa4, default = row.value("FA4"), row.value("cutefa")
        for name, res in row.bwd_variants.items():
            mine = res.tflops if res.status == "ok" else None
            cells = [name, str(c.hdim), str(int(c.causal)), str(c.seqlen), res.text()]
            cells += ["" if fa4 is None else f"{fa4:.0f}"]
            cells += [_ratio(mine / fa4) if mine and fa4 else ""]
            cells += ["" if default is None else f"{default:.0f}"]
            cells += [_ratio(mine / default) if mine and default else ""]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_markdown(meta: dict, rows: list[Row], backends: list[str], notes: list[str]) -> str:
    out = ["# Attention, TFLOP/s (higher is better)", ""]
    out.append(f"GPU: {meta.get('gpu', '?')}; torch {meta.get('torch', '?')}; {meta.get('date', '')}")
    mm = meta.get("matmul_tflops")
    out.append(f"Dense bf16 matmul 8192^3 (cuBLAS, median): {mm:.0f} TFLOP/s" if mm else "Dense matmul: n/a")
    out.append(
        f"Layout (batch, seqlen, heads, hdim), batch x seqlen = {TOKENS}, heads x hdim = {MODEL_DIM}; "
        "TFLOP/s = 4*b*h*s^2*d / time for the forward (2.5x that for the backward), halved when causal; median of "
        f"{meta.get('timer', 'do_bench')}"
        + (
            f", the median of {meta['rounds']} rounds in turns across backends"
            if meta.get("rounds", 1) > 1
            else ""
        )
        + ". WRONG: cutefa's output failed the check against SDPA "
        f"(rel err > {meta.get('check_tol')}); err: the backend raised (see notes); empty: not installed."
    )
    out += ["", markdown_table(rows, backends), ""]
    if any(row.bwd_variants for row in rows):
        out += [
            "## Backward variants",
            "",
            "Each variant timed like the cutefa column (checked against SDPA), with the backward forced to it.",
            "",
            bwd_variants_table(rows),
            "",
        ]
    if notes:
        out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(out)


def report_json(meta: dict, rows: list[Row], notes: list[str]) -> dict:
    cells = []
    for row in rows:
        c = row.cell
        cells.append(
            {
                "pass": c.pass_,
                "dtype": c.dtype,
                "hdim": c.hdim,
                "causal": c.causal,
                "seqlen": c.seqlen,
                "batch": c.batch,
                "heads": c.heads,
                "flops": c.flops,
                "cutefa_variant": row.variant,
                "results": {name: vars(r) for name, r in row.results.items()},
                "cutefa_over_best": row.ratio_best(),
                "cutefa_over_fa2": row.ratio_fa2(),
                "bwd_variants": {name: vars(r) for name, r in row.bwd_variants.items()},
            }
        )
    return {"meta": meta, "cells": cells, "notes": notes}


def plot_panels(rows: list[Row]) -> dict[tuple[str, str, int, bool], list[Row]]:
    """The plot's panels: rows grouped by (pass, dtype, hdim, causal), in order of appearance, so that
    a forward and a backward cell of one shape never share a panel."""
    panels: dict[tuple[str, str, int, bool], list[Row]] = {}
    for row in rows:
        panels.setdefault((row.cell.pass_, row.cell.dtype, row.cell.hdim, row.cell.causal), []).append(row)
    return panels


def panel_title(key: tuple[str, str, int, bool]) -> str:
    pass_, dtype, hdim, causal = key
    return f"{pass_} {dtype} hd{hdim} {'causal' if causal else 'non-causal'}"


def plot(rows: list[Row], backends: list[str], matmul: float | None, path: Path) -> str | None:
    """Grouped bars per (pass, dtype, hdim, causal) panel, titled with the pass (fwd or bwd). Returns
    why not, or None when written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    panels = plot_panels(rows)
    if not panels:
        return "no cells: no plot"
    keys = list(panels)
    ncols = 2 if len(keys) > 1 else 1
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 3.6 * nrows), squeeze=False)
    width = 0.8 / max(1, len(backends))
    for ax, key in zip(axes.flat, keys):
        prow = sorted(panels[key], key=lambda r: r.cell.seqlen)
        xs = range(len(prow))
        for i, b in enumerate(backends):
            vals = [r.value(b) or 0.0 for r in prow]
            pos = [x + (i - (len(backends) - 1) / 2) * width for x in xs]
            ax.bar(pos, vals, width, label=b)
            for x, r in zip(pos, prow):
                res = r.results.get(b)
                if res is not None and res.status in ("WRONG", "err"):
                    ax.text(x, 5, res.status, rotation=90, ha="center", va="bottom", fontsize=7, color="red")
        if matmul:
            ax.axhline(matmul, color="gray", linestyle="--", linewidth=1, label="dense bf16 GEMM")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([str(r.cell.seqlen) for r in prow])
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(panel_title(key))
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------------
# GPU side


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_timer(warmup: int, rep: int) -> tuple[str, Callable[[Callable[[], object]], float]]:
    """(name, time_ms): median milliseconds of a callable."""
    import torch

    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:

        def bench_ms(fn: Callable[[], object]) -> float:
            try:
                return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
            except TypeError:  # a triton without return_mode
                return float(do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])[0])

        return "triton.testing.do_bench", bench_ms

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")

    def time_ms(fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        est = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(max(1, int(warmup / est))):
            fn()
        times = []
        for _ in range(max(5, int(rep / est))):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times)

    return "CUDA events (triton not installed)", time_ms


@dataclass
class Backend:
    name: str
    # make(q, k, v, causal) -> a no-argument callable that runs the attention forward once
    make: Callable | None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    missing: str | None = None


@contextlib.contextmanager
def forced_bwd_variant(name: str):
    """Within the block, cutefa's backward runs variant ``name`` whatever dispatch would choose."""
    from cutefa.api import backward
    from cutefa.model.spec import parse_name

    spec = parse_name(name)
    saved = backward.choose_bwd

    def choose(target, dtype, head_dim, causal, **where):
        wanted = saved(target, dtype, head_dim, causal, **where)
        if (wanted.dtype, wanted.head_dim, wanted.causal) != (spec.dtype, spec.head_dim, spec.causal):
            raise ValueError(
                f"--bwd-variants: {name} does not serve this problem (dispatch wants {wanted.name})"
            )
        return spec

    backward.choose_bwd = choose
    try:
        yield
    finally:
        backward.choose_bwd = saved


def bwd_variant_backend(name: str, cutefa_backend: "Backend") -> "Backend":
    """cutefa's backend with the backward forced to variant ``name``."""
    return Backend(
        name, cutefa_backend.make, context=lambda: forced_bwd_variant(name), missing=cutefa_backend.missing
    )


def load_backends(wanted: list[str]) -> list[Backend]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = []
    for name in wanted:
        if name == "cutefa":
            try:
                import cutefa

                def make(q, k, v, causal, _f=cutefa.flash_attn_func):
                    return lambda: _f(q, k, v, causal=causal)

                out.append(Backend(name, make))
            except Exception as exc:  # noqa: BLE001 - a broken import is a table entry, not a crash
                out.append(Backend(name, None, missing=f"cutefa not importable: {_first_line(exc)}"))
        elif name == "FA4":
            try:
                from flash_attn.cute import flash_attn_func as fa4
            except Exception:  # noqa: BLE001 - absent or broken: either way no FA4 column
                out.append(Backend(name, None, missing="FA4 not installed"))
                continue

            def make(q, k, v, causal, _f=fa4):
                return lambda: _f(q, k, v, causal=causal)

            out.append(Backend(name, make))
        else:
            kind = SDPBackend.CUDNN_ATTENTION if name == "cuDNN" else SDPBackend.FLASH_ATTENTION

            def make(q, k, v, causal):
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            out.append(Backend(name, make, context=lambda kind=kind: sdpa_kernel(kind)))
    return out


def _output(value):
    """Backends return out, or (out, lse): the attention output either way, as (b, s, h, d)."""
    return value[0] if isinstance(value, (tuple, list)) else value


def _sdpa_out(q, k, v, causal):
    import torch.nn.functional as F

    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return o.transpose(1, 2)


def rel_err(out, ref) -> float:
    import torch

    if out.shape != ref.shape:
        return math.inf
    diff = torch.linalg.vector_norm(out.float() - ref.float()).item()
    norm = torch.linalg.vector_norm(ref.float()).item()
    err = diff / norm if norm else (0.0 if diff == 0 else math.inf)
    return math.inf if math.isnan(err) else err


def _variant(q, k, v, causal) -> str | None:
    try:
        import cutefa

        m = re.search(r"cutefa_sm\d+_\w+", cutefa.explain(q, k, v, causal=causal))
        return m.group(0) if m else None
    except Exception:  # noqa: BLE001 - the variant name is a label only
        return None


def _backward(make, q, k, v, causal, dout):
    """A closure timing the backward only: the forward runs once here, the closure re-runs
    autograd over its graph (retain_graph) and returns dQ."""
    import torch

    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = _output(make(qq, kk, vv, causal)())
    if out.shape != dout.shape:  # SDPA backends return (b, h, s, d)
        dout = dout.transpose(1, 2)
    return lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True)[0]


def _sdpa_dq(q, k, v, causal, dout):
    import torch

    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(_sdpa_out(qq, kk, vv, causal), qq, dout)[0]


def run_backend(backend: Backend, q, k, v, causal, time_ms, expect, check_tol, dout=None) -> Result:
    if backend.make is None:
        return Result("missing", error=backend.missing)
    try:
        with backend.context():
            if dout is None:
                fn = backend.make(q, k, v, causal)
            else:
                fn = _backward(backend.make, q, k, v, causal, dout)
            err = None
            if expect is not None:
                err = rel_err(_output(fn()), expect)
                if not err <= check_tol:
                    return Result("WRONG", rel_err=err, error=f"rel err {err:.3g} vs SDPA > {check_tol}")
            ms = time_ms(fn)
        return Result("ok", ms=ms, rel_err=err)
    except Exception as exc:  # noqa: BLE001 - one failing backend must not kill the table
        return Result("err", error=_first_line(exc))


def measure_matmul(time_ms) -> float:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.mm(a, b))
    return tflops(2.0 * n**3, ms)


def environment() -> dict:
    import importlib.metadata as md

    import torch

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        meta["gpu"] = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    for dist in ("cutefa", "nvidia-cutlass-dsl", "flash-attn-4", "triton"):
        try:
            meta[dist] = md.version(dist)
        except md.PackageNotFoundError:
            meta[dist] = None
    return meta


def run_grid(args: argparse.Namespace) -> int:
    import torch

    backends = load_backends(args.backends)
    names = [b.name for b in backends]
    for b in backends:
        if b.missing:
            print(b.missing)
    cutefa_backend = next((b for b in backends if b.name == "cutefa"), None)
    if args.bwd_variants and cutefa_backend is None:
        (cutefa_backend,) = load_backends(["cutefa"])
    timer_name, time_ms = make_timer(args.warmup, args.rep)
    meta = environment() | {"timer": timer_name, "rounds": args.rounds, "check_tol": args.check_tol}
    meta["argv"] = sys.argv[1:]
    notes: list[str] = []
    try:
        meta["matmul_tflops"] = measure_matmul(time_ms)
        print(f"dense bf16 matmul 8192^3: {meta['matmul_tflops']:.0f} TFLOP/s", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported in the notes
        meta["matmul_tflops"] = None
        notes.append(f"dense matmul: {_first_line(exc)}")

    rows = []
    for cell in grid(args):
        dtype = getattr(torch, DTYPE_NAMES[cell.dtype])
        shape = (cell.batch, cell.seqlen, cell.heads, cell.hdim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
        row = Row(cell)
        dout = torch.randn_like(q) if cell.pass_ == "bwd" else None
        try:
            expect = _sdpa_out(q, k, v, cell.causal) if dout is None else _sdpa_dq(q, k, v, cell.causal, dout)
        except Exception as exc:  # noqa: BLE001 - reported in the notes
            expect = None
            notes.append(f"{cell.label}: SDPA reference failed, cutefa unchecked: {_first_line(exc)}")
        for _ in range(args.rounds):
            for b in backends:
                first = row.results.get(b.name)
                if first is not None and first.ms is None:
                    continue  # failed or missing in an earlier round
                check = expect if b.name == "cutefa" and first is None else None
                res = run_backend(b, q, k, v, cell.causal, time_ms, check, args.check_tol, dout)
                if first is not None:
                    first.rounds_ms.append(res.ms)  # None: this round failed
                    continue
                if res.ms is not None:
                    res.rounds_ms.append(res.ms)
                row.results[b.name] = res
        for b in backends:
            res = row.results[b.name]
            if res.ms is not None:
                if None in res.rounds_ms:
                    res.status, res.ms, res.error = "err", None, f"failed in a later round: {res.rounds_ms}"
                else:
                    res.ms = statistics.median(res.rounds_ms)
            if res.ms is not None:
                res.tflops = tflops(cell.flops, res.ms)
            if b.name == "cutefa" and expect is None and res.status == "ok":
                res.status = "unchecked"
            if res.status in ("WRONG", "err"):
                notes.append(f"{b.name} {cell.label}: {res.error}")
        for vname in [n for n in args.bwd_variants if variant_serves(n, cell)]:
            vb = bwd_variant_backend(vname, cutefa_backend)
            res = run_backend(vb, q, k, v, cell.causal, time_ms, expect, args.check_tol, dout)
            if res.ms is not None:
                res.tflops = tflops(cell.flops, res.ms)
            if expect is None and res.status == "ok":
                res.status = "unchecked"
            if res.status in ("WRONG", "err"):
                notes.append(f"{vname} {cell.label}: {res.error}")
            row.bwd_variants[vname] = res
            print(f"    {vname}: {res.text() or '-'}", file=sys.stderr, flush=True)
        if "cutefa" in names:
            row.variant = _variant(q, k, v, cell.causal)
        rows.append(row)
        shown = ", ".join(f"{n} {row.results[n].text() or '-'}" for n in names)
        print(
            f"[{len(rows)}] {cell.label} b={cell.batch} h={cell.heads}: {shown}", file=sys.stderr, flush=True
        )
        del q, k, v, expect

    md_text = report_markdown(meta, rows, names, notes)
    print()
    print(md_text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.md").write_text(md_text + "\n")
    (args.out / "bench.json").write_text(json.dumps(report_json(meta, rows, notes), indent=1) + "\n")
    if not args.no_plot:
        why = plot(rows, names, meta.get("matmul_tflops"), args.out / "bench.png")
        print(why or f"plot: {args.out / 'bench.png'}")
    print(f"wrote {args.out / 'bench.md'} and {args.out / 'bench.json'}")
    return 0


def _tiny_problem(dtype_name: str):
    """(q, k, v, causal) of the enqueue/startup problem, on the GPU."""
    import torch

    sh = ENQUEUE_SHAPE
    dtype = getattr(torch, DTYPE_NAMES[dtype_name])
    shape = (sh["batch"], sh["seqlen"], sh["heads"], sh["hdim"])
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    return q, k, v, sh["causal"]


def ensure_pack(pack_dir: Path, q, k, causal: bool) -> str:
    """Make sure the pack at ``pack_dir`` has the kernel cutefa runs for (q, k); returns its name.

    Sets ``CUTEFA_KERNEL_PATH`` to the pack for this process and its children.
    """
    from cutefa import dispatch, pack, pack_build
    from cutefa.api.launch import choose
    from cutefa.compile import fingerprint

    choice = choose(q, k, causal)
    target = dispatch.current_target(q.device)
    os.environ["CUTEFA_KERNEL_PATH"] = str(pack_dir.resolve())
    found, refused = pack.find_kernel(choice.spec.name, target, fingerprint(choice.spec, target))
    if found is None or found.pack != pack_dir.resolve():
        for why in refused:
            print(f"refused: {why}", file=sys.stderr)
        print(
            f"building {choice.spec.name} for {target} into the pack {pack_dir}", file=sys.stderr, flush=True
        )
        (result,) = pack_build.build_pack([choice.spec], target=target, pack_dir=pack_dir, progress=False)
        if not result.ok:
            raise RuntimeError(f"could not build {choice.spec.name}: {result.error}")
    return choice.spec.name


def _raw_kernel(q, k, v, causal, how="call"):
    """A call of cutefa's kernel alone (outputs allocated once): the floor under the API's cost.
    ``how``: "call" (the loaded kernel's full call: arguments laid out per call), "bound" (the
    launcher the API's call plans use: data pointers only) or "tvm_ffi" (the same kernel file
    loaded and called through the tvm_ffi package, for comparison)."""
    import torch

    from cutefa import compile as cc
    from cutefa import ffi, loader
    from cutefa.api.dense import bind
    from cutefa.api.launch import choose

    choice = choose(q, k, causal)
    kernel = loader.get_kernel(choice.spec, choice.target)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if how == "bound":
        bound = bind(kernel, q, k, tuple(lse.shape), scale)
        if bound is None:
            raise RuntimeError("the kernel cannot bind (not loaded from a file)")

        def run():
            if not bound(q, k, v, out, lse):
                raise RuntimeError("bound launcher busy")
            return out

        return run
    if how == "tvm_ffi":
        import tvm_ffi

        path = next(
            p
            for p in ffi._LIBRARIES
            if p.stem == choice.spec.name or p.parent.name.startswith(choice.spec.name)
        )
        fn = tvm_ffi.load_module(str(path))[choice.spec.name]
        kernel = loader._with_sm_count(fn) if cc.takes_sm_count(choice.spec) else fn

    def run():
        kernel(q, k, v, out, lse, scale)
        return out

    return run


def run_enqueue(args: argparse.Namespace) -> int:
    """Host time per call of a tiny problem: a loop of N calls timed on the host, one sync at the end."""
    import torch

    sh = ENQUEUE_SHAPE
    q, k, v, causal = _tiny_problem(args.dtype[0])
    expect = _sdpa_out(q, k, v, causal)
    iters = max(1, args.enqueue_iters)
    notes = []
    if args.pack is not None and "cutefa" in args.backends:
        try:
            notes.append(f"cutefa runs {ensure_pack(args.pack, q, k, causal)} from the pack {args.pack}")
        except Exception as exc:  # noqa: BLE001 - reported, cutefa then runs from the cache or JIT
            notes.append(f"no pack: {_first_line(exc)}")
    backends = load_backends(args.backends)
    names = [b.name for b in backends]
    if "cutefa" in names:
        at = names.index("cutefa") + 1
        for label, how in (("cutefa kernel alone (full call)", "call"), ("cutefa kernel alone (bound)", "bound"),
                           ("cutefa kernel via tvm_ffi", "tvm_ffi")):  # fmt: skip
            backends.insert(at, Backend(label, functools.partial(_raw_kernel, how=how)))
            at += 1
    results = {}
    for b in backends:
        if b.missing:
            print(b.missing)
            results[b.name] = {"status": "missing", "error": b.missing}
            continue
        try:
            with b.context():
                fn = b.make(q, k, v, causal)
                err = rel_err(_output(fn()), expect)
                if b.name.startswith("cutefa") and not err <= args.check_tol:
                    results[b.name] = {"status": "WRONG", "rel_err": err}
                    continue
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
                host, total = [], []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    host.append((t1 - t0) / iters * 1e6)
                    total.append((t2 - t0) / iters * 1e6)
            results[b.name] = {
                "status": "ok",
                "host_us": statistics.median(host),
                "total_us": statistics.median(total),
                "rel_err": err,
            }
        except Exception as exc:  # noqa: BLE001 - one failing backend must not kill the table
            results[b.name] = {"status": "err", "error": _first_line(exc)}
        print(f"{b.name}: {results[b.name]}", file=sys.stderr, flush=True)

    meta = environment() | {"shape": sh, "dtype": args.dtype[0], "iters": iters}
    if "cutefa" in args.backends:
        from cutefa.loader import loaded_kernels

        meta["cutefa_kernels"] = {
            f"{name} ({target})": where for (name, target), where in loaded_kernels().items()
        }
        notes += [f"cutefa kernel {name}: from {where}" for name, where in meta["cutefa_kernels"].items()]
    lines = [
        "# Host cost per call (enqueue)",
        "",
        f"GPU: {meta.get('gpu', '?')}; torch {meta['torch']}; {meta['date']}",
        (
            f"b={sh['batch']} s={sh['seqlen']} h={sh['heads']} d={sh['hdim']} causal, {args.dtype[0]}; "
            f"median of 5 loops of {iters} calls; host = loop time on the host / calls, "
            "total = including the final synchronize. 'cutefa kernel alone' calls the loaded kernel "
            "with preallocated outputs, with its arguments laid out per call (full call) or only its "
            "data pointers written (bound, as the API's call plans do): the floor under cutefa's own "
            "call path; 'via tvm_ffi' is the same kernel file called through the tvm_ffi package."
        ),
        "",
        "| backend | host us/call | total us/call |",
        "|---|---|---|",
    ]
    for name, r in results.items():
        if r["status"] == "ok":
            lines.append(f"| {name} | {r['host_us']:.1f} | {r['total_us']:.1f} |")
        else:
            shown = {"missing": "", "WRONG": f"WRONG (rel err {r.get('rel_err', 0):.3g})"}.get(
                r["status"], f"{r['status']}: {r.get('error', '')}"
            )
            lines.append(f"| {name} | {shown} | |")
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    md_text = "\n".join(lines)
    print()
    print(md_text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "enqueue.md").write_text(md_text + "\n")
    blob = {"meta": meta, "results": results, "notes": notes}
    (args.out / "enqueue.json").write_text(json.dumps(blob, indent=1) + "\n")
    print(f"wrote {args.out / 'enqueue.md'} and {args.out / 'enqueue.json'}")
    return 0


# One fresh process: torch's own start-up (import, CUDA context, the inputs), then either
# `import cutefa` + the first call, or torch's own first attention call (SDPA, FA2 backend).
_STARTUP_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
shape, dtype, causal, which = json.loads(sys.argv[1])
q, k, v = (torch.randn(shape, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
torch.cuda.synchronize()
t1 = time.perf_counter()
if which == "cutefa":
    import cutefa
    t2 = time.perf_counter()
    out = cutefa.flash_attn_func(q, k, v, causal=causal)
    t_call = time.perf_counter()
else:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    t2 = time.perf_counter()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal)
torch.cuda.synchronize()
t3 = time.perf_counter()
report = {"torch_ms": (t1 - t0) * 1e3, "import_ms": (t2 - t1) * 1e3, "first_call_ms": (t3 - t2) * 1e3,
          "beyond_torch_ms": (t3 - t1) * 1e3,
          "dsl_imported": sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "iket"))}
if which == "cutefa":
    import importlib.util, os
    import cutefa.compile as cc
    import cutefa.loader as loader
    import cutefa.profile as prof
    report["origins"] = sorted(loader.loaded_kernels().values())
    phases = {"import cutefa": (t2 - t1) * 1e3, **prof.totals()}
    phases["synchronize"] = (t3 - t_call) * 1e3
    phases["other (validation, allocation, Python)"] = (t3 - t1) * 1e3 - sum(phases.values())
    report["phases"] = phases
    report["bytecode_cached"] = os.path.exists(importlib.util.cache_from_source(cc.__file__))
    report["tvm_ffi_imported"] = "tvm_ffi" in sys.modules
    # The first call's one-time costs against per-kernel ones: a copy of the kernel file loads as a
    # new library, so its first call pays the CUDA module load again but no process-wide set-up.
    import math, shutil, tempfile
    from pathlib import Path
    from cutefa import ffi
    so_path = next(iter(ffi._LIBRARIES))
    o, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / so_path.name
        shutil.copyfile(so_path, copy)
        t5 = time.perf_counter()
        fn = ffi.load(copy, so_path.stem)
        if cc.takes_sm_count(cc.parse_name(so_path.stem)):
            fn = loader._with_sm_count(fn)
        t6 = time.perf_counter()
        fn(q, k, v, o, lse, 1 / math.sqrt(q.shape[-1]))
        torch.cuda.synchronize()
        t7 = time.perf_counter()
        fn(q, k, v, o, lse, 1 / math.sqrt(q.shape[-1]))
        torch.cuda.synchronize()
        t8 = time.perf_counter()
    report["copy_load_module_ms"] = (t6 - t5) * 1e3
    report["copy_first_call_ms"] = (t7 - t6) * 1e3
    report["copy_second_call_ms"] = (t8 - t7) * 1e3
print(json.dumps(report))
"""


def _startup_run(which: str, problem: list, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_STARTUP_CHILD), json.dumps([*problem, which])],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{which} start-up process failed:\n{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def startup_phase_lines(runs: list[dict]) -> list[str]:
    """Markdown table of cutefa's start-up phases (CUTEFA_PROFILE=1 in the child): median per phase."""
    names: list[str] = []
    for r in runs:
        names += [n for n in r.get("phases", {}) if n not in names]
    if not names:
        return ["(no start-up phases were reported)"]
    lines = [
        (
            f"Where cutefa's time beyond torch goes (median of {len(runs)} runs, ms; CUTEFA_PROFILE=1; "
            f"bytecode cached: {sorted({str(r.get('bytecode_cached')) for r in runs})}):"
        ),
        "",
        "| phase | ms |",
        "|---|---|",
    ]
    for name in names:
        lines.append(
            f"| {name} | {statistics.median(r.get('phases', {}).get(name, 0.0) for r in runs):.2f} |"
        )
    return lines


def run_startup(args: argparse.Namespace) -> int:
    """Fresh processes timed from `import cutefa` to the first result, with the kernel from a pack
    (CUTEFA_JIT=0 and an empty cache, so nothing else can serve it), beyond torch's own start-up."""
    sh = ENQUEUE_SHAPE
    q, k, v, causal = _tiny_problem(args.dtype[0])
    pack_dir = args.pack if args.pack is not None else args.out / "pack"
    variant = ensure_pack(pack_dir, q, k, causal)
    del q, k, v
    problem = [[sh["batch"], sh["seqlen"], sh["heads"], sh["hdim"]], DTYPE_NAMES[args.dtype[0]], causal]
    runs: dict[str, list[dict]] = {"cutefa": [], "sdpa": []}
    with tempfile.TemporaryDirectory() as empty_cache:
        # PYTHONDONTWRITEBYTECODE would make every child compile cutefa's modules from source
        # again (+15-25 ms on a slow CPU): a user's process writes bytecode once.
        dropped = ("CUTE_DSL_ARCH", "PYTHONDONTWRITEBYTECODE")
        env = {key: val for key, val in os.environ.items() if key not in dropped}
        env |= {
            "CUTEFA_KERNEL_PATH": str(pack_dir.resolve()),
            "CUTEFA_JIT": "0",
            "CUTEFA_CACHE_DIR": empty_cache,
            "CUTEFA_PROFILE": "1",  # the child reports its phases (see cutefa/profile.py)
        }
        for which, timed in runs.items():
            _startup_run(which, problem, env)  # warm the OS file cache and the bytecode cache
            for _ in range(max(1, args.startup_runs)):
                timed.append(_startup_run(which, problem, env))
                print(f"{which}: {timed[-1]}", file=sys.stderr, flush=True)
    cutefa_runs = runs["cutefa"]
    problems = []
    if any(r["dsl_imported"] for r in cutefa_runs):
        problems.append(f"the DSL was imported: {cutefa_runs[0]['dsl_imported']}")
    if any(r["origins"] != [f"pack {pack_dir.resolve()}"] for r in cutefa_runs):
        problems.append(f"the kernel did not come from the pack: {cutefa_runs[0]['origins']}")

    def med(which: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[which])

    meta = environment() | {"shape": sh, "dtype": args.dtype[0], "runs": len(cutefa_runs), "variant": variant}
    lines = [
        "# Start-up: `import cutefa` to the first result from a kernel pack",
        "",
        f"GPU: {meta.get('gpu', '?')}; torch {meta['torch']}; {meta['date']}",
        (
            f"Fresh process each, median of {len(cutefa_runs)} (after one untimed warm-up run); "
            f"b={sh['batch']} s={sh['seqlen']} h={sh['heads']} d={sh['hdim']} causal, {args.dtype[0]}. "
            "torch = import torch, CUDA context and the inputs; beyond torch = from there to the first "
            f"result, synchronized. cutefa runs {variant} from the pack {pack_dir} with CUTEFA_JIT=0 "
            "and an empty cache; torch SDPA (FlashAttention-2 backend) is the same first call without cutefa."
        ),
        "",
        "| what | torch ms | import ms | first call ms | beyond torch ms |",
        "|---|---|---|---|---|",
    ]
    for which, label in (("cutefa", "cutefa from a pack"), ("sdpa", "torch SDPA (FA2)")):
        lines.append(
            f"| {label} | {med(which, 'torch_ms'):.0f} | {med(which, 'import_ms'):.1f} | "
            f"{med(which, 'first_call_ms'):.1f} | {med(which, 'beyond_torch_ms'):.1f} |"
        )
    beyond = med("cutefa", "beyond_torch_ms")
    lines += ["", f"cutefa beyond torch: {beyond:.1f} ms (goal < 50 ms)"]
    lines += ["", *startup_phase_lines(cutefa_runs)]
    if any(r.get("tvm_ffi_imported") for r in cutefa_runs):
        problems.append("the tvm_ffi package was imported (the kernel loader needs only libtvm_ffi.so)")

    def med_of(field: str) -> float:
        return statistics.median(r.get(field, math.nan) for r in cutefa_runs)

    lines += [
        "",
        (
            f"The same kernel file copied and loaded again after the first result: dlopen "
            f"{med_of('copy_load_module_ms'):.2f} ms, its first call (CUDA module load, launch, "
            f"synchronize) {med_of('copy_first_call_ms'):.2f} ms, its second call "
            f"{med_of('copy_second_call_ms'):.2f} ms. The first kernel call above minus this first "
            "call is set-up paid once per process."
        ),
    ]
    lines += [f"PROBLEM: {p}" for p in problems]
    md_text = "\n".join(lines)
    print()
    print(md_text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.md").write_text(md_text + "\n")
    blob = {"meta": meta, "runs": runs, "problems": problems, "beyond_torch_ms": beyond}
    (args.out / "startup.json").write_text(json.dumps(blob, indent=1) + "\n")
    print(f"wrote {args.out / 'startup.md'} and {args.out / 'startup.json'}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.startup:
        return run_startup(args)
    if args.enqueue:
        return run_enqueue(args)
    return run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
