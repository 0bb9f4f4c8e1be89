"""``cutefa doctor``: what this machine has for cutefa, and what a model would need.

Three parts, each a table: the environment (cutefa, Python, torch and its CUDA, the GPUs and the
compile target each needs, the CUDA driver, the CuTe DSL, TVM-FFI, jinja2, transformers, the SDPA
provider, the cache dir and whether it is trusted, JIT compiling on or off); the kernel packs on
the search path (each one's target, DSL version and kernel count, and whether it is used here: not
trusted, built for another target or DSL, or fine); and with ``--for-model CONFIG`` (a Hugging Face
``config.json``), the kernels that model's attention needs on the target (:mod:`cutefa.selection`)
and where each would come from: a pack, the compile cache, or a JIT compile on first use (or
nowhere, with ``CUTEFA_JIT=0``, and the command that builds it).

Nothing here launches a kernel or imports the DSL compiler; a variant that is not committed may be
rendered into the cache dir to compute its fingerprint, as its first use would.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from pathlib import Path

from cutefa.cli_common import UsageError, print_table
from cutefa.model.spec import TARGETS

SUMMARY = (
    "check this machine: GPU, driver, CUDA, DSL, torch and TVM-FFI versions, the kernel packs found "
    "(used here or why not); --for-model CONFIG: the kernels a model needs and whether each is packed, "
    "cached or would be compiled on first use"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--for-model", type=Path, metavar="CONFIG",
        help="a Hugging Face config.json: list the kernels its attention needs and where each would come from",
    )  # fmt: skip
    parser.add_argument(
        "--target", choices=TARGETS, help="compile target to check for (default: this machine's first GPU's)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    targets = _gpu_targets(torch)
    target = args.target or (targets[0] if targets else None)
    model = None
    if args.for_model is not None:  # its errors come before any output
        if target is None:
            raise UsageError(f"--for-model: this machine has no CUDA GPU: give --target (one of {TARGETS})")
        model = model_kernels(args.for_model, target)
    print_table(("component", "status"), environment(torch, targets))
    print()
    print_table(("kernel pack", "status"), packs(target))
    if model is not None:
        print()
        print_table(("kernel", "where it comes from"), model)
    return 0


# ---------------------------------------------------------------------------------------------
# The environment


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_targets(torch) -> list[str]:
    from cutefa.model.spec import target_for_capability

    if not torch.cuda.is_available():
        return []
    return [
        target_for_capability(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())
    ]


def _gpus(torch, targets: list[str]) -> list[tuple[str, str]]:
    if not targets:
        return [("GPU", "none (CUDA not available to torch): kernels still compile here for any --target")]
    rows = []
    for i, target in enumerate(targets):
        major, minor = torch.cuda.get_device_capability(i)
        served = "cutefa has kernels for it" if target in TARGETS else "no cutefa kernels for it"
        name = torch.cuda.get_device_name(i)
        rows.append((f"GPU {i}", f"{name}, compute capability {major}.{minor}: target {target}, {served}"))
    return rows


def _driver() -> str:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python 12.x before cuda.bindings
        except ImportError as exc:
            return f"unknown (cuda-python not importable: {exc})"
    try:
        err, version = driver.cuDriverGetVersion()
    except Exception as exc:  # noqa: BLE001 -- no libcuda.so: every failure means "no driver"
        return f"none found ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    if int(err) != 0:
        return f"none found (cuDriverGetVersion: {err})"
    return f"supports CUDA {version // 1000}.{version % 1000 // 10}"


def _sdpa_provider(torch) -> str:
    from cutefa import torch_sdpa

    if not hasattr(torch.nn.attention, "register_flash_attention_impl"):
        return f"not available: torch {torch.__version__} has no flash-attention provider registry (2.10+)"
    if torch_sdpa.is_active():
        return "active: SDPA's flash backend runs cutefa"
    return "available: cutefa.torch_sdpa.activate() routes SDPA's flash backend to cutefa"


def environment(torch, targets: list[str]) -> list[tuple[str, str]]:
    """The rows of the environment table."""
    from cutefa import __version__, identity, loader

    where = "source checkout" if (identity.REPO_ROOT / "pyproject.toml").is_file() else "installed"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    missing = "not installed"
    transformers = _version("transformers")
    if transformers:
        transformers += " (attn_implementation='cutefa' after cutefa.integrations.transformers.register())"
    problem = identity.cache_problem()
    cache = f"{identity.cache_dir()}: " + ("trusted" if problem is None else f"NOT USED: {problem}")
    if loader.jit_enabled():
        jit = "on: a kernel found nowhere is compiled on first use"
    else:
        jit = "off (CUTEFA_JIT=0): a kernel found in no pack or cache entry is an error"
    return [
        ("cutefa", f"{__version__} ({where}: {identity.PACKAGE_DIR})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} ({build})"),
        *_gpus(torch, targets),
        ("CUDA driver", _driver()),
        (
            "nvidia-cutlass-dsl",
            _version(identity.DSL_DIST) or f"{missing}: kernels can neither compile nor load",
        ),
        ("apache-tvm-ffi", _version("apache-tvm-ffi") or f"{missing}: kernels cannot load"),
        ("jinja2", _version("jinja2") or f"{missing}: variants cannot render"),
        ("transformers", transformers or f"{missing} (optional)"),
        ("SDPA provider", _sdpa_provider(torch)),
        ("cache dir", cache),
        ("JIT compile", jit),
    ]


# ---------------------------------------------------------------------------------------------
# Packs


def packs(target: str | None) -> list[tuple[str, str]]:
    """One row per pack on the search path (and per search folder without packs)."""
    from cutefa import identity, pack

    rows = []
    for directory in pack.search_dirs():
        implicit = not pack.trusted_only() and directory == identity.cache_dir() / "packs"
        found = pack.pack_dirs(directory)
        if not found:
            state = "no packs in it" if directory.is_dir() else "does not exist"
            rows.append(
                (
                    str(directory),
                    f"{state} ({'the default pack folder' if implicit else 'CUTEFA_KERNEL_PATH'})",
                )
            )
            continue
        for path in found:
            rows.append((str(path), _pack_status(path, target, implicit)))
    return rows


def _pack_status(path: Path, target: str | None, implicit: bool) -> str:
    from cutefa import identity, pack

    try:
        found = pack.read_pack(path)
    except pack.PackError as exc:
        return f"UNREADABLE: {exc}"
    what = f"{len(found.kernels)} kernel(s) for {found.target}, nvidia-cutlass-dsl {found.dsl_version}"
    if implicit:
        why = identity.cache_problem() or identity.why_untrusted_under(
            identity.cache_dir(), path / pack.MANIFEST
        )
        if why is not None:
            return f"{what}: NOT USED: not trusted: {why}"
    if target is None:
        return f"{what}: (no GPU here, give --target to check it)"
    why = pack.why_refused(found, target)
    return f"{what}: NOT USED for {target}: {why}" if why else f"{what}: used for {target}"


# ---------------------------------------------------------------------------------------------
# One model's kernels


def model_kernels(config: Path, target: str) -> list[tuple[str, str]]:
    """(kernel, where it would come from) for what the model of ``config`` needs on ``target``; the
    plan's notes (needs no kernel covers) follow as rows of their own."""
    from cutefa.selection import SelectionError, model_plan, read_model_config

    try:
        model = read_model_config(config)
        plan = model_plan(model, target)
    except SelectionError as exc:
        raise UsageError(str(exc)) from None
    rows = [(f"model {config}", model.describe())]
    rows += [(spec.name, _origin(spec, target)) for spec in plan.specs]
    rows += [("note", note) for note in plan.notes]
    return rows


def _origin(spec, target: str) -> str:
    from cutefa import compile as cc
    from cutefa import identity, loader, pack

    try:
        entry = cc._entry(spec, target)
    except Exception as exc:  # noqa: BLE001 -- no source (no templates): packs are not checked for staleness
        entry, fingerprint = None, None
        source_problem = f"{type(exc).__name__}: {exc}"
    else:
        fingerprint, source_problem = entry.fingerprint, None
    found, refusals = pack.find_kernel(spec.name, target, fingerprint)
    if found is not None:
        found.file.close()
        return f"packed: {found.pack}"
    refused = f" (refused: {'; '.join(refusals)})" if refusals else ""
    if entry is not None and identity.cache_problem() is None and entry.read_meta() is not None:
        return f"cached: {entry.dir}{refused}"
    if entry is None:
        return f"UNAVAILABLE: in no pack, and no source to compile it ({source_problem}){refused}"
    if loader.jit_enabled():
        return f"compiled on first use (JIT){refused}; to ship it: {loader.build_command(spec.name, target)}"
    return f"UNAVAILABLE (CUTEFA_JIT=0){refused}: build it with {loader.build_command(spec.name, target)}"
