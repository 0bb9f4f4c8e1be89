"""Measure the committed variants of a family on this GPU and write its dispatch table.

For every (dtype, head_dim, causal) the candidates are the family's default variants with those
fields; each is first checked against PyTorch's attention on the same inputs (a wrong kernel is
never a winner), then timed on the benchmark layout of the anchors (batch * seqlen = ``tokens``,
heads * head_dim = ``hidden``) at each sequence length. The fastest per length becomes a table
entry (schema: cutefa/tuned/README.md).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import re
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cutefa import identity
from cutefa.model.committed import default_variants
from cutefa.model.options import OAccum, Quant
from cutefa.model.rules import why_not_on
from cutefa.model.spec import VariantSpec

TOKENS = 16384
HIDDEN = 2048
# 8192 too: a table measured at 4k and 16k only gives 8k the 16k winner (an H100 table's 8k
# non-causal hd128 cell ran 7% behind FA4 on it)
DEFAULT_SEQLENS = (1024, 4096, 8192, 16384)
CHECK_TOL = 2e-2
# e4m3 (fp8) forward against float32 attention of the unquantized inputs: q, k, v and P rounded to
# 3 mantissa bits give a few percent (tests/gpu/test_fp8.py bounds its emulation by 10%).
FP8_CHECK_TOL = 1e-1
# Gradients against float32 attention: dQ, dK and dV each within this relative L2 error (bf16/fp16
# rounding of P, dS and the operands gives ~5e-3-1e-2 on random inputs).
BWD_CHECK_TOL = 5e-2


@dataclass(frozen=True)
class Measurement:
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    variant: str
    tflops: float | None  # None: the variant gave a wrong result and was not timed
    error: float


def gpu_token(device_name: str) -> str:
    """The GPU model in a device name, used in table file names: its first word of one or two capitals
    and digits ('NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA A100-SXM4-80GB' -> 'A100', 'NVIDIA H200'
    -> 'H200'), else its last word."""
    model = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", device_name)
    return model.group(1) if model else device_name.split()[-1]


def _timer() -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of a callable (triton's do_bench, else CUDA events)."""
    import torch

    try:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")
    except ImportError:

        def events(fn: Callable[[], Any]) -> float:
            for _ in range(5):
                fn()
            times = []
            for _ in range(30):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times)[len(times) // 2]

        return events


def _sdpa(q: Any, k: Any, v: Any, causal: bool, scale: float) -> Any:
    import torch
    import torch.nn.functional as F

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    mask = None
    if causal:  # bottom-right, like the kernels (equal lengths here, so also top-left)
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale).transpose(1, 2)


