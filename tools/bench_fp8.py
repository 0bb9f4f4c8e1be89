"""FP8 (e4m3) forward benchmark on a Hopper GPU (or a Blackwell one: the sm100 e4m3 kernels, not yet
hardware-tested): cutefa fp8 vs cutefa bf16 on the same problems ("fp8 x bf16": their ratio),
with FA4's bf16 forward (``flash_attn.cute``) and FlashAttention-3's fp8 forward
(``flash_attn_interface``) when they are installed.

Grid as in tools/bench.py: batch x seqlen = 16384 tokens, heads x head_dim = 2048, random normal
inputs quantized per head. TFLOP/s counts 4*b*h*s^2*d, halved when causal. Every column is checked
before it is timed and timed the same way (tools/bench_run.py): its library's forward call (which
allocates the outputs) with the outputs NaN-poisoned for the checked call, then all columns of a row
in turns for ``--rounds`` rounds (default 3), the median kept. The check (tools/bench_check.py) holds
the output and its log-sum-exp, on a sample of (batch, head) slices, to the float32 attention of the
inputs the call was given: the bf16 inputs for the bf16 columns, the dequantized e4m3 inputs for the
fp8 ones; the bar is 3x the error of the same reference computed in low precision (bf16 matmuls;
for e4m3, P times 2^8 rounded to e4m3 for P V and its row sums). A column that fails prints FAIL and
no speed. The "rel err" columns are the sampled output's relative L2 error against the float32
attention of the unquantized inputs (what quantization costs; e4m3 inputs give a few percent, see
tests/gpu/test_fp8.py).

"v_mean" columns: the same call with v centered before quantization (``cutefa.center_v``) and its
mean passed as ``flash_attn_func(..., v_mean=)``, which dispatches among the variants tuned for
centered v and adds the mean after the kernel (its time included). ``--v-offset 1`` adds 1 to v,
so that the error columns show what V's column means do to each path on long rows (a kernel
without two-level accumulation may then fail its check on long rows: that is the defect the
check is there to show).
``--out DIR`` also writes the table (``bench_fp8.md``) and a plot (``bench_fp8.png``, TFLOP/s per
seqlen, one panel per head dim and mask).

    python3 tools/bench_fp8.py                        # hd 64, 128, 256; seqlen 1k..16k; causal both
    python3 tools/bench_fp8.py --hdim 128 --seqlen 4096,8192 --causal 1 --out results/

Side by side: ``--variants`` (comma-separated e4m3 variant names) or ``--all-variants`` (every
committed e4m3 variant and measured alternative, tools/alternatives.py, of the chosen head dims)
prints one table per head dim instead, one column per variant: every column a kernel called
directly with its outputs allocated beforehand (no dispatch), the bf16 column dispatch's bf16
kernel, then the default e4m3 variant, each cell "TFLOP/s (ratio to bf16)", each checked first as
above. A name's causal twin runs the causal rows (give either one). Block-quantization variants
(``_blockq``) get the inputs quantized in blocks of their tiles (and are checked against those
dequantized inputs); their time is the kernel's alone (flash_attn_func adds a few small torch ops
that build its scale arguments).

    python3 tools/bench_fp8.py --all-variants --hdim 128,256 --seqlen 4096,16384
    python3 tools/bench_fp8.py --hdim 128 --variants cutefa_sm90_fwd_e4m3_hd128_128x128_s3_w12_ov_pp
"""

import argparse
import math
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # tools/alternatives.py, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

