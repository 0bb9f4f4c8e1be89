"""The benchmark's report (tools/bench.py): the markdown tables, the JSON and the plot of the grid's rows."""

import math
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_grid import MODEL_DIM, TOKENS, Row


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
