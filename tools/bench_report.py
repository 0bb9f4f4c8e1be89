"""The benchmark's report (tools/bench.py): the markdown tables, the JSON and the plot of the grid's rows."""

import math
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_grid import MODEL_DIM, TOKENS, Result, Row

REASON_CHARS = 100  # of an n/a reason in the table (the notes give it whole)


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def short_reason(why: str | None) -> str:
    """An n/a reason as the table shows it: its first sentence, at most REASON_CHARS characters, no
    pipes."""
    text = (why or "").replace("|", "/").strip()
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def result_text(res: Result | None) -> str:
    """A backend's table entry: TFLOP/s, FAIL, err, "n/a (why)" (does not take the cell), or empty."""
    if res is None:
        return ""
    if res.status == "n/a":
        return f"n/a ({short_reason(res.error)})" if res.error else "n/a"
    return res.text()


def not_taken_notes(rows: list[Row]) -> list[str]:
    """One note per (backend, reason) of the n/a entries: the reason whole and the cells it covers."""
    cells: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        for name, res in [*row.results.items(), *row.bwd_variants.items()]:
            if res.status == "n/a":
                cells.setdefault((name, res.error or ""), []).append(row.cell.label)
    return [
        f"{name} n/a on {len(labels)} cell(s) ({labels[0]}{', ...' if len(labels) > 1 else ''}): {why}"
        for (name, why), labels in cells.items()
    ]


def markdown_table(rows: list[Row], backends: list[str]) -> str:
    head = ["pass", "dtype", "hdim", "causal", "seqlen", "b x hq/hkv", *backends, "cutefa/best", "cutefa/FA2"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        c = row.cell
        cells = [
            c.pass_,
            c.dtype,
            c.hdim_text,
            str(int(c.causal)),
            str(c.seqlen),
            f"{c.batch} x {c.heads_label}",
        ]
        cells += [result_text(row.results.get(b)) for b in backends]
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
            cells = [name, c.hdim_text, str(int(c.causal)), str(c.seqlen), result_text(res)]
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
        "Layout (batch, seqlen, heads, hdim), "
        + (
            f"batch {', '.join(map(str, meta['batches']))} (as asked)"
            if meta.get("batches")
            else f"batch x seqlen = {TOKENS}"
        )
        + f", heads = {MODEL_DIM} // hdim "
        "(of q and k, rounded down); hdim QK:V: q and k of head dim QK, v and the output of V; "
        "TFLOP/s = 2*b*h*s^2*(d_qk + d_v) / time for the forward (4*b*h*s^2*d with one head dim; "
        "2.5x that for the backward), halved when causal; median of "
        f"{meta.get('timer', 'do_bench')}"
        + (
            f", the median of {meta['rounds']} rounds in turns across backends"
            if meta.get("rounds", 1) > 1
            else ""
        )
        + (", every backend replayed from a CUDA graph captured after its check (a replay checked too)"
           if meta.get("graphs") else "")
        + ". Every backend's outputs (forward O and log-sum-exp; backward dQ, dK, dV) were checked "
        f"before timing against a float32 reference on {meta.get('slices', 'a few')} (batch, head) slices "
        "per cell, outputs NaN-poisoned, each within 3x the error of the same reference computed in the "
        "16-bit dtype: FAIL = an output outside that bar or not finite (no speed is shown); err: the "
        "backend raised (see notes); n/a (why): the backend does not take the cell, by its own "
        "library's check (not run, no bar in the plot); empty: not installed."
    )
    out += ["", markdown_table(rows, backends), ""]
    if any(row.bwd_variants for row in rows):
        out += [
            "## Backward variants",
            "",
            "Each variant checked and timed like the cutefa column, in the same turns, with the backward forced to it.",
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
                "hdim_v": c.v_dim,
                "causal": c.causal,
                "seqlen": c.seqlen,
                "batch": c.batch,
                "heads_q": c.heads,
                "heads_kv": c.kv_heads,
                "flops": c.flops,
                "cutefa_variant": row.variant,
                "results": {name: vars(r) for name, r in row.results.items()},
                "cutefa_over_best": row.ratio_best(),
                "cutefa_over_fa2": row.ratio_fa2(),
                "bwd_variants": {name: vars(r) for name, r in row.bwd_variants.items()},
            }
        )
    return {"meta": meta, "cells": cells, "notes": notes}


def plot_panels(rows: list[Row]) -> dict[tuple, list[Row]]:
    """The plot's panels: rows grouped by (pass, dtype, head dims as ``--hdim`` spells them, causal,
    heads) in order of appearance (heads "" for the MHA layout), so that a forward and a backward
    cell of one shape, two head layouts, or 192 and 192:128, never share a panel."""
    panels: dict[tuple, list[Row]] = {}
    for row in rows:
        c = row.cell
        heads = c.heads_label if c.gqa else ""
        if c.batch_ is not None:  # --batch: one panel per batch and head layout
            heads = f"{c.heads_label} b={c.batch_}"
        panels.setdefault((c.pass_, c.dtype, c.hdim_text, c.causal, heads), []).append(row)
    return panels


def panel_title(key: tuple) -> str:
    pass_, dtype, hdim, causal, *heads = key
    shown = f" h={heads[0]}" if heads and heads[0] else ""
    return f"{pass_} {dtype} hd{hdim}{shown} {'causal' if causal else 'non-causal'}"


def check_plot(path: Path) -> str | None:
    """Why ``--plot path`` cannot be drawn (matplotlib missing, not a .png name), or None."""
    import importlib.util

    if path.suffix.lower() != ".png":
        return f"{path} is not a .png file name"
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install matplotlib), so no plot can be drawn"
    return None


def plot(rows: list[Row], backends: list[str], matmul: float | None, path: Path) -> None:
    """One PNG of the grid side by side: grouped bars (one per backend, TFLOP/s) per (pass, dtype,
    hdim, causal, heads) panel, titled with the pass; FAIL and err marked in red where a bar would
    be; a backend that does not take a cell (n/a) has no bar there. RuntimeError when matplotlib is missing (:func:`check_plot` says so first) or there is no cell."""
    why = check_plot(path)
    if why:
        raise RuntimeError(f"--plot: {why}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plot_panels(rows)
    if not panels:
        raise RuntimeError("--plot: no cells to draw")
    path.parent.mkdir(parents=True, exist_ok=True)
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
                if res is not None and res.status in ("FAIL", "err"):
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
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.6 * nrows)))
    fig.savefig(path, dpi=110)
    plt.close(fig)
