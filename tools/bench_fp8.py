"""FP8 (e4m3) forward benchmark on a Hopper GPU (or a Blackwell one: the sm100 e4m3 kernels, not yet
hardware-tested): cutefa fp8 vs cutefa bf16 on the same problems ("fp8 x bf16": their ratio),
with FA4's bf16 forward (``flash_attn.cute``) and FlashAttention-3's fp8 forward
(``flash_attn_interface``) when they are installed.

Grid as in tools/bench.py: batch x seqlen = 16384 tokens, heads x head_dim = 2048, random normal
inputs quantized per head. TFLOP/s counts 4*b*h*s^2*d, halved when causal. Each fp8 result is
checked against the float32 attention of the unquantized inputs (relative L2 error shown; e4m3
inputs give a few percent, see tests/gpu/test_fp8.py).

"v_mean" columns: the same call with v centered before quantization (``cutefa.center_v``) and its
mean passed as ``flash_attn_func(..., v_mean=)``, which dispatches among the variants tuned for
centered v and adds the mean after the kernel (its time included). ``--v-offset 1`` adds 1 to v,
so that the error columns show what V's column means do to each path on long rows.
``--out DIR`` also writes the table (``bench_fp8.md``) and a plot (``bench_fp8.png``, TFLOP/s per
seqlen, one panel per head dim and mask).

    python3 tools/bench_fp8.py                        # hd 64, 128, 256; seqlen 1k..16k; causal both
    python3 tools/bench_fp8.py --hdim 128 --seqlen 4096,8192 --causal 1 --out results/

Side by side: ``--variants`` (comma-separated e4m3 variant names) or ``--all-variants`` (every
committed e4m3 variant and measured alternative, tools/alternatives.py, of the chosen head dims)
prints one table per head dim instead, one column
per variant: the kernels are called directly (no dispatch), the default e4m3 variant first, each
cell "TFLOP/s (ratio to bf16)". A name's causal twin runs the causal rows (give either one).
Block-quantization variants (``_blockq``) get the inputs quantized in blocks of their tiles; their
time is the kernel's alone (flash_attn_func adds a few small torch ops that build its scale
arguments).

    python3 tools/bench_fp8.py --all-variants --hdim 128,256 --seqlen 4096,16384
    python3 tools/bench_fp8.py --hdim 128 --variants cutefa_sm90_fwd_e4m3_hd128_128x128_s3_w12_ov_pp
"""

import argparse
import importlib.util
import math
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # tools/alternatives.py, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

TOKENS = 16384
MODEL_DIM = 2048
# A variant's output must match the float32 attention of the unquantized inputs this closely
# (relative L2) before it is timed; the e4m3 defaults give 2-4% on these inputs.
MAX_REL_ERR = 0.10


