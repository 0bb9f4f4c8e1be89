"""Compile variants with the CuTe DSL over fake tensors into a disk cache of linked TVM-FFI kernels.

One compiled kernel serves every batch size, sequence length and head count: the DSL sees fake
tensors whose dynamic dims are shared ``SymInt`` objects. The kernel is exported with the TVM-FFI
calling convention and linked into ``kernel.so``, which :mod:`cutefa.loader` finds and
:mod:`cutefa.ffi` calls through that C ABI, so a cached kernel loads in about a millisecond without
the DSL compiler, takes torch tensors directly and runs on the caller's current torch stream.

Disk layout (``CUTEFA_CACHE_DIR``, default ``~/.cache/cutefa``)::

    <dir>/<target>/<name>-<fingerprint[:16]>/kernel.so   the linked kernel
                                            /meta.json   written last: the commit marker, with
                                                         kernel.so's sha256
                                            /.lock       flock'ed while building
    <dir>/sources/<render digest[:16]>/<arch>/<name>.py   modules rendered on demand
    <dir>/quarantine/<target>/<entry>.<time>.<pid>/       damaged entries, moved aside

kernel.so and its folder are fsynced before meta.json is written (and fsynced): after a power loss
an entry is whole or not committed. How entries are checked, quarantined and where a build goes
when the cache dir is read-only, full or not trusted: :mod:`cutefa.cache`.

``generated/`` commits the modules of the dispatchable variants. Any other valid variant (a
measured alternative, a tuned-table pick of another GPU) is rendered on first use into
``sources/``, keyed by its name and the digest of what rendering reads
(:func:`cutefa.identity.render_digest`), and compiled from there like a committed one.

The DSL reads ``CUTE_DSL_ARCH`` once, at ``import cutlass``, and only compiles for that target. So
a process compiles in-process only for the target its DSL was set up for (the first compile picks
it when ``cutlass`` is not imported yet); other targets compile in child processes
(``python -m cutefa.compile ...``, one per variant) started with ``CUTE_DSL_ARCH`` set.

:func:`compile_variants` fills the cache ahead of time; :func:`cutefa.loader.get_kernel` compiles
into it on first use (JIT), and :func:`cutefa.pack_build.build_pack` copies what it builds into a
kernel pack.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from cutefa import identity
from cutefa.cache import Entry, build_home, warn_cache
from cutefa.identity import GENERATED_DIR, SOURCE_CHECKOUT, KernelFile, atomic_write, cache_dir, locked
from cutefa.model.options import Scheduler
from cutefa.model.spec import VariantSpec, parse_name, target_cc

log = logging.getLogger("cutefa")

_DSL_DTYPES = {"fp16": "Float16", "bf16": "BFloat16", "e4m3": "Float8E4M3FN"}
_ROW_ALIGN_BYTES = 16

# (ok, seconds, error) of one build
_Outcome = tuple[bool, float, "str | None"]


@dataclass(frozen=True)
class CompileResult:
    """Outcome of compiling one variant for one target."""

    spec: VariantSpec
    ok: bool
    seconds: float
    error: str | None = None
    path: Path | None = None


# ---------------------------------------------------------------------------------------------
# Paths, sources and fingerprints


def kernel_source_path(spec: VariantSpec) -> Path:
    """The variant's generated module: the committed one in a source checkout's ``generated/``,
    else the one rendered on demand into the cache (:func:`rendered_source_path`)."""
    committed = GENERATED_DIR / spec.arch / f"{spec.name}.py"
    if SOURCE_CHECKOUT and committed.is_file():
        return committed
    return rendered_source_path(spec)


def rendered_source_path(spec: VariantSpec) -> Path:
    """``<cache dir>/sources/<render digest[:16]>/<arch>/<name>.py``, rendered from the templates the
    first time it is asked for (FlashInfer's JIT keeps its generated sources the same way). Such a
    module is imported, so one in a cache dir that is not trusted is not used (one warning): it is
    rendered into a private temporary folder instead, as when the cache dir cannot be written.
    Raises what :func:`cutefa.codegen.render_source` raises for a spec with no kernel or an invalid one."""
    relative = Path("sources") / identity.render_digest()[:16] / spec.arch / f"{spec.name}.py"
    root = cache_dir()
    why = identity.why_untrusted_under(root, root / relative)
    if why is None:
        try:
            return _rendered(spec, root / relative)
        except OSError as exc:
            why = f"cannot write it: {exc.strerror or exc}"
    warn_cache(root, why)
    return _rendered(spec, identity.private_dir("cache") / relative)


def _rendered(spec: VariantSpec, path: Path) -> Path:
    if not path.is_file():
        from cutefa import codegen

        atomic_write(path, codegen.render_source(spec))
    return path


def load_kernel_module(spec: VariantSpec) -> ModuleType:
    """Import the variant's generated module from its file (the DSL reads kernel source with inspect).

    Importing it imports ``cutlass``: set the target up first (see module docs).
    """
    return _import_file(kernel_source_path(spec), spec.name)


def fingerprint(spec: VariantSpec, target: str) -> str:
    """:func:`cutefa.identity.fingerprint` of the variant's module for ``target``."""
    return identity.fingerprint(kernel_source_path(spec).read_text(), target)


def takes_sm_count(spec: VariantSpec) -> bool:
    """Whether the compiled entry of ``spec`` also takes its grid size (a persistent kernel)."""
    return getattr(spec.options, "scheduler", None) is Scheduler.PERSISTENT


def _entry(spec: VariantSpec, target: str) -> Entry:
    target_cc(target)  # raises ValueError naming the known targets
    if not spec.runs_on(target):
        raise ValueError(f"{spec.name}: kernel family {spec.arch} does not run on target {target!r}")
    source = kernel_source_path(spec)
    return Entry(spec.name, target, source, identity.fingerprint(source.read_text(), target), cache_dir())


def _import_file(path: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import kernel module from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # inspect finds a class's source through sys.modules
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Target set-up and the fake-tensor compile


def dsl_target() -> str | None:
    """The target this process's DSL compiles for; None while ``cutlass`` is not imported yet."""
    if "cutlass" not in sys.modules:
        return None
    return os.environ.get("CUTE_DSL_ARCH", "auto-detected")


def can_compile_here(target: str) -> bool:
    """Whether this process can compile for ``target`` without a child process."""
    return dsl_target() in (None, target)


def _import_dsl(target: str) -> tuple[ModuleType, ModuleType]:
    """Import the DSL set up for ``target`` (setting ``CUTE_DSL_ARCH`` first if still possible)."""
    current = dsl_target()
    if current is None:
        os.environ["CUTE_DSL_ARCH"] = target
    elif current != target:
        raise RuntimeError(f"this process's CuTe DSL compiles for {current}, not {target}")
    import cutlass
    from cutlass import cute

    return cutlass, cute


def _fake_arguments(spec: VariantSpec, cutlass: ModuleType, cute: ModuleType) -> tuple[Any, ...]:
    """Fake (q, k, v, o, lse, softmax_scale[, num_ctas], stream) for one shape-polymorphic compile."""
    dtype = getattr(cutlass, _DSL_DTYPES[spec.dtype])
    row_align = _ROW_ALIGN_BYTES // spec.elem_bytes
    batch, seqlen_q, seqlen_k = cute.sym_int(symbol="b"), cute.sym_int(symbol="sq"), cute.sym_int(symbol="sk")
    heads_q, heads_kv = cute.sym_int(symbol="hq"), cute.sym_int(symbol="hkv")

    def bshd(seqlen: Any, heads: Any) -> Any:
        strides = tuple(cute.sym_int64(divisibility=row_align) for _ in range(3)) + (1,)
        shape = (batch, seqlen, heads, spec.head_dim)
        return cute.runtime.make_fake_tensor(dtype, shape, strides, assumed_align=_ROW_ALIGN_BYTES)

    lse_strides = (cute.sym_int64(), cute.sym_int64(), 1)
    lse = cute.runtime.make_fake_tensor(cutlass.Float32, (batch, heads_q, seqlen_q), lse_strides)
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    q, o = bshd(seqlen_q, heads_q), bshd(seqlen_q, heads_q)
    k, v = bshd(seqlen_k, heads_kv), bshd(seqlen_k, heads_kv)
    # A persistent kernel also takes its grid size (the GPU's SM count) at run time.
    grid = (cutlass.Int32(1),) if takes_sm_count(spec) else ()
    return q, k, v, o, lse, cutlass.Float32(1.0), *grid, stream


def compile_object(spec: VariantSpec, target: str) -> Any:
    """Trace and compile ``spec`` for ``target`` in this process, bypassing every cache (inspection,
    SASS dumps). The process must be set up for ``target`` (see :func:`can_compile_here`)."""
    return _compile(_entry(spec, target))


def _compile(entry: Entry) -> Any:
    """Trace and compile the entry's kernel module in this process; returns the DSL's compiled object."""
    cutlass, cute = _import_dsl(entry.target)
    module = _import_file(entry.source, entry.name)
    if getattr(module, "SPEC_NAME", None) != entry.name:
        raise RuntimeError(
            f"{entry.source} defines SPEC_NAME={getattr(module, 'SPEC_NAME', None)!r}, "
            f"expected {entry.name!r}"
        )
    # A kernel family with another calling convention (e.g. a backward pass) defines its own
    # ``fake_arguments(spec, cutlass, cute)`` in the generated module; forwards share this one.
    make_args = getattr(module, "fake_arguments", _fake_arguments)
    # a module whose name is not a spec's (a user's mods: cutefa.mods.variant) names the spec whose
    # sample arguments it takes
    args = make_args(parse_name(getattr(module, "FAKE_SPEC_NAME", entry.name)), cutlass, cute)
    # A generated module may name ptxas options of its own (e.g. a register-usage level that keeps
    # ptxas on the uniform datapath); the constant is part of the hashed source.
    ptxas = getattr(module, "PTXAS_OPTIONS", "")
    options = "--enable-tvm-ffi" + (f" --ptxas-options '{ptxas}'" if ptxas else "")
    return cute.compile(module.Kernel(), *args, options=options)


# ---------------------------------------------------------------------------------------------
# Building an entry: lock, compile, export, link, commit


def _build(entry: Entry, force: bool = False) -> Any:
    """Compile ``entry`` here and commit it to disk unless already committed.

    Returns the compiled object when this call compiled it, None when the entry was already
    committed (perhaps by another process while we waited for the lock). When the cache cannot
    be written (a full disk, a read-only cache), the compiled object is returned uncommitted, with
    one warning, and no temporary file is left.
    """
    if not force and entry.committed():
        return None
    with contextlib.ExitStack() as held:
        try:
            identity.make_dirs(entry.dir)
            held.enter_context(locked(entry.dir / ".lock"))
            if not force and entry.committed():
                return None
            entry.meta_path.unlink(missing_ok=True)
        except OSError as exc:
            warn_cache(entry.root, f"cannot write it: {exc.strerror or exc}")
            return _compile(entry)
        start = time.perf_counter()
        compiled = _compile(entry)
        seconds = time.perf_counter() - start
        try:
            runtime = _export(compiled, entry)
            if runtime is not None:
                _commit(entry, runtime, seconds)
        except OSError as exc:  # the disk filled up or the cache became read-only meanwhile
            with contextlib.suppress(OSError):
                entry.so_path.unlink(missing_ok=True)
            warn_cache(entry.root, f"cannot write it: {exc.strerror or exc}")
        return compiled


def _runtime_libraries() -> list[Path]:
    """The libraries a kernel links against: the DSL runtime and ``libtvm_ffi.so``."""
    from cutlass import cute

    return [Path(p) for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)]


def _export(compiled: Any, entry: Entry) -> Path | None:
    """Export the TVM-FFI object and link ``kernel.so`` (fsynced, with its folder); returns the DSL
    runtime library linked against.

    Returns None (after a warning) when no linker is available or linking fails.
    """
    linker = shutil.which("gcc") or shutil.which("cc")
    if linker is None:
        log.warning("cutefa: no gcc/cc found; %s stays in memory and is not cached on disk", entry.name)
        return None
    libs = _runtime_libraries()
    runtime = next((p for p in libs if p.name.startswith("libcute_dsl_runtime")), None)
    if runtime is None:
        raise RuntimeError(
            f"the installed {identity.DSL_DIST} has no libcute_dsl_runtime library to link against"
        )
    tmp = f"{os.getpid()}.{threading.get_ident()}"
    obj, so = entry.dir / f".kernel.{tmp}.o", entry.dir / f".kernel.{tmp}.so"
    try:
        compiled.export_to_c(str(obj), function_name=entry.name, enable_pic=True)
        proc = subprocess.run(
            [linker, "-shared", "-o", str(so), str(obj), *map(str, libs)],
            check=False,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            log.warning("cutefa: linking %s failed; keeping it in memory only:\n%s", entry.name, proc.stderr)
            return None
        identity.commit_file(so, entry.so_path, 0o755)
    finally:
        obj.unlink(missing_ok=True)
        so.unlink(missing_ok=True)
    return runtime


def _commit(entry: Entry, runtime: Path, seconds: float) -> None:
    """Write meta.json last, atomically and durably: its presence means kernel.so is complete, and
    it records kernel.so's sha256."""
    kernel = KernelFile(entry.so_path)
    kernel.close()
    meta = {
        "name": entry.name,
        "target": entry.target,
        "fingerprint": entry.fingerprint,
        "sha256": kernel.sha256,
        "function_name": entry.name,
        "dsl_version": identity.dsl_version(),
        "abi": identity.ABI,
        # the DSL runtime flavour linked against (e.g. cu12), relative to the nvidia_cutlass_dsl wheel
        "runtime": runtime.parent.parent.name,
        "compile_seconds": round(seconds, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write(entry.meta_path, json.dumps(meta, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Filling the cache


def compile_variant(spec: VariantSpec, target: str, *, force: bool = False) -> Path | None:
    """Fill the disk cache for ``spec`` on ``target``; returns ``kernel.so``, or None if it could not be linked.

    Compiler errors propagate; from a child process (another target) they come as ``RuntimeError``.
    """
    entry = _entry(spec, target)
    entry = entry if not force and entry.committed() else build_home(entry)
    if can_compile_here(target):
        _build(entry, force)
    else:
        ok, _, error = _build_isolated(entry, force)
        if not ok:
            raise RuntimeError(f"compiling {spec.name} for {target} failed: {error}")
    return entry.so_path if entry.read_meta() else None


def compile_variants(
    specs: Sequence[VariantSpec], *, target: str, jobs: int = 1, progress: bool = True, force: bool = False
) -> list[CompileResult]:
    """Compile many variants for ``target`` in ``jobs`` processes; a failure does not stop the others.

    An interrupt (Ctrl-C) cancels the compiles not started yet, stops the running ones and
    propagates; what was committed to the cache so far stays there."""
    return _compile_all(specs, target, jobs, progress, force, None)


def _compile_all(
    specs: Sequence[VariantSpec],
    target: str,
    jobs: int,
    progress: bool,
    force: bool,
    keep: Callable[[CompileResult, Entry], CompileResult] | None,
) -> list[CompileResult]:
    """:func:`compile_variants`; ``keep(result, entry)`` sees each successful build as it finishes
    (in this thread) and returns the result to report for it."""
    from tqdm import tqdm

    results: dict[int, CompileResult] = {}
    entries: dict[int, Entry] = {}
    for i, spec in enumerate(specs):
        try:
            entry = _entry(spec, target)
            entries[i] = entry if not force and entry.committed() else build_home(entry)
        except Exception as exc:  # noqa: BLE001 -- a broken render or bad target fails that variant only
            results[i] = CompileResult(spec, False, 0.0, _describe(exc))
    here = jobs <= 1 and can_compile_here(target)
    outcomes = _run_here(entries, force) if here else _run_in_processes(entries, force, jobs)
    with (
        contextlib.closing(outcomes),
        tqdm(total=len(specs), disable=not progress, desc=f"cutefa compile {target}", unit="kernel") as bar,
    ):
        bar.update(len(results))
        for i, (ok, seconds, error) in outcomes:
            path = entries[i].so_path if ok and entries[i].read_meta() else None
            result = CompileResult(specs[i], ok, seconds, error, path)
            results[i] = keep(result, entries[i]) if keep is not None and ok else result
            bar.set_postfix_str(specs[i].name if results[i].ok else f"FAILED {specs[i].name}")
            bar.update(1)
    return [results[i] for i in range(len(specs))]


# ---------------------------------------------------------------------------------------------
# Running builds here or in child processes (``python -m cutefa.compile``)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _build_outcome(entry: Entry, force: bool) -> _Outcome:
    """Build one entry in this process, catching its failure."""
    start = time.perf_counter()
    try:
        _build(entry, force)
    except Exception as exc:  # noqa: BLE001 -- any compiler error fails this variant only
        return False, time.perf_counter() - start, _describe(exc)
    return True, time.perf_counter() - start, None


def _run_here(entries: dict[int, Entry], force: bool) -> Iterator[tuple[int, _Outcome]]:
    for i, entry in entries.items():
        yield i, _build_outcome(entry, force)


def _run_in_processes(entries: dict[int, Entry], force: bool, jobs: int) -> Iterator[tuple[int, _Outcome]]:
    """Build each entry in its own child process, ``jobs`` at a time. When the consumer stops early
    or an interrupt arrives, the builds not started are cancelled and the running ones terminated."""
    stop = threading.Event()
    running: set[subprocess.Popen] = set()
    threads = ThreadPoolExecutor(max(1, jobs))
    try:
        futures = {
            threads.submit(_build_isolated, entry, force, stop, running): i for i, entry in entries.items()
        }
        for fut in as_completed(futures):
            yield futures[fut], fut.result()
    finally:
        stop.set()
        threads.shutdown(wait=False, cancel_futures=True)
        for proc in list(running):
            proc.terminate()
        threads.shutdown(wait=True)


def _build_isolated(
    entry: Entry,
    force: bool,
    stop: threading.Event | None = None,
    running: set[subprocess.Popen] | None = None,
) -> _Outcome:
    """Build one entry in a child process set up for its target; a crash there fails this entry only.
    ``running`` holds the child while it runs; once ``stop`` is set no child starts."""
    cmd = [
        sys.executable, "-m", "cutefa.compile", "--target", entry.target, "--name", entry.name,
        "--source", str(entry.source), "--fingerprint", entry.fingerprint, "--cache-dir", str(entry.root),
    ]  # fmt: skip
    package_root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "CUTE_DSL_ARCH": entry.target, "PYTHONPATH": pythonpath}
    start = time.perf_counter()
    if stop is not None and stop.is_set():
        return False, 0.0, "cancelled"
    proc = subprocess.Popen(
        cmd + (["--force"] if force else []),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if running is not None:
        running.add(proc)
    try:
        if stop is not None and stop.is_set():
            proc.terminate()
        stdout, stderr = proc.communicate()
    finally:
        if running is not None:
            running.discard(proc)
    for line in reversed(stdout.splitlines()):
        if line.startswith(_RESULT_TAG):
            ok, seconds, error = json.loads(line[len(_RESULT_TAG) :])
            return ok, seconds, error
    tail = "\n".join(stderr.strip().splitlines()[-20:])
    return False, time.perf_counter() - start, f"the compiler process exited with {proc.returncode}:\n{tail}"


_RESULT_TAG = "cutefa-compile-result: "


def _worker_main(argv: Sequence[str] | None = None) -> int:
    """Child-process entry: build one cache entry and print its outcome as a tagged JSON line."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cutefa.compile", description=_worker_main.__doc__)
    for flag in ("--target", "--name", "--source", "--fingerprint", "--cache-dir"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    entry = Entry(args.name, args.target, Path(args.source), args.fingerprint, Path(args.cache_dir))
    ok, seconds, error = _build_outcome(entry, args.force)
    print(_RESULT_TAG + json.dumps([ok, seconds, error]), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_worker_main())
