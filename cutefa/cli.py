"""The ``cutefa`` command: list, generate, compile (:mod:`cutefa.cli_compile`), show, explain, bench, tune."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from cutefa import __version__, cli_compile, cli_doctor, codegen
from cutefa.cli_common import UsageError, positive_int, print_table, spec_from_argument
from cutefa.identity import SOURCE_CHECKOUT
from cutefa.model import committed, rules
from cutefa.model.options import Choice, Options
from cutefa.model.spec import (
    ARCHS,
    DIRECTIONS,
    DTYPES,
    TARGETS,
    Features,
    VariantSpec,
    target_for_capability,
)
from cutefa.selection import name_matches
from cutefa.tune import DEFAULT_SEQLENS as TUNE_SEQLENS

# Hardware evidence per kernel family, shown next to valid variants.
HARDWARE_STATUS: dict[str, str] = {
    "sm80": "hardware-tested on H200 (sm_90a)",
    "sm100": "compiled, not hardware-tested",
}

BENCH_SCRIPT = codegen.REPO_ROOT / "tools" / "bench.py"
ALTERNATIVES_SCRIPT = codegen.REPO_ROOT / "tools" / "alternatives.py"
SHAPE_FIELDS = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim")


# ---------------------------------------------------------------- selection helpers


def _select(specs: Sequence[VariantSpec], pattern: str | None) -> list[VariantSpec]:
    """``specs`` whose names match ``pattern``; a pattern matching nothing is a user error."""
    if pattern is None:
        return list(specs)
    chosen = [spec for spec in specs if name_matches(spec.name, pattern)]
    if not chosen:
        raise UsageError(f"--kernels {pattern!r} matches none of the {len(specs)} variants considered")
    return chosen


def _archs(arch: str | None) -> tuple[str, ...]:
    return ARCHS if arch is None else (arch,)


def _default_set(arch: str | None) -> list[VariantSpec]:
    return [spec for a in _archs(arch) for spec in committed.default_variants(a)]


def _status(spec: VariantSpec) -> str:
    reason = rules.why_invalid(spec)
    if reason is not None:
        return reason
    note = HARDWARE_STATUS.get(spec.arch)
    return f"ok ({note})" if note else "ok"


def _regs_text(spec: VariantSpec) -> str:
    regs = rules.est_registers(spec)
    return "-" if regs is None else str(regs)


# ---------------------------------------------------------------- subcommands


def _cmd_list(args: argparse.Namespace) -> int:
    if args.all:
        specs = [s for a in _archs(args.arch) for s in rules.valid_variants(a, args.direction)]
    elif args.invalid:
        specs = [
            s
            for a in _archs(args.arch)
            for s in committed.candidates(a, args.direction)
            if rules.why_invalid(s)
        ]
    else:
        specs = _default_set(args.arch)
    rows = [
        (s.name, f"{rules.smem_bytes(s) / 1024:.1f}", _regs_text(s), _status(s))
        for s in _select(specs, args.kernels)
    ]
    print_table(("name", "smem KiB", "est regs", "status"), rows)
    print(f"{len(rows)} variant(s)")
    return 0


def _all_variants(arch: str | None) -> list[VariantSpec]:
    """Every variant worth reviewing: the committed set and the measured alternatives, whose lists
    live with the tools that measure them (``tools/alternatives.py``: ``all_variants``). Without a
    source checkout, every valid variant of the candidate grid (a superset, much larger)."""
    if ALTERNATIVES_SCRIPT.is_file():
        module_spec = importlib.util.spec_from_file_location("cutefa_alternatives", ALTERNATIVES_SCRIPT)
        tool = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = tool  # dataclasses look their module up while the file runs
        module_spec.loader.exec_module(tool)
        return tool.all_variants(arch)
    print(f"{ALTERNATIVES_SCRIPT} is not here: rendering every valid variant of the grid", file=sys.stderr)
    specs = {
        s
        for a in _archs(arch)
        for d in DIRECTIONS
        for s in (*rules.valid_variants(a, d), *committed.default_variants(a, d))
    }
    return sorted(specs)


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.out_dir is None:
        raise UsageError("an installed cutefa has no generated/ folder: give --out DIR")
    if args.all and args.out_dir.resolve() == codegen.GENERATED_DIR.resolve():
        raise UsageError(
            "--all renders every valid variant, measured alternatives included, for review: give --out DIR "
            f"({codegen.GENERATED_DIR} holds what dispatch runs)"
        )
    specs = _select(_all_variants(args.arch) if args.all else _default_set(args.arch), args.kernels)
    complete = args.arch is None and args.kernels is None
    options = {"complete": complete, "templates_dir": args.templates_dir}
    if args.check:
        diffs = codegen.check(specs, args.out_dir, **options)
        for line in diffs:
            print(line)
        if diffs:
            print(f"{args.out_dir} is out of date ({len(diffs)} difference(s)); run `cutefa generate`")
            return 1
        print(f"{args.out_dir} is up to date ({len(specs)} variants)")
        return 0
    touched = codegen.generate(specs, args.out_dir, **options)
    removed = sum(not path.exists() for path in touched)
    scope = "" if complete else "; filtered, so stale modules were kept"
    print(
        f"generated {len(specs)} variants into {args.out_dir}: "
        f"{len(touched) - removed} file(s) written, {removed} removed{scope}"
    )
    return 0


def _field_text(value: object) -> str:
    """A spec field as ``cutefa show`` prints it: enum members and records by their values."""
    if isinstance(value, Choice):
        return value.name.lower()
    if isinstance(value, Features):
        return ", ".join(value.tokens) or "none"
    if isinstance(value, Options):
        fields = dataclasses.fields(value)
        return (
            f"{type(value).__name__}("
            + ", ".join(f"{f.name}={_field_text(getattr(value, f.name))}" for f in fields)
            + ")"
        )
    return str(value)


def _cmd_show(args: argparse.Namespace) -> int:
    spec = spec_from_argument(args.name)
    path = None if args.out_dir is None else codegen.module_path(spec, args.out_dir)
    reason = rules.why_invalid(spec)
    rows = [(field.name, _field_text(getattr(spec, field.name))) for field in dataclasses.fields(spec)]
    rows += [
        ("threads", str(spec.threads)),
        ("smem_bytes", f"{rules.smem_bytes(spec)} ({rules.smem_bytes(spec) / 1024:.1f} KiB)"),
        ("est_registers", _regs_text(spec)),
        ("valid", "yes" if reason is None else f"no: {reason}"),
        (
            "runs on",
            ", ".join(t for t in TARGETS if rules.why_not_on(spec, t) is None) if reason is None else "-",
        ),
        ("in default set", "yes" if spec in committed.default_variants(spec.arch) else "no"),
        (
            "file",
            "renders on demand into the cache dir"
            if path is None
            else f"{path} ({'exists' if path.is_file() else 'not generated'})",
        ),
    ]
    print_table(("name", spec.name), rows)
    if args.source:
        if reason is not None:
            raise UsageError(f"--source: cannot render {spec.name}: {reason}")
        print()
        print(codegen.render_source(spec, templates_dir=args.templates_dir), end="")
    return 0


def _local_target() -> str | None:
    """The compile target of this machine's first CUDA GPU, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return target_for_capability(*torch.cuda.get_device_capability(0))