def _load_bench():
    path = Path(__file__).with_name("bench_backends.py")
    spec = importlib.util.spec_from_file_location("cutefa_tools_bench_backends", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--hdim", type=_ints, default=None, help="head dims (default 64,128,256; with variants: theirs)"
    )
    p.add_argument("--seqlen", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", type=_ints, default=[0, 1])
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument(
        "--v-offset", type=float, default=0.0, help="added to v's random normal values (default 0)"
    )
    p.add_argument("--out", type=Path, default=None, help="folder for bench_fp8.md and bench_fp8.png")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--variants", type=_names, default=None, help="e4m3 variant names, comma-separated")
    group.add_argument("--all-variants", action="store_true", help="every committed e4m3 variant")
    args = p.parse_args(argv)

    if args.variants is not None or args.all_variants:
        return _side_by_side(args)
    import torch

    import cutefa

    try:
        from flash_attn_interface import flash_attn_func as fa3
    except ImportError:
        fa3 = None
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        fa4 = None
    _, time_ms = _load_bench().make_timer(args.warmup, args.rep)
    header = [
        "hdim",
        "causal",
        "seqlen",
        "b x h",
        "bf16 TFLOP/s",
        "FA4 bf16 TFLOP/s",
        "fp8 TFLOP/s",
        "fp8 x bf16",
        "fp8 rel err",
        "fp8 v_mean TFLOP/s",
        "v_mean x bf16",
        "v_mean rel err",
        "FA3 fp8 TFLOP/s",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    print("\n".join(lines))
    rows = []
    for hdim in args.hdim or [64, 128, 256]:
        for causal in map(bool, args.causal):
            for seqlen in args.seqlen:
                cells = _cell(torch, cutefa, fa3, fa4, time_ms, hdim, causal, seqlen, args.v_offset)
                rows.append(cells)
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_fp8.md").write_text("\n".join(lines) + "\n")
        print(plot(header, rows, args.out / "bench_fp8.png"))
    return 0


PLOTTED = ("bf16 TFLOP/s", "FA4 bf16 TFLOP/s", "fp8 TFLOP/s", "fp8 v_mean TFLOP/s", "FA3 fp8 TFLOP/s")


def plot(header: list[str], rows: list[list[str]], path: Path) -> str:
    """TFLOP/s against seqlen, one panel per (hdim, causal), one line per numeric column of
    :data:`PLOTTED`; returns what was written (or why nothing was)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    panels: dict[tuple[str, str], list[list[str]]] = {}
    for row in rows:
        panels.setdefault((row[0], row[1]), []).append(row)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, ((hdim, causal), cells) in zip(axes[0], panels.items()):
        seqlens = [int(r[2]) for r in cells]
        for name in PLOTTED:
            i = header.index(name)
            points = [(x, float(r[i])) for x, r in zip(seqlens, cells) if _number(r[i])]
            if points:
                ax.plot(*zip(*points), marker="o", label=name.removesuffix(" TFLOP/s"))
        ax.set_xscale("log", base=2)
        ax.set_title(f"hd{hdim} {'causal' if causal == '1' else 'non-causal'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _problem(torch, cutefa, hdim: int, causal: bool, seqlen: int, v_offset: float = 0.0):
    heads = MODEL_DIM // hdim
    batch = max(1, TOKENS // seqlen)
    shape = (batch, seqlen, heads, hdim)
    q, k, v = (torch.randn(shape, device="cuda") for _ in range(3))
    v += v_offset
    flops = 4 * batch * heads * seqlen * seqlen * hdim / (2 if causal else 1)
    return q, k, v, flops


def _reference(torch, q, k, v, causal: bool):
    return torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal
    ).transpose(1, 2)  # float32; seqlen_q == seqlen_k, so top-left causal = bottom-right


def _cell(
    torch, cutefa, fa3, fa4, time_ms, hdim: int, causal: bool, seqlen: int, v_offset: float = 0.0
) -> list[str]:
    q, k, v, flops = _problem(torch, cutefa, hdim, causal, seqlen, v_offset)
    batch, heads = q.shape[0], q.shape[2]
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    (qq, qd), (kq, kd), (vq, vd) = (cutefa.quantize_fp8(x, "head") for x in (q, k, v))
    kw = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    cells = [str(hdim), str(int(causal)), str(seqlen), f"{batch} x {heads}"]
    bf16_ms = time_ms(lambda: cutefa.flash_attn_func(qb, kb, vb, causal=causal))
    cells.append(f"{flops / bf16_ms / 1e9:.0f}")
    if fa4 is None:
        cells.append("-")
    else:
        try:
            cells.append(f"{flops / time_ms(lambda: fa4(qb, kb, vb, causal=causal)) / 1e9:.0f}")
        except Exception as exc:  # noqa: BLE001 - shown in the table
            cells.append(f"err: {str(exc).splitlines()[0][:40]}")
    out = cutefa.flash_attn_func(qq, kq, vq, causal=causal, **kw)
    ref = _reference(torch, q, k, v, causal)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ms = time_ms(lambda: cutefa.flash_attn_func(qq, kq, vq, causal=causal, **kw))
    cells += [f"{flops / ms / 1e9:.0f}", f"{bf16_ms / ms:.2f}", f"{err:.4f}"]
    centered, v_mean = cutefa.center_v(v)
    vc, vcd = cutefa.quantize_fp8(centered, "head")
    kwc = {**kw, "v_descale": vcd, "v_mean": v_mean}
    out = cutefa.flash_attn_func(qq, kq, vc, causal=causal, **kwc)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ms = time_ms(lambda: cutefa.flash_attn_func(qq, kq, vc, causal=causal, **kwc))
    cells += [f"{flops / ms / 1e9:.0f}", f"{bf16_ms / ms:.2f}", f"{err:.4f}"]
    if fa3 is None:
        return [*cells, "-"]
    try:
        ms = time_ms(lambda: fa3(qq, kq, vq, causal=causal, **kw))
    except Exception as exc:  # noqa: BLE001 - shown in the table
        return [*cells, f"err: {str(exc).splitlines()[0][:40]}"]
    return [*cells, f"{flops / ms / 1e9:.0f}"]


def variant_columns(names: list[str] | None, hdims: list[int] | None) -> dict[int, list]:
    """head_dim -> the non-causal specs to show as columns, default e4m3 variant first.

    ``names`` None means every e4m3 variant of ``hdims`` (all head dims when None): the committed
    ones and the measured alternatives. Raises ValueError for a name that is not an e4m3 variant of
    the sm90 family or fails :func:`cutefa.model.rules.why_invalid`."""
    from alternatives import all_variants

    from cutefa.model.defaults import default_spec
    from cutefa.model.rules import why_invalid
    from cutefa.model.spec import parse_name

    if names is None:
        specs = [s for s in all_variants("sm90", "fwd") if s.dtype == "e4m3"]
        specs = [s for s in specs if hdims is None or s.head_dim in hdims]
    else:
        specs = []
        for name in names:
            spec = parse_name(name)
            if (spec.arch, spec.direction, spec.dtype) != ("sm90", "fwd", "e4m3"):
                raise ValueError(f"--variants: {name!r} is not an sm90 e4m3 forward variant")
            reason = why_invalid(spec)
            if reason is not None:
                raise ValueError(f"--variants: {name!r} cannot be built: {reason}")
            specs.append(spec)
    columns: dict[int, list] = {}
    for spec in specs:
        base = spec.replace(causal=False)
        if hdims is not None and base.head_dim not in hdims:
            continue
        default = default_spec("sm90", "fwd", "e4m3", base.head_dim)  # dispatch's, per-head descales
        cols = columns.setdefault(base.head_dim, [default])
        if base not in cols:
            cols.append(base)
    return columns


def _label(spec) -> str:
    short = spec.name.removeprefix(f"cutefa_{spec.arch}_fwd_e4m3_hd{spec.head_dim}_")
    return short


def _variant_row(torch, cutefa, get_kernel, target, time_ms, specs, hdim: int, causal: bool, seqlen: int):
    """One table row: bf16 through flash_attn_func, then each e4m3 variant called directly."""
    q, k, v, flops = _problem(torch, cutefa, hdim, causal, seqlen)
    batch, heads = q.shape[0], q.shape[2]
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    bf16 = flops / time_ms(lambda: cutefa.flash_attn_func(qb, kb, vb, causal=causal)) / 1e9
    (qq, qd), (kq, kd), (vq, vd) = (cutefa.quantize_fp8(x, "head") for x in (q, k, v))
    blocks = {}  # (tile_m, tile_n) -> (e4m3 q, k, v, descales) quantized in those blocks
    ref = _reference(torch, q, k, v, causal)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device="cuda")
    scale = 1.0 / math.sqrt(hdim)
    row = [str(int(causal)), str(seqlen), f"{batch} x {heads}", f"{bf16:.0f}"]
    from cutefa.model.options import Quant
    from cutefa.model.rules import why_invalid

    for spec in specs:
        if why_invalid(spec.replace(causal=causal)) is not None:
            row.append("-")  # a variant without this mask
            continue
        try:
            kernel = get_kernel(spec.replace(causal=causal), target)
            inputs = (qq, kq, vq)
            args = (qd, kd, vd)
            if spec.options.quant is Quant.BLOCK:
                inputs, args = _block_arguments(cutefa, blocks, q, k, v, spec.replace(causal=causal), target)
            elif spec.options.v_mean:  # v is not centered here: zero means (the epilogue's FFMAs still run)
                args = (*args, torch.zeros(batch, heads, hdim, device="cuda"))

            def run(kernel=kernel, inputs=inputs, args=args):
                kernel(*inputs, out, lse, *args, scale)

            out.fill_(math.nan)
            run()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err <= MAX_REL_ERR:
                row.append(f"WRONG (rel err {err:.3f})")
                continue
            tflops = flops / time_ms(run) / 1e9
            row.append(f"{tflops:.0f} ({tflops / bf16:.2f})")
        except Exception as exc:  # noqa: BLE001 - shown in the table
            row.append(f"err: {str(exc).splitlines()[0][:40]}")
    return row


def _block_arguments(cutefa, blocks: dict, q, k, v, spec, target: str):
    """(e4m3 q, k, v) quantized in blocks of ``spec``'s tiles and the _blockq kernel's descale
    arguments (built as flash_attn_func builds them)."""
    from cutefa import dispatch
    from cutefa.api.descales import kernel_args
    from cutefa.model.options import Quant

    tiles = (spec.tile_m, spec.tile_n)
    if tiles not in blocks:
        blocks[tiles] = tuple(
            cutefa.quantize_fp8(x, "block", block=b) for x, b in zip((q, k, v), (*tiles, tiles[1]))
        )
    (qq, qd), (kq, kd), (vq, vd) = blocks[tiles]
    twin = dispatch.Choice(spec.replace(quant=Quant.TENSOR), target, "bench")
    _, args = kernel_args(qq, kq, (qd, kd, vd), twin)
    return (qq, kq, vq), args


def _side_by_side(args) -> int:
    import torch

    import cutefa
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel

    columns = variant_columns(args.variants if not args.all_variants else None, args.hdim)
    if not columns:
        print("no e4m3 variant matches the given head dims", file=sys.stderr)
        return 2
    _, time_ms = _load_bench().make_timer(args.warmup, args.rep)
    target = current_target()
    for hdim, specs in sorted(columns.items()):
        print(f"\nhead_dim {hdim}: TFLOP/s (x bf16); first fp8 column is the default variant\n")
        header = ["causal", "seqlen", "b x h", "bf16", *(_label(s) for s in specs)]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for causal in map(bool, args.causal):
            for seqlen in args.seqlen:
                row = _variant_row(torch, cutefa, get_kernel, target, time_ms, specs, hdim, causal, seqlen)
                print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