def measure(
    specs: list[VariantSpec], seqlens: tuple[int, ...], target: str, *, progress: bool = True, rounds: int = 1
) -> list[Measurement]:
    """Check and time every spec at every seqlen (the specs share dtype, head_dim and causal); each
    time the median of ``rounds`` samples taken in turns with the other specs."""
    import torch

    from cutefa.api.fp8 import takes_v_mean
    from cutefa.api.validate import default_scale
    from cutefa.loader import get_kernel

    timer = _timer()
    spec0 = specs[0]
    fp8 = spec0.dtype == "e4m3"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.bfloat16}[spec0.dtype]
    scale = default_scale(None, spec0.head_dim)
    heads = max(1, HIDDEN // spec0.head_dim)
    out: list[Measurement] = []
    for seqlen in seqlens:
        batch = max(1, TOKENS // seqlen)
        q, k, v = (torch.randn(batch, seqlen, heads, spec0.head_dim, device="cuda", dtype=dtype) for _ in range(3))
        expect = _sdpa(q, k, v, spec0.causal, scale).float()
        flops = 4 * batch * heads * seqlen * seqlen * spec0.head_dim / (2 if spec0.causal else 1)
        # e4m3: the inputs quantized per head, the kernel's descales after its output and lse
        inputs, descales = _fp8_inputs(q, k, v) if fp8 else ((q, k, v), ())
        candidates = []
        for spec in specs:
            kernel = get_kernel(spec, target)
            o = torch.full_like(q, math.nan)
            lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
            # a v_mean variant also takes v's column means: zeros here (the inputs are not centered)
            means = (torch.zeros(batch, heads, spec.head_dim, device="cuda"),) if takes_v_mean(spec) else ()
            run = functools.partial(kernel, *inputs, o, lse, *descales, *means, scale)
            run()
            candidates.append((spec, run, ((o.float() - expect).norm() / expect.norm()).item()))
        tol = FP8_CHECK_TOL if fp8 else CHECK_TOL
        out += _timed_if_correct(candidates, seqlen, tol, flops, timer, rounds, progress)
    return out


def _fp8_inputs(q: Any, k: Any, v: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """q, k and v quantized to e4m3 per (batch, head) (:func:`cutefa.quantize_fp8`), and their
    float32 descales, as the sm90 e4m3 forward takes them."""
    from cutefa.fp8 import quantize_fp8

    quantized = [quantize_fp8(x, "head") for x in (q, k, v)]
    return tuple(x for x, _ in quantized), tuple(d.contiguous() for _, d in quantized)


def _time_in_rounds(
    runs: list[Callable[[], Any]], rounds: int, timer: Callable[[Callable[[], Any]], float]
) -> list[float]:
    """Median milliseconds of each of ``runs``, each timed ``rounds`` times in turns (every run once
    per round, in order): a drift of clock or power during the measurement falls on all candidates
    alike instead of on whichever was timed last, and one unlucky sample does not pick the winner."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            times[i].append(timer(run))
    return [statistics.median(t) for t in times]


def _timed_if_correct(
    candidates: list[tuple[VariantSpec, Callable[[], Any], float]], seqlen: int, tol: float, flops: float,
    timer: Callable[[Callable[[], Any]], float], rounds: int, progress: bool,
) -> list[Measurement]:  # fmt: skip
    """The measurements of the (spec, run, relative error) ``candidates`` at ``seqlen``: each timed
    (:func:`_time_in_rounds`) only when its error is within ``tol`` (NaN is not), else recorded with
    no speed; printed when ``progress``."""
    correct = [i for i, (_, _, err) in enumerate(candidates) if err <= tol]
    ms = dict(zip(correct, _time_in_rounds([candidates[i][1] for i in correct], rounds, timer)))
    out = []
    for i, (spec, _, err) in enumerate(candidates):
        tflops = flops / (ms[i] * 1e-3) / 1e12 if i in ms else None
        if progress:
            shown = f"{tflops:7.1f} TFLOP/s" if tflops is not None else f"WRONG (rel err {err:.2e})"
            print(f"  seqlen {seqlen:6d}  {spec.name:52s} {shown}", flush=True)
        out.append(Measurement(spec.dtype, spec.head_dim, spec.causal, seqlen, spec.name, tflops, err))
    return out


def measure_backward(
    specs: list[VariantSpec], seqlens: tuple[int, ...], target: str, *, progress: bool = True, rounds: int = 1
) -> list[Measurement]:
    """Check and time every backward spec at every seqlen (the specs share dtype, head_dim and
    causal). Inputs, dO and the forward's out/lse are shared; each variant's dQ, dK and dV are checked
    against float32 attention's before it is timed (the median of ``rounds`` samples taken in turns).
    TFLOP/s counts 2.5x the forward's FLOPs."""
    import torch
    import torch.nn.functional as F

    from cutefa.api import backward
    from cutefa.api.attention import flash_attn_func
    from cutefa.api.validate import default_scale

    timer = _timer()
    spec0 = specs[0]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec0.dtype]
    scale = default_scale(None, spec0.head_dim)
    heads = max(1, HIDDEN // spec0.head_dim)
    out_list: list[Measurement] = []
    for seqlen in seqlens:
        batch = max(1, TOKENS // seqlen)
        q, k, v, dout = (
            torch.randn(batch, seqlen, heads, spec0.head_dim, device="cuda", dtype=dtype) for _ in range(4)
        )
        ref_in = [x.float().transpose(1, 2).requires_grad_() for x in (q, k, v)]
        ref_out = F.scaled_dot_product_attention(*ref_in, is_causal=spec0.causal, scale=scale)
        ref_out.backward(dout.float().transpose(1, 2))
        expect = [x.grad.transpose(1, 2) for x in ref_in]
        del ref_in, ref_out
        out, lse = flash_attn_func(q, k, v, causal=spec0.causal, return_lse=True)
        flops = 2.5 * 4 * batch * heads * seqlen * seqlen * spec0.head_dim / (2 if spec0.causal else 1)
        candidates = []
        for spec in specs:
            run = functools.partial(
                backward.gradients, dout, q, k, v, out, lse, None, spec0.causal, scale, False, spec=spec
            )
            grads = run()
            err = max(((g.float() - e).norm() / e.norm()).item() for g, e in zip(grads, expect))
            candidates.append((spec, run, err))
            del grads
        out_list += _timed_if_correct(candidates, seqlen, BWD_CHECK_TOL, flops, timer, rounds, progress)
    return out_list


def table_entries(measurements: list[Measurement]) -> list[dict[str, Any]]:
    """Winner per (dtype, head_dim, causal, seqlen) as dispatch-table entries.

    Each measured length L covers seqlen_k buckets up to L (rounded up to a power of two); the
    largest covers everything (``null``). Adjacent lengths with the same winner merge.

    e4m3: entries marked ``v_centered`` (for calls whose v was centered before quantization,
    flash_attn_func(v_mean=)) take the winners among the variants that add v's column means in
    their epilogue (option ``v_mean``), where a head dim and mask have such variants; the plain
    entries never name those, and where a head dim and mask have variants that accumulate O in two
    levels (``OAccum.TWO_LEVEL``) they take the winners among these only (the others lose a share
    of O that grows with the key count where V's columns carry a mean: 13% at 16k keys;
    cutefa/kernels/sm90/fp8_two_level.py, PROMOTE_BLOCKS).
    """
    from cutefa.model.spec import parse_name

    specs = {m.variant: parse_name(m.variant) for m in measurements if m.dtype == "e4m3"}
    accurate = {(s.head_dim, s.causal) for s in specs.values() if _two_level(s)}
    groups: dict[tuple[str, int, bool, bool], dict[int, Measurement]] = {}
    for m in measurements:
        if m.tflops is None:
            continue
        spec = specs.get(m.variant)
        if spec is None:
            kinds = [False]
        elif getattr(spec.options, "v_mean", False):  # the variant takes the means
            kinds = [True]
        else:
            kinds = [] if (m.head_dim, m.causal) in accurate and not _two_level(spec) else [False]
        for centered in kinds:
            best = groups.setdefault((m.dtype, m.head_dim, m.causal, centered), {})
            if m.seqlen not in best or m.tflops > best[m.seqlen].tflops:
                best[m.seqlen] = m
    entries = []
    for (dtype, head_dim, causal, centered), best in sorted(groups.items()):
        lengths = sorted(best)
        rows: list[tuple[int | None, str]] = []
        for i, seqlen in enumerate(lengths):
            bound = None if i == len(lengths) - 1 else 1 << (seqlen - 1).bit_length()
            if rows and rows[-1][1] == best[seqlen].variant:
                rows[-1] = (bound, best[seqlen].variant)
            else:
                rows.append((bound, best[seqlen].variant))
        for bound, variant in rows:
            fields = {"dtype": dtype, "head_dim": head_dim, "causal": causal, "max_seqlen_k": bound, "variant": variant}
            entries.append({**fields, "v_centered": True} if centered else fields)
    return entries


def _two_level(spec: VariantSpec) -> bool:
    """Whether ``spec`` accumulates O in two levels (an e4m3 option)."""
    return getattr(spec.options, "o_accum", None) is OAccum.TWO_LEVEL


def _git_commit() -> str:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=False,
        )
        return proc.stdout.strip() or "unknown commit"
    except OSError:
        return "unknown commit"


def tuning_candidates(
    arch: str,
    direction: str,
    dtypes: tuple[str, ...],
    head_dims: tuple[int, ...] | None,
    target: str,
    pool: list[VariantSpec] | None = None,
) -> list[VariantSpec]:
    """The variants :func:`tune` times for ``target``: those of ``pool`` (default: ``arch``'s
    committed variants; ``cutefa tune`` passes the measured alternatives too) of ``arch`` and
    ``direction`` in ``dtypes`` (and ``head_dims``, None: all) that run there, without the
    block-quantization ones (the API derives those from the pick: :mod:`cutefa.api.descales`).
    Which of the e4m3 ones a table entry may name: :func:`table_entries`."""
    pool = default_variants(arch, direction) if pool is None else pool
    specs = [
        s for s in pool
        if (s.arch, s.direction) == (arch, direction) and s.dtype in dtypes
        and getattr(s.options, "quant", Quant.TENSOR) is Quant.TENSOR
    ]  # fmt: skip
    # a table entry names a head dim, so it holds variants whose v has that head dim too
    specs = [s for s in specs if (head_dims is None or s.head_dim in head_dims) and s.head_dim_v == s.head_dim]
    return [s for s in specs if why_not_on(s, target) is None]


def tune(
    arch: str,
    *,
    out_dir: Path | None = None,
    seqlens: tuple[int, ...] = DEFAULT_SEQLENS,
    dtypes: tuple[str, ...] = ("fp16", "bf16"),
    head_dims: tuple[int, ...] | None = None,
    progress: bool = True,
    direction: str = "fwd",
    rounds: int = 1,
    pool: list[VariantSpec] | None = None,
    merge: bool = False,
    jobs: int = 1,
) -> Path:
    """Measure ``arch``'s variants of ``direction`` (:func:`tuning_candidates` of ``pool``) on this GPU;
    write the table with :func:`write_table` (into ``out_dir``, default :func:`default_table_dir`).
    Each time is the median of ``rounds`` samples, taken in turns with the other variants of its
    problem. ``merge``: fold the table into the one already at that path (:func:`merge_tables`), so
    that a GPU's table can be measured a few head dims at a time. ``jobs`` > 1: compile the
    candidates in that many processes before timing (else each compiles when first timed)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least one sample per variant")
    import torch

    from cutefa import __version__
    from cutefa.dispatch import current_target

    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU, and torch sees none")
    target = current_target()
    specs = tuning_candidates(arch, direction, dtypes, head_dims, target, pool)
    if not specs:
        raise ValueError(
            f"no default {arch} {direction} variant runs on {target} for dtypes {dtypes} and head dims {head_dims}"
        )
    if jobs > 1:
        from cutefa.compile import compile_variants

        failed = [r for r in compile_variants(specs, target=target, jobs=jobs, progress=progress) if not r.ok]
        for r in failed:  # (timing them compiles them again and records the error as a wrong result)
            print(f"compile failed: {r.spec.name}: {r.error}")
    groups: dict[tuple[str, int, bool], list[VariantSpec]] = {}
    for s in specs:
        groups.setdefault((s.dtype, s.head_dim, s.causal), []).append(s)
    measurements: list[Measurement] = []
    for key, group in sorted(groups.items()):
        if progress:
            print(
                f"{arch} {direction} {key[0]} hd{key[1]} {'causal' if key[2] else 'non-causal'}: "
                f"{len(group)} variant(s)"
            )
        timed = measure_backward if direction == "bwd" else measure
        measurements += timed(group, seqlens, target, progress=progress, rounds=rounds)
    name = torch.cuda.get_device_name()
    table = {
        "arch": arch,
        "direction": direction,
        "gpu": gpu_token(name),
        "target": target,
        "measured_on": (
            f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, cutefa {__version__} "
            f"({_git_commit()}), {datetime.date.today().isoformat()}; layout batch*seqlen={TOKENS}, "
            f"heads*head_dim={HIDDEN}, median of timed runs"
            + (f", median of {rounds} samples per variant taken in turns" if rounds > 1 else "")
        ),
        "entries": table_entries(measurements),
        "measurements": [m.__dict__ for m in measurements],
    }
    if merge:
        existing = table_path(table, out_dir)
        if existing.is_file():
            table = merge_tables(json.loads(existing.read_text()), table)
    return write_table(table, out_dir)


def _problem(row: dict[str, Any]) -> tuple[str, int, bool]:
    """(dtype, head_dim, causal) of a table entry or measurement."""
    return row["dtype"], row["head_dim"], row["causal"]


def merge_tables(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with ``new``'s measurements folded in: for every (dtype, head_dim, causal) that
    ``new`` measured, its entries and measurements replace ``old``'s; the others stay; ``measured_on``
    says what each part came from. The two must be tables of one family, direction, GPU and target
    (a ValueError names the field that differs)."""
    for key in ("arch", "direction", "gpu", "target"):
        if old.get(key, "fwd" if key == "direction" else None) != new.get(key):
            raise ValueError(f"cannot merge tables of another {key}: {old.get(key)!r} and {new.get(key)!r}")
    measured = {_problem(row) for row in [*new.get("measurements", []), *new["entries"]]}
    kept = [e for e in old["entries"] if _problem(e) not in measured]
    entries = sorted(
        kept + new["entries"],
        key=lambda e: (*_problem(e), e.get("v_centered", False),
                       math.inf if e["max_seqlen_k"] is None else e["max_seqlen_k"]),
    )  # fmt: skip
    old_measurements = [m for m in old.get("measurements", []) if _problem(m) not in measured]
    what = ", ".join(f"{d} hd{h}{' causal' if c else ''}" for d, h, c in sorted(measured))
    return {
        **old,
        "measured_on": f"{old['measured_on']}; {what}: {new['measured_on']}",
        "entries": entries,
        "measurements": old_measurements + new.get("measurements", []),
    }


def default_table_dir() -> Path:
    """Where :func:`tune` writes without ``out_dir``: ``$CUTEFA_TUNED_DIR`` (which dispatch reads
    first), else ``<cache dir>/tuned``; never the installed package."""
    return Path(os.environ.get("CUTEFA_TUNED_DIR") or identity.cache_dir() / "tuned").expanduser()


def write_table(table: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``table`` to ``<out_dir>/<arch>_<gpu>.json`` (backward: ``<arch>_bwd_<gpu>.json``;
    ``out_dir`` None: :func:`default_table_dir`) atomically: a failed write (a full disk) leaves the
    table that was there and no temp file. Returns the path."""
    path = table_path(table, out_dir)
    identity.atomic_write(path, json.dumps(table, indent=1) + "\n")
    return path


def table_path(table: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Where :func:`write_table` puts ``table``: ``<out_dir>/<arch>_[<direction>_]<gpu>.json``."""
    out_dir = default_table_dir() if out_dir is None else Path(out_dir)
    kind = "" if table["direction"] == "fwd" else f"{table['direction']}_"
    return out_dir / f"{table['arch']}_{kind}{table['gpu'].lower()}.json"
