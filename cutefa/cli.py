"""The ``cutefa`` command: list, generate, compile, show, explain, bench, tune."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cutefa import codegen, space
from cutefa.spec import (
    ARCHS,
    DEFAULT_TARGET,
    DIRECTIONS,
    DTYPES,
    TARGETS,
    VariantSpec,
    families_for_target,
    parse_name,
    target_for_capability,
)

# Hardware evidence per kernel family, shown next to valid variants.
HARDWARE_STATUS: dict[str, str] = {
    "sm80": "hardware-tested on H200 (sm_90a)",
    "sm100": "compiled, not hardware-tested",
}

BENCH_SCRIPT = codegen.REPO_ROOT / "tools" / "bench.py"
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
SHAPE_FIELDS = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim")


class UsageError(Exception):
    """A user error: reported on stderr without a traceback, exit status 2."""


# ---------------------------------------------------------------- selection helpers


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"cutefa_{pattern}")


def _select(specs: Sequence[VariantSpec], pattern: str | None) -> list[VariantSpec]:
    """``specs`` whose names match ``pattern``; a pattern matching nothing is a user error."""
    if pattern is None:
        return list(specs)
    chosen = [spec for spec in specs if _matches(spec.name, pattern)]
    if not chosen:
        raise UsageError(f"--kernels {pattern!r} matches none of the {len(specs)} variants considered")
    return chosen


def _archs(arch: str | None) -> tuple[str, ...]:
    return ARCHS if arch is None else (arch,)


def _default_set(arch: str | None) -> list[VariantSpec]:
    return [spec for a in _archs(arch) for spec in space.default_variants(a)]


def _status(spec: VariantSpec) -> str:
    reason = space.why_invalid(spec)
    if reason is not None:
        return reason
    note = HARDWARE_STATUS.get(spec.arch)
    return f"ok ({note})" if note else "ok"


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _regs_text(spec: VariantSpec) -> str:
    regs = space.est_registers(spec)
    return "-" if regs is None else str(regs)


# ---------------------------------------------------------------- subcommands


def _cmd_list(args: argparse.Namespace) -> int:
    if args.all:
        specs = [s for a in _archs(args.arch) for s in space.valid_variants(a, args.direction)]
    elif args.invalid:
        specs = [
            s for a in _archs(args.arch) for s in space.candidates(a, args.direction) if space.why_invalid(s)
        ]
    else:
        specs = _default_set(args.arch)
    rows = [
        (s.name, f"{space.smem_bytes(s) / 1024:.1f}", _regs_text(s), _status(s))
        for s in _select(specs, args.kernels)
    ]
    _print_table(("name", "smem KiB", "est regs", "status"), rows)
    print(f"{len(rows)} variant(s)")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    specs = _select(_default_set(args.arch), args.kernels)
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


def _compile_plan(arch: str | None, target: str | None) -> tuple[list[VariantSpec], str]:
    """The variants and the target a compile command means."""
    if arch is None and target is None:
        raise UsageError(f"give --arch (one of {ARCHS}) or --target (one of {TARGETS})")
    target = target or DEFAULT_TARGET[arch]
    families = families_for_target(target)
    if arch is not None:
        if arch not in families:
            raise UsageError(
                f"--arch {arch} kernels cannot run on --target {target} (families there: {families})"
            )
        families = [arch]
    specs = [spec for family in families for spec in space.default_variants(family)]
    if not specs:
        raise UsageError(f"the default set has no {'/'.join(families)} variants yet: nothing to compile")
    too_big = [spec for spec in specs if space.why_not_on(spec, target) is not None]
    if too_big:
        print(
            f"leaving out {len(too_big)} variant(s) whose shared memory is over the "
            f"{space.TARGET_SMEM_LIMITS[target] // 1024} KiB per-block limit of {target} GPUs",
            file=sys.stderr,
        )
    return [spec for spec in specs if spec not in too_big], target


def _compile_selection(specs: Sequence[VariantSpec], pattern: str | None, target: str) -> list[VariantSpec]:
    """``_select``, plus one exact variant name outside the default set (e.g. a tuned-table variant)."""
    try:
        return _select(specs, pattern)
    except UsageError:
        if pattern is None or any(c in pattern for c in "*?["):
            raise
    spec = _spec_from_argument(pattern)
    reason = space.why_invalid(spec)
    if reason is not None:
        raise UsageError(f"--kernels {spec.name}: {reason}")
    if not spec.runs_on(target):
        raise UsageError(f"--kernels {spec.name}: family {spec.arch} does not run on --target {target}")
    too_big = space.why_not_on(spec, target)
    if too_big is not None:
        raise UsageError(f"--kernels {spec.name} cannot run on --target {target}: {too_big}")
    return [spec]


def _cmd_compile(args: argparse.Namespace) -> int:
    specs, target = _compile_plan(args.arch, args.target)
    specs = _compile_selection(specs, args.kernels, target)
    start = time.perf_counter()
    if args.pack is not None:
        from cutefa.pack import PackError, build_pack

        try:
            results = build_pack(specs, target=target, pack_dir=args.pack, jobs=args.jobs, progress=True)
        except PackError as exc:
            raise UsageError(str(exc)) from None
    else:
        from cutefa.compile import compile_variants

        results = compile_variants(specs, target=target, jobs=args.jobs, progress=True)
    elapsed = time.perf_counter() - start
    _print_table(
        ("name", "result", "seconds"),
        [(r.spec.name, "ok" if r.ok else "FAILED", f"{r.seconds:.1f}") for r in results],
    )
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"\n{result.spec.name} failed:\n{result.error}", file=sys.stderr)
    print(f"{len(results) - len(failed)} compiled, {len(failed)} failed in {elapsed:.1f} s (target {target})")
    if args.pack is not None:
        print(f"pack: {args.pack} (manifest.json); run with CUTEFA_KERNEL_PATH={args.pack}")
    return 1 if failed else 0


def _spec_from_argument(name: str) -> VariantSpec:
    try:
        return parse_name(name if name.startswith("cutefa_") else f"cutefa_{name}")
    except ValueError as exc:
        raise UsageError(f"NAME: {exc}") from None


def _cmd_show(args: argparse.Namespace) -> int:
    spec = _spec_from_argument(args.name)
    path = codegen.module_path(spec, args.out_dir)
    reason = space.why_invalid(spec)
    rows = [(field.name, str(getattr(spec, field.name))) for field in dataclasses.fields(spec)]
    rows += [
        ("threads", str(spec.threads)),
        ("smem_bytes", f"{space.smem_bytes(spec)} ({space.smem_bytes(spec) / 1024:.1f} KiB)"),
        ("est_registers", _regs_text(spec)),
        ("valid", "yes" if reason is None else f"no: {reason}"),
        ("runs on", ", ".join(t for t in TARGETS if space.why_not_on(spec, t) is None) if reason is None else "-"),
        ("in default set", "yes" if spec in space.default_variants(spec.arch) else "no"),
        ("file", f"{path} ({'exists' if path.is_file() else 'not generated'})"),
    ]
    _print_table(("name", spec.name), rows)
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


def _cmd_explain(args: argparse.Namespace) -> int:
    target = args.gpu or _local_target()
    if target is None:
        raise UsageError(f"this machine has no CUDA GPU: give --gpu (one of {TARGETS})")
    from cutefa.dispatch import explain_problem

    try:
        text = explain_problem(
            target=target, dtype=args.dtype, causal=args.causal, v_centered=args.v_centered, **args.shape
        )
    except (ValueError, TypeError) as exc:
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
    if not space.default_variants(args.arch, args.direction):
        raise UsageError(
            f"--arch {args.arch} --direction {args.direction}: no {args.arch} {args.direction} kernel exists yet, "
            "so there is nothing to tune"
        )
    if args.direction == "bwd" and "e4m3" in args.dtype:
        raise UsageError("--dtype e4m3 --direction bwd: there is no fp8 backward to tune (forward only)")
    from cutefa.tune import tune

    path = tune(args.arch, out_dir=args.out, seqlens=tuple(args.seqlens), dtypes=tuple(args.dtype),
                head_dims=tuple(args.hdim) if args.hdim else None, direction=args.direction,
                rounds=args.rounds)  # fmt: skip
    print(f"wrote {path}")
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
    parts = text.split(",")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != len(SHAPE_FIELDS) or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not six positive integers B,SQ,SK,HQ,HKV,D (e.g. 2,4096,4096,32,8,128)"
        )
    return dict(zip(SHAPE_FIELDS, values))


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHS, help="kernel family (default: every family)")
    parser.add_argument(
        "--kernels",
        metavar="GLOB",
        help="only variants whose name matches GLOB; the cutefa_ prefix is optional ('sm80_fwd_bf16*hd128*')",
    )


def _add_dirs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out-dir", type=Path, default=codegen.GENERATED_DIR, help="generated modules' directory"
    )
    parser.add_argument(
        "--templates-dir", type=Path, default=codegen.TEMPLATES_DIR, help="templates' directory"
    )


def _subcommands() -> dict[str, tuple[Callable[[argparse.Namespace], int], str]]:
    return {
        "list": (_cmd_list, "list variants with their shared memory, register estimate and status"),
        "generate": (_cmd_generate, "render the default variants into generated/ (or --check it)"),
        "compile": (
            _cmd_compile,
            "compile the default variants ahead of time, with no GPU needed (--pack DIR: into a kernel pack)",
        ),
        "show": (_cmd_show, "show one variant: fields, budgets, validity, generated file"),
        "explain": (_cmd_explain, "say which variant would run for a problem shape, and why"),
        "bench": (_cmd_bench, "run tools/bench.py with the remaining arguments (needs a CUDA GPU)"),
        "tune": (_cmd_tune, "measure the default variants on this GPU and write its dispatch table"),
    }


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``cutefa`` command."""
    parser = argparse.ArgumentParser(
        prog="cutefa", description="FlashAttention kernels generated in CuTe DSL."
    )
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
    _add_dirs(p)

    p = made["compile"]
    _add_selection(p)
    p.add_argument("--target", choices=TARGETS, help="GPU to compile for (default: the family's own arch)")
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=os.cpu_count() or 1,
        help="parallel compiles (default: CPU count)",
    )
    p.add_argument(
        "--pack",
        type=Path,
        metavar="DIR",
        help="also write the kernels into the kernel pack DIR (one .so per variant and manifest.json; "
        "put DIR on CUTEFA_KERNEL_PATH to run them with no compiler)",
    )

    p = made["show"]
    p.add_argument("name", metavar="NAME", help="variant name, with or without the cutefa_ prefix")
    p.add_argument("--source", action="store_true", help="also print the rendered module")
    _add_dirs(p)

    p = made["explain"]
    p.add_argument("--shape", type=_shape, required=True, metavar="B,SQ,SK,HQ,HKV,D", help="problem shape")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="(default: bf16)")
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--v-centered", action="store_true",
        help="e4m3: v was centered before quantization (cutefa.center_v, flash_attn_func(v_mean=))",
    )  # fmt: skip
    p.add_argument("--gpu", choices=TARGETS, help="compile target of the GPU (default: this machine's GPU)")

    made["bench"].add_argument("args", nargs=argparse.REMAINDER, help="arguments for tools/bench.py")

    p = made["tune"]
    p.add_argument("--arch", choices=ARCHS, required=True, help="kernel family to tune")
    p.add_argument(
        "--direction", choices=DIRECTIONS, default="fwd", help="forward (default) or backward variants"
    )
    p.add_argument("--seqlens", type=_int_list, default=[1024, 4096, 16384], help="(default: 1024,4096,16384)")
    p.add_argument(
        "--dtype", type=_dtype_list, default=["fp16", "bf16"],
        help="fp16, bf16, e4m3 (forward; inputs quantized per head), comma-separated (default: fp16,bf16)",
    )
    p.add_argument("--hdim", type=_int_list, help="head dims (default: every one with a variant)")
    p.add_argument("--out", type=Path, default=TUNED_DIR, help="table folder (default: cutefa/tuned)")
    p.add_argument(
        "--rounds", type=_positive_int, default=1,
        help="samples per variant, taken in turns with the problem's other variants; the median is kept "
        "(default 1)",
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