def _window(text: str) -> tuple[int, int]:
    """``--window LEFT,RIGHT``: two ints >= -1."""
    try:
        left, right = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEFT,RIGHT (two ints, -1 for unbounded)") from None
    return left, right


def _cmd_explain(args: argparse.Namespace) -> int:
    target = args.gpu or _local_target()
    if target is None:
        raise UsageError(f"this machine has no CUDA GPU: give --gpu (one of {TARGETS})")
    import torch

    from cutefa.api.attention import explain

    # The same checks as a call of flash_attn_func (heads ratio, head dim, grid limits), on meta
    # tensors of the problem's shape: nothing is allocated.
    shape = args.shape
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}[args.dtype]
    q_shape = (shape["batch"], shape["seqlen_q"], shape["heads_q"], shape["head_dim"])
    kv_shape = (shape["batch"], shape["seqlen_k"], shape["heads_kv"], shape["head_dim"])
    v_shape = (*kv_shape[:-1], shape["head_dim_v"])
    q, k, v = (torch.empty(s, dtype=dtype, device="meta") for s in (q_shape, kv_shape, v_shape))
    try:
        text = explain(
            q, k, v, causal=args.causal, target=target, v_centered=args.v_centered,
            window_size=args.window or (-1, -1), softcap=args.softcap, alibi=args.alibi, sinks=args.sinks,
            varlen=args.varlen, total_q=args.total_q,
        )  # fmt: skip
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise UsageError(str(exc)) from None
    print(text)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if _local_target() is None:
        raise UsageError("a CUDA GPU is required to benchmark, and this machine has none")
    if not BENCH_SCRIPT.is_file():
        raise UsageError(f"{BENCH_SCRIPT} is missing: benchmarks run from a source checkout")
    module_spec = importlib.util.spec_from_file_location("cutefa_bench", BENCH_SCRIPT)
    bench = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = bench  # dataclasses look their module up while the file runs
    module_spec.loader.exec_module(bench)
    return bench.main(args.args) or 0