TOKENS = 16384
MODEL_DIM = 2048


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--hdim", type=_ints, default=None, help="head dims (default 64,128,256; with variants: theirs)"
    )
    p.add_argument("--seqlen", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", type=_ints, default=[0, 1])
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds, every column in turns (default 3)")
    p.add_argument("--slices", type=int, default=3, help="(batch, head) slices checked per row (default 3)")
    p.add_argument(
        "--v-offset", type=float, default=0.0, help="added to v's random normal values (default 0)"
    )
    p.add_argument("--out", type=Path, default=None, help="folder for bench_fp8.md and bench_fp8.png")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--variants", type=_names, default=None, help="e4m3 variant names, comma-separated")
    group.add_argument("--all-variants", action="store_true", help="every committed e4m3 variant")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


HEADER = [
    "hdim", "causal", "seqlen", "b x h", "bf16 TFLOP/s", "FA4 bf16 TFLOP/s", "fp8 TFLOP/s", "fp8 x bf16",
    "fp8 rel err", "fp8 v_mean TFLOP/s", "v_mean x bf16", "v_mean rel err", "FA3 fp8 TFLOP/s",
]  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.variants is not None or args.all_variants:
        return _side_by_side(args)
    import torch
    from bench_backends import make_timer

    import cutefa

    if not torch.cuda.is_available():
        print("bench_fp8.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        from flash_attn_interface import flash_attn_func as fa3
    except ImportError:
        fa3 = None
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        fa4 = None
    _, time_ms = make_timer(args.warmup, args.rep)
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    print("\n".join(lines))
    rows, notes = [], []
    for hdim in args.hdim or [64, 128, 256]:
        for causal in map(bool, args.causal):
            for seqlen in args.seqlen:
                cells, cell_notes = _cell(torch, cutefa, fa3, fa4, time_ms, hdim, causal, seqlen, args)
                rows.append(cells)
                notes += cell_notes
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
        print("\n".join(lines[-len(notes) - 1 :]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_fp8.md").write_text("\n".join(lines) + "\n")
        print(plot(HEADER, rows, args.out / "bench_fp8.png"))
    return 1 if any(n.startswith("cutefa") and ": FAIL" in n for n in notes) else 0


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


def _problem(torch, hdim: int, causal: bool, seqlen: int, v_offset: float = 0.0):
    heads = MODEL_DIM // hdim
    batch = max(1, TOKENS // seqlen)
    shape = (batch, seqlen, heads, hdim)
    gen = torch.Generator(device="cuda").manual_seed(hdim * 1_000_003 + seqlen * 2 + int(causal))
    q, k, v = (torch.randn(shape, generator=gen, device="cuda") for _ in range(3))
    v += v_offset
    flops = 4 * batch * heads * seqlen * seqlen * hdim / (2 if causal else 1)
    return q, k, v, flops


def _expectations(torch, cutefa, q, k, v, causal: bool, slices: int):
    """The checks of one row: ``bf16`` (the bf16 inputs), ``fp8`` (the per-head quantized inputs,
    dequantized), ``v_mean`` (centered v quantized, plus its mean), ``exact`` (the unquantized
    float32 inputs: the rel err columns), and the quantized inputs themselves."""
    import bench_check

    from cutefa.fp8 import dequantize_fp8

    scale = 1.0 / math.sqrt(q.shape[-1])
    bf16 = [x.bfloat16() for x in (q, k, v)]
    quant = [cutefa.quantize_fp8(x, "head") for x in (q, k, v)]
    centered, v_mean = cutefa.center_v(v)
    vc = cutefa.quantize_fp8(centered, "head")
    deq = [dequantize_fp8(x, d) for x, d in quant]
    e4m3 = {
        "low_dtype": torch.float32, "p_round": bench_check.round_e4m3, "out_dtype": torch.bfloat16,
        "score_eps": bench_check.E4M3_SCORE_EPS,
    }  # fmt: skip
    common = {"causal": causal, "scale": scale, "slices": slices}
    return {
        "bf16": bench_check.expectation(*bf16, **common),
        "fp8": bench_check.expectation(*deq, **common, **e4m3),
        "v_mean": bench_check.expectation(
            deq[0], deq[1], dequantize_fp8(*vc) + v_mean[:, None], **common, **e4m3
        ),
        "exact": bench_check.expectation(q, k, v, **common, low_dtype=torch.float32),
        "inputs": (bf16, quant, vc, v_mean),
    }


def _judge(expect, exact=None, info=None, key=None):
    """A judge of (out, lse)-like results against ``expect``; with ``exact`` it also records, under
    ``info[key]``, the sampled output's relative L2 error against the unquantized attention."""
    import bench_backends
    import bench_check

    def judge(raw):
        out, lse = bench_backends.pair(raw)
        b, s, h = out.shape[:3]
        outputs = (out, bench_backends.canonical_lse(lse, b, h, s))
        if exact is not None:
            info[key] = bench_check.rel_l2(expect.sample(outputs)["O"], exact.expect["O"])
        return expect.judge(outputs)

    return judge


def _cell(
    torch, cutefa, fa3, fa4, time_ms, hdim: int, causal: bool, seqlen: int, args
) -> tuple[list[str], list[str]]:
    """One row of the main table (and its notes): every column checked, then timed in turns."""
    from bench_run import Entry, run_entries

    q, k, v, flops = _problem(torch, hdim, causal, seqlen, args.v_offset)
    batch, heads = q.shape[0], q.shape[2]
    ex = _expectations(torch, cutefa, q, k, v, causal, args.slices)
    (qb, kb, vb), ((qq, qd), (kq, kd), (vq, vd)), (vc, vcd), v_mean = ex["inputs"]
    kw = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    kwc = {**kw, "v_descale": vcd, "v_mean": v_mean}
    info: dict = {}
    f = cutefa.flash_attn_func
    entries = [
        Entry("bf16", lambda: lambda: f(qb, kb, vb, causal=causal, return_lse=True), _judge(ex["bf16"])),
        Entry("FA4 bf16", None if fa4 is None else lambda: lambda: fa4(qb, kb, vb, causal=causal, **_lse_kw(fa4)),
              _judge(ex["bf16"]), missing="FA4 not installed"),
        Entry("fp8", lambda: lambda: f(qq, kq, vq, causal=causal, return_lse=True, **kw),
              _judge(ex["fp8"], ex["exact"], info, "fp8")),
        Entry("fp8 v_mean", lambda: lambda: f(qq, kq, vc, causal=causal, return_lse=True, **kwc),
              _judge(ex["v_mean"], ex["exact"], info, "v_mean")),
        Entry("FA3 fp8", None if fa3 is None else lambda: lambda: fa3(qq, kq, vq, causal=causal, **kw),
              _judge(ex["fp8"]), missing="FA3 not installed"),
    ]  # fmt: skip
    res = run_entries(entries, time_ms, args.rounds)

    def speed(name: str) -> str:
        r = res[name]
        if r.status == "ok":
            return f"{flops / r.ms / 1e9:.0f}"
        return "-" if r.status == "missing" else r.status

    def ratio(name: str) -> str:
        r, base = res[name], res["bf16"]
        return f"{base.ms / r.ms:.2f}" if r.status == base.status == "ok" else ""

    def err(name: str) -> str:
        return f"{info[name]:.4f}" if name in info else ""

    cells = [str(hdim), str(int(causal)), str(seqlen), f"{batch} x {heads}", speed("bf16"), speed("FA4 bf16"),
             speed("fp8"), ratio("fp8"), err("fp8"), speed("fp8 v_mean"), ratio("fp8 v_mean"), err("v_mean"),
             speed("FA3 fp8")]  # fmt: skip
    label = f"hd{hdim} causal={int(causal)} s={seqlen}"
    notes = [f"{'cutefa ' if n in ('bf16', 'fp8', 'fp8 v_mean') else ''}{n} {label}: {r.status}: {r.error}"
             for n, r in res.items() if r.status in ("FAIL", "err")]  # fmt: skip
    return cells, notes


def _lse_kw(fn) -> dict:
    """``{"return_lse": True}`` where ``fn`` takes it (FA4's flash_attn_func), else nothing."""
    import inspect

    try:
        return {"return_lse": True} if "return_lse" in inspect.signature(fn).parameters else {}
    except (TypeError, ValueError):
        return {}


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


def _variant_row(
    torch, cutefa, get_kernel, target, time_ms, specs, hdim: int, causal: bool, seqlen: int, args
):
    """One table row: dispatch's bf16 kernel, then each e4m3 variant, every one called directly with
    its outputs allocated beforehand, checked, then timed in turns."""
    from bench_run import Entry, Preallocated, run_entries

    from cutefa.api.launch import choose
    from cutefa.model.options import Quant
    from cutefa.model.rules import why_invalid

    q, k, v, flops = _problem(torch, hdim, causal, seqlen)
    batch, heads = q.shape[0], q.shape[2]
    ex = _expectations(torch, cutefa, q, k, v, causal, args.slices)
    (qb, kb, vb), ((qq, qd), (kq, kd), (vq, vd)), _, _ = ex["inputs"]
    scale = 1.0 / math.sqrt(hdim)

    def outputs(dtype=torch.bfloat16):
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        return out, torch.empty((batch, heads, seqlen), dtype=torch.float32, device=q.device)

    def bf16_call():
        choice = choose(qb, kb, causal)
        kernel = get_kernel(choice.spec, choice.target)
        out, lse = outputs()
        return Preallocated(lambda: kernel(qb, kb, vb, out, lse, scale), (out, lse))

    entries = [Entry("bf16", bf16_call, _judge(ex["bf16"]))]
    blocks: dict = {}  # (tile_m, tile_n) -> (inputs, kernel arguments, expectation)
    for spec in specs:
        twin = spec.replace(causal=causal)
        label = _label(spec)
        if why_invalid(twin) is not None:
            entries.append(Entry(label, None, _judge(ex["fp8"]), missing="-"))  # a variant without this mask
            continue
        expect = ex["fp8"]
        inputs, extra = (qq, kq, vq), (qd, kd, vd)
        if spec.options.quant is Quant.BLOCK:
            inputs, extra, expect = _block_arguments(
                torch, cutefa, blocks, q, k, v, twin, target, causal, args.slices
            )
        elif spec.options.v_mean:  # v is not centered here: zero means (the epilogue's FFMAs still run)
            extra = (*extra, torch.zeros(batch, heads, hdim, device=q.device))

        def make(twin=twin, inputs=inputs, extra=extra):
            kernel = get_kernel(twin, target)
            out, lse = outputs()
            return Preallocated(lambda: kernel(*inputs, out, lse, *extra, scale), (out, lse))

        entries.append(Entry(label, make, _judge(expect)))
    res = run_entries(entries, time_ms, args.rounds)
    base = res["bf16"]
    row = [str(int(causal)), str(seqlen), f"{batch} x {heads}",
           f"{flops / base.ms / 1e9:.0f}" if base.status == "ok" else base.status]  # fmt: skip
    for entry in entries[1:]:
        r = res[entry.name]
        if r.status == "ok":
            tflops = flops / r.ms / 1e9
            row.append(f"{tflops:.0f}" + (f" ({base.ms / r.ms:.2f})" if base.status == "ok" else ""))
        else:
            row.append("-" if r.status == "missing" else f"{r.status}: {(r.error or '')[:60]}")
    return row


def _block_arguments(torch, cutefa, blocks: dict, q, k, v, spec, target: str, causal: bool, slices: int):
    """(e4m3 q, k, v) quantized in blocks of ``spec``'s tiles, the _blockq kernel's descale
    arguments (built as flash_attn_func builds them) and the expectation of those dequantized inputs."""
    import bench_check

    from cutefa import dispatch
    from cutefa.api.descales import kernel_args
    from cutefa.fp8 import dequantize_fp8
    from cutefa.model.options import Quant

    tiles = (spec.tile_m, spec.tile_n)
    if tiles not in blocks:
        sizes = (*tiles, tiles[1])
        quant = tuple(cutefa.quantize_fp8(x, "block", block=b) for x, b in zip((q, k, v), sizes))
        deq = [dequantize_fp8(x, d, block=b) for (x, d), b in zip(quant, sizes)]
        expect = bench_check.expectation(
            *deq, causal=causal, scale=1.0 / math.sqrt(q.shape[-1]), slices=slices, low_dtype=torch.float32,
            p_round=bench_check.round_e4m3, out_dtype=torch.bfloat16, score_eps=bench_check.E4M3_SCORE_EPS,
        )  # fmt: skip
        blocks[tiles] = (quant, expect)
    ((qq, qd), (kq, kd), (vq, vd)), expect = blocks[tiles]
    twin = dispatch.Choice(spec.replace(quant=Quant.TENSOR), target, "bench")
    _, args = kernel_args(qq, kq, (qd, kd, vd), twin)
    return (qq, kq, vq), args, expect


def _side_by_side(args) -> int:
    import torch
    from bench_backends import make_timer

    import cutefa
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel

    columns = variant_columns(args.variants if not args.all_variants else None, args.hdim)
    if not columns:
        print("no e4m3 variant matches the given head dims", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_fp8.py needs a CUDA GPU", file=sys.stderr)
        return 2
    _, time_ms = make_timer(args.warmup, args.rep)
    target = current_target()
    failed = False
    for hdim, specs in sorted(columns.items()):
        print(
            f"\nhead_dim {hdim}: TFLOP/s (x bf16); first fp8 column is the default variant; each checked first\n"
        )
        header = ["causal", "seqlen", "b x h", "bf16", *(_label(s) for s in specs)]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for causal in map(bool, args.causal):
            for seqlen in args.seqlen:
                row = _variant_row(
                    torch, cutefa, get_kernel, target, time_ms, specs, hdim, causal, seqlen, args
                )
                failed |= any(cell.startswith("FAIL") for cell in row)
                print("| " + " | ".join(row) + " |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
