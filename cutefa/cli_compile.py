"""``cutefa compile``: the variants a selection (or one model's ``config.json``) names for a target,
compiled ahead of time into the cache or into a kernel pack, with no GPU needed."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cutefa.cli_common import UsageError, positive_int, print_table, spec_from_argument
from cutefa.model.spec import (
    ARCHS,
    COMMITTED_HEAD_DIMS,
    DEFAULT_TARGET,
    DIRECTIONS,
    DTYPES,
    TARGETS,
    VariantSpec,
    families_for_target,
)
from cutefa.selection import FEATURES, MASKS, Selection, SelectionError

SUMMARY = (
    "compile a selection of the default variants ahead of time, with no GPU needed (--pack DIR: "
    "into a kernel pack; --for-model CONFIG: what one model needs)"
)

# ---------------------------------------------------------------- what to compile, and where


def _compile_target(families: Sequence[str], target: str | None, for_model: Path | None) -> str:
    """The compile target a compile command means; every family named must run there."""
    if target is None:
        if len(families) != 1:
            what = f"--family {','.join(families)}" if families else ""
            what = "--for-model" if for_model is not None else what
            raise UsageError(
                (f"{what}: give --target" if what else f"give --family (one of {ARCHS}) or --target")
                + f" (one of {TARGETS})"
            )
        target = DEFAULT_TARGET[families[0]]
    runs = families_for_target(target)
    for family in families:
        if family not in runs:
            raise UsageError(
                f"--family {family} kernels cannot run on --target {target} (families there: {runs})"
            )
    return target


def _compile_universe(families: Sequence[str], target: str) -> list[VariantSpec]:
    """The committed variants of ``families`` (default: those that run on ``target``) that it holds."""
    from cutefa.model.budgets import TARGET_SMEM_LIMITS
    from cutefa.model.committed import default_variants
    from cutefa.model.rules import why_not_on

    families = list(families) or families_for_target(target)
    specs = [spec for family in families for spec in default_variants(family)]
    if not specs:
        raise UsageError(f"the default set has no {'/'.join(families)} variants yet: nothing to compile")
    too_big = [spec for spec in specs if why_not_on(spec, target) is not None]
    if too_big:
        print(
            f"leaving out {len(too_big)} variant(s) whose shared memory is over the "
            f"{TARGET_SMEM_LIMITS[target] // 1024} KiB per-block limit of {target} GPUs",
            file=sys.stderr,
        )
    return [spec for spec in specs if spec not in too_big]


def _compile_selection(specs: Sequence[VariantSpec], selection: Selection, target: str) -> list[VariantSpec]:
    """The variants of ``specs`` the selection keeps; with ``--kernels`` naming one exact variant
    outside them (e.g. a measured alternative, rendered on demand), that variant."""
    try:
        return _selected(specs, selection)
    except UsageError:
        pattern = selection.kernels
        if pattern is None or any(c in pattern for c in "*?["):
            raise
    from cutefa.model.rules import why_invalid, why_not_on

    spec = spec_from_argument(pattern)
    reason = why_invalid(spec)
    if reason is not None:
        raise UsageError(f"--kernels {spec.name}: {reason}")
    if not spec.runs_on(target):
        raise UsageError(f"--kernels {spec.name}: family {spec.arch} does not run on --target {target}")
    too_big = why_not_on(spec, target)
    if too_big is not None:
        raise UsageError(f"--kernels {spec.name} cannot run on --target {target}: {too_big}")
    others = dataclasses.replace(selection, kernels=None)
    if not others.keeps(spec):
        raise UsageError(f"--kernels {spec.name}: not kept by {others.describe()}")
    return [spec]


def _selected(specs: Sequence[VariantSpec], selection: Selection) -> list[VariantSpec]:
    from cutefa.selection import select

    try:
        return select(specs, selection)
    except SelectionError as exc:
        raise UsageError(str(exc)) from None


def _compile_specs(args: argparse.Namespace, target: str) -> list[VariantSpec]:
    """The variants the compile command selects, with the model's notes printed for --for-model."""
    try:
        selection = Selection(
            families=tuple(args.family) or None, directions=tuple(args.direction) or None,
            dtypes=tuple(args.dtype) or None, head_dims=tuple(args.head_dim) or None,
            masks=tuple(MASKS[m] for m in args.mask) or None, features=tuple(FEATURES[f] for f in args.feature),
            kernels=args.kernels,
        )  # fmt: skip
        if args.for_model is None:
            return _compile_selection(_compile_universe(args.family, target), selection, target)
        from cutefa.selection import model_plan, read_model_config

        model = read_model_config(args.for_model)
        print(f"model {model.describe()}")
        plan = model_plan(model, target, selection)
    except SelectionError as exc:
        raise UsageError(str(exc)) from None
    for note in plan.notes:
        print(f"warning: {note}", file=sys.stderr)
    return list(plan.specs)


def _selection_summary(specs: Sequence[VariantSpec], target: str) -> str:
    """``selected N kernel(s) for T: a sm90 fwd, b sm90 bwd, ...`` (families newest first)."""
    groups = [(family, d) for family in reversed(ARCHS) for d in DIRECTIONS]
    counts = {group: sum((s.arch, s.direction) == group for s in specs) for group in groups}
    parts = ", ".join(f"{n} {family} {d}" for (family, d), n in counts.items() if n)
    return f"selected {len(specs)} kernel(s) for {target}: {parts}"