def _cmd_tune(args: argparse.Namespace) -> int:
    if _local_target() is None:
        raise UsageError("a CUDA GPU is required to tune, and this machine has none")
    if not committed.default_variants(args.arch, args.direction):
        raise UsageError(
            f"--arch {args.arch} --direction {args.direction}: no {args.arch} {args.direction} kernel exists yet, "
            "so there is nothing to tune"
        )
    if args.direction == "bwd" and "e4m3" in args.dtype:
        raise UsageError("--dtype e4m3 --direction bwd: there is no fp8 backward to tune (forward only)")
    from cutefa.tune import tune

    path = tune(args.arch, out_dir=args.out, seqlens=tuple(args.seqlens), dtypes=tuple(args.dtype),
                head_dims=tuple(args.hdim) if args.hdim else None, direction=args.direction,
                rounds=args.rounds, pool=_all_variants(args.arch), merge=args.merge, jobs=args.jobs)  # fmt: skip
    print(f"wrote {path}; dispatch reads it with CUTEFA_TUNED_DIR={shlex.quote(str(path.parent))}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return values


def _dtype_list(text: str) -> list[str]:
    values = text.split(",")
    bad = [v for v in values if v not in ("fp16", "bf16", "e4m3")]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} not accepted: give fp16, bf16 and/or e4m3, comma-separated")
    return values


# ---------------------------------------------------------------- argument parsing


def _shape(text: str) -> dict[str, int]:
    """``--shape B,SQ,SK,HQ,HKV,D``, D being one head dim or DQK:DV (q/k's and v's): the fields of
    :data:`SHAPE_FIELDS` and ``head_dim_v`` (D's when one is given)."""
    parts = text.split(",")
    head_dims = parts[-1].split(":")
    try:
        values = [int(part) for part in parts[:-1] + head_dims[:1]]
        head_dim_v = int(head_dims[1]) if len(head_dims) == 2 else values[-1] if len(head_dims) == 1 else 0
    except (ValueError, IndexError):
        values, head_dim_v = [], 0
    if len(values) != len(SHAPE_FIELDS) or min(values) <= 0 or head_dim_v <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not six positive integers B,SQ,SK,HQ,HKV,D (e.g. 2,4096,4096,32,8,128), D "
            "being one head dim or DQK:DV (q/k's and v's, e.g. 192:128)"
        )
    return {**dict(zip(SHAPE_FIELDS, values)), "head_dim_v": head_dim_v}


def _add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHS, help="kernel family (default: every family)")
    parser.add_argument(
        "--kernels",
        metavar="GLOB",
        help="only variants whose name matches GLOB; the cutefa_ prefix is optional ('sm80_fwd_bf16*hd128*')",
    )


def _add_dirs(parser: argparse.ArgumentParser, out_alias: str | None = None) -> None:
    parser.add_argument(
        "--out-dir", *([out_alias] if out_alias else []), dest="out_dir", type=Path,
        default=codegen.GENERATED_DIR if SOURCE_CHECKOUT else None,
        help="generated modules' directory (default: a source checkout's generated/)",
    )  # fmt: skip
    parser.add_argument(
        "--templates-dir", type=Path, default=codegen.TEMPLATES_DIR, help="templates' directory"
    )


def _subcommands() -> dict[str, tuple[Callable[[argparse.Namespace], int], str]]:
    return {
        "list": (_cmd_list, "list variants with their shared memory, register estimate and status"),
        "generate": (
            _cmd_generate,
            "render the default variants into generated/ (or --check it); --all --out DIR: every valid variant",
        ),
        "compile": (cli_compile.run, cli_compile.SUMMARY),
        "show": (_cmd_show, "show one variant: fields, budgets, validity, generated file"),
        "explain": (_cmd_explain, "say which variant would run for a problem shape, and why"),
        "bench": (_cmd_bench, "run tools/bench.py with the remaining arguments (needs a CUDA GPU)"),
        "tune": (
            _cmd_tune,
            "measure the committed variants and the measured alternatives on this GPU and write its dispatch table",
        ),
        "doctor": (cli_doctor.run, cli_doctor.SUMMARY),
    }


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``cutefa`` command."""
    parser = argparse.ArgumentParser(
        prog="cutefa", description="FlashAttention kernels generated in CuTe DSL."
    )
    parser.add_argument("--version", action="version", version=f"cutefa {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    made = {}
    for name, (func, summary) in _subcommands().items():
        # bench takes any arguments and hands them on to tools/bench.py.
        extra = {"add_help": False, "prefix_chars": "\0"} if name == "bench" else {}
        made[name] = subparsers.add_parser(name, help=summary, description=summary, **extra)
        made[name].set_defaults(func=func)

    p = made["list"]
    _add_selection(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every valid variant, not only the default set")
    which.add_argument("--invalid", action="store_true", help="every rejected candidate with the reason")
    p.add_argument(
        "--direction", choices=DIRECTIONS, default="fwd", help="for --all/--invalid (default: fwd)"
    )

    p = made["generate"]
    _add_selection(p)
    p.add_argument("--check", action="store_true", help="exit 1 and print the differences if out of date")
    p.add_argument(
        "--all",
        action="store_true",
        help="every valid variant, measured alternatives included, for review (needs --out DIR)",
    )
    _add_dirs(p, out_alias="--out")

    cli_compile.add_arguments(made["compile"])
    cli_doctor.add_arguments(made["doctor"])

    p = made["show"]
    p.add_argument("name", metavar="NAME", help="variant name, with or without the cutefa_ prefix")
    p.add_argument("--source", action="store_true", help="also print the rendered module")
    _add_dirs(p)

    p = made["explain"]
    p.add_argument(
        "--shape", type=_shape, required=True, metavar="B,SQ,SK,HQ,HKV,D",
        help="problem shape; D is one head dim or DQK:DV (q/k's and v's, e.g. 192:128)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="(default: bf16)")
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--v-centered", action="store_true",
        help="e4m3: v was centered before quantization (cutefa.center_v, flash_attn_func(v_mean=))",
    )  # fmt: skip
    p.add_argument(
        "--varlen", action="store_true",
        help="a flash_attn_varlen_func call: B sequences of at most SQ query and SK key rows",
    )  # fmt: skip
    p.add_argument(
        "--total-q", type=int, metavar="T",
        help="with --varlen: the packed query rows of all B sequences (default: B x SQ, every one full)",
    )  # fmt: skip
    p.add_argument("--window", type=_window, metavar="LEFT,RIGHT", help="window_size (-1: unbounded)")
    p.add_argument("--softcap", type=float, default=0.0, help="softcap (default: 0, none)")
    p.add_argument("--alibi", action="store_true", help="with alibi_slopes")
    p.add_argument("--sinks", action="store_true", help="with sinks")
    p.add_argument("--gpu", choices=TARGETS, help="compile target of the GPU (default: this machine's GPU)")

    made["bench"].add_argument("args", nargs=argparse.REMAINDER, help="arguments for tools/bench.py")

    p = made["tune"]
    p.add_argument("--arch", choices=ARCHS, required=True, help="kernel family to tune")
    p.add_argument(
        "--direction", choices=DIRECTIONS, default="fwd", help="forward (default) or backward variants"
    )
    p.add_argument(
        "--seqlens", type=_int_list, default=list(TUNE_SEQLENS),
        help="(default: " + ",".join(map(str, TUNE_SEQLENS)) + ")",
    )
    p.add_argument(
        "--dtype",
        type=_dtype_list,
        default=["fp16", "bf16"],
        help="fp16, bf16, e4m3 (forward; inputs quantized per head), comma-separated (default: fp16,bf16)",
    )
    p.add_argument("--hdim", type=_int_list, help="head dims (default: every one with a variant)")
    p.add_argument(
        "--out", type=Path, default=None,
        help="table folder (default: $CUTEFA_TUNED_DIR, else <cache dir>/tuned; never the installed package)",
    )  # fmt: skip
    p.add_argument(
        "--rounds", type=positive_int, default=1,
        help="samples per variant, taken in turns with the problem's other variants; the median is kept "
        "(default 1)",
    )  # fmt: skip
    p.add_argument(
        "--merge", action="store_true",
        help="fold the results into the table already in the folder (the problems measured replace its "
        "entries for them, the others stay): a GPU's table a few head dims at a time",
    )  # fmt: skip
    p.add_argument(
        "--jobs", type=positive_int, default=1,
        help="compile the candidates in this many processes before timing (default 1: each on first use)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cutefa`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"cutefa {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped early, e.g. head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