def run(args: argparse.Namespace) -> int:
    """Run ``cutefa compile``; returns the exit status."""
    for axis in ("family", "direction", "dtype", "head_dim", "mask", "feature"):
        setattr(args, axis, list(dict.fromkeys(getattr(args, axis))))
    target = _compile_target(args.family, args.target, args.for_model)
    specs = _compile_specs(args, target)
    print(_selection_summary(specs, target), flush=True)
    start = time.perf_counter()
    try:
        if args.pack is not None:
            from cutefa.pack import PackError
            from cutefa.pack_build import build_pack

            try:
                results = build_pack(specs, target=target, pack_dir=args.pack, jobs=args.jobs, progress=True)
            except PackError as exc:
                raise UsageError(str(exc)) from None
        else:
            from cutefa.compile import compile_variants

            results = compile_variants(specs, target=target, jobs=args.jobs, progress=True)
    except KeyboardInterrupt:
        seconds = time.perf_counter() - start
        print(f"\ninterrupted after {seconds:.1f} s{_pack_state(args.pack)}", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    print_table(
        ("name", "result", "seconds"),
        [(r.spec.name, "ok" if r.ok else "FAILED", f"{r.seconds:.1f}") for r in results],
    )
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"\n{result.spec.name} failed:\n{result.error}", file=sys.stderr)
    print(f"{len(results) - len(failed)} compiled, {len(failed)} failed in {elapsed:.1f} s (target {target})")
    if args.pack is not None:
        print(f"pack: {args.pack} (manifest.json){_pack_size(args.pack)}, built in {elapsed:.1f} s; "
              f"run with CUTEFA_KERNEL_PATH={args.pack}")  # fmt: skip
    return 1 if failed else 0


def _pack_size(pack_dir: Path) -> str:
    """``: N kernels, S MiB on disk`` of the pack at ``pack_dir`` ("" when it has no manifest)."""
    from cutefa.pack import PackError, read_pack, size_on_disk

    try:
        kernels = len(read_pack(pack_dir).kernels)
        return f": {kernels} kernel(s), {size_on_disk(pack_dir) / 2**20:.1f} MiB on disk"
    except PackError:
        return ""


def _pack_state(pack_dir: Path | None) -> str:
    if pack_dir is None:
        return "; the kernels compiled so far stay in the cache"
    return (
        f"; the pack {pack_dir}{_pack_size(pack_dir) or ' is empty'} lists the kernels finished so far and is "
        "usable as is; run the same command again to build the rest (finished kernels are kept)"
    )


# ---------------------------------------------------------------- arguments


def _listed(accepted: Sequence[str], convert: Callable[[str], object] = str) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of ``accepted`` values (converted)."""

    def parse(text: str) -> list:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in accepted]
        if bad or not values:
            accepts = ", ".join(accepted)
            raise argparse.ArgumentTypeError(f"{bad or text!r} not accepted: give {accepts}, comma-separated")
        return [convert(v) for v in values]

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``compile``: the selection axes (each repeatable or a comma-separated list),
    ``--kernels``, ``--for-model``, ``--target``, ``--jobs`` and ``--pack``."""
    axes = (
        ("--family", ("--arch",), ARCHS, str, "kernel families (default: every family that runs on --target)"),
        ("--direction", (), DIRECTIONS, str, "fwd and/or bwd (default: both)"),
        ("--dtype", (), DTYPES, str, "fp16, bf16, e4m3 (default: every dtype; --for-model: the model's)"),
        ("--head-dim", (), tuple(str(d) for d in COMMITTED_HEAD_DIMS), int, "head dims (default: every one)"),
        ("--mask", (), tuple(MASKS), str, "none, causal or local (default: every kind; --for-model: causal)"),
        ("--feature", (), tuple(FEATURES), str, "only variants with these feature axes (varlen, paged_kv, split_kv, softcap, alibi, sinks)"),
    )  # fmt: skip
    for flag, aliases, accepted, convert, help_text in axes:
        parser.add_argument(
            flag, *aliases, dest=flag[2:].replace("-", "_"), type=_listed(accepted, convert), action="extend",
            default=[], metavar=flag[2:].upper().replace("-", "_"), help=help_text,
        )  # fmt: skip
    parser.add_argument(
        "--kernels",
        metavar="GLOB",
        help="only variants whose name matches GLOB; the cutefa_ prefix is optional ('sm80_fwd_bf16*hd128*'); "
        "an exact name outside the committed set (a measured alternative) is rendered and compiled on demand",
    )
    parser.add_argument(
        "--for-model",
        type=Path,
        metavar="CONFIG",
        help="a Hugging Face config.json: select what that model's attention needs on --target (both "
        "directions, causal, its dtype and head dim; the other flags narrow it), and warn about what no "
        "kernel covers yet (sliding window, softcap, head dim)",
    )
    parser.add_argument(
        "--target", choices=TARGETS, help="GPU to compile for (default: the family's own arch)"
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=os.cpu_count() or 1,
        help="parallel compiles (default: CPU count)",
    )
    parser.add_argument(
        "--pack",
        type=Path,
        metavar="DIR",
        help="also write the kernels into the kernel pack DIR (one .so per variant and manifest.json; "
        "put DIR on CUTEFA_KERNEL_PATH to run them with no compiler)",
    )
