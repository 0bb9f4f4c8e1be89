"""Find the kernel of a variant: the kernel packs, then the compile cache, then a JIT compile.

Where :func:`get_kernel` finds a kernel, in order: the kernel packs (:mod:`cutefa.pack`) on
``CUTEFA_KERNEL_PATH`` and in ``<cache dir>/packs``, then the entries of the compile cache
(:mod:`cutefa.cache`), then a JIT compile into the cache (logged; ``CUTEFA_JIT=0`` makes it an
error naming the command that builds the kernel ahead of time). A source that fails falls through
to the next one with a warning naming why: a pack kernel that does not load, a cache entry that
fails its checksum or does not load (moved to the cache's ``quarantine/`` and built again).
Nothing on the way to a packed or cached kernel imports the DSL compiler. A found kernel is loaded
through the TVM-FFI C ABI (:mod:`cutefa.ffi`), from the descriptor its checksum was computed
from, and memoized per (variant name, target).
"""

from __future__ import annotations

import logging
import os
import shlex
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cutefa import cache, ffi, identity, pack, profile
from cutefa import compile as cc
from cutefa.ffi import load_library
from cutefa.model.rules import why_not_on
from cutefa.model.spec import VariantSpec, target_cc

log = logging.getLogger("cutefa")

# (variant name, target) -> callable(q, k, v, o, lse, softmax_scale); e4m3 forwards take
# (q, k, v, o, lse, q_descale, k_descale, v_descale, softmax_scale)
_KERNELS: dict[tuple[str, str], Callable[..., Any]] = {}
_KERNELS_LOCK = threading.Lock()
# (variant name, target) -> where its kernel came from: "pack <dir>", "cache <dir>" or "jit <dir>"
_ORIGINS: dict[tuple[str, str], str] = {}


class KernelUnavailableError(RuntimeError):
    """No pack or cache entry has the kernel, and JIT compiling is turned off (``CUTEFA_JIT=0``)."""


def jit_enabled() -> bool:
    """Whether a kernel found in no pack and not in the cache may be compiled at run time."""
    return os.environ.get("CUTEFA_JIT", "1").strip().lower() not in ("0", "false", "no", "off")


def loaded_kernels() -> dict[tuple[str, str], str]:
    """(variant name, target) -> where this process got the kernel: 'pack DIR', 'cache DIR' or 'jit DIR'."""
    return dict(_ORIGINS)


def build_command(name: str, target: str, pack_dir: Path | str | None = None) -> str:
    """The command line (shell-quoted) that builds variant ``name`` for ``target`` into a kernel pack:
    ``pack_dir``, else the pack searched without any setting (``DIR`` when
    ``CUTEFA_TRUSTED_PACKS_ONLY=1`` searches none)."""
    if pack_dir is None:
        pack_dir = "DIR" if pack.trusted_only() else pack.default_pack_dir(target)
    return shlex.join(["cutefa", "compile", "--target", target, "--kernels", name, "--pack", str(pack_dir)])


def get_kernel(spec: VariantSpec, target: str) -> Callable[..., Any]:
    """The kernel for ``spec`` on ``target``: ``fn(q, k, v, o, lse, softmax_scale)`` (e4m3 forwards:
    ``fn(q, k, v, o, lse, q_descale, k_descale, v_descale, softmax_scale)``, see the module's
    ``fake_arguments``).

    Memoized per (name, target); the first call looks in the kernel packs, then the cache, and
    compiles the kernel into the cache when neither has it (see the module docs).
    """
    fn = _KERNELS.get((spec.name, target))
    if fn is not None:
        return fn
    with _KERNELS_LOCK:
        key = (spec.name, target)
        if key not in _KERNELS:
            fn = _prepare(spec, target)
            _KERNELS[key] = _with_sm_count(fn) if cc.takes_sm_count(spec) else fn
        return _KERNELS[key]


def _with_sm_count(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for a persistent kernel: :class:`cutefa.ffi.WithSmCount` appends the SM count."""
    return ffi.WithSmCount(fn)


def _prepare(spec: VariantSpec, target: str) -> Callable[..., Any]:
    """Find, load or build the kernel (see the module docs); never imports the DSL unless it compiles."""
    target_cc(target)  # raises ValueError naming the known targets
    if not spec.runs_on(target):
        raise ValueError(f"{spec.name}: kernel family {spec.arch} does not run on target {target!r}")
    too_big = why_not_on(spec, target)
    if too_big is not None:
        raise ValueError(f"{spec.name} cannot run on target {target!r}: {too_big}")
    try:
        with profile.phase("kernel source fingerprint"):
            entry: cache.Entry | None = cc._entry(spec, target)
    except Exception as exc:  # noqa: BLE001 -- no source here (e.g. no templates): packs may still serve
        log.debug(
            "cutefa: no kernel source for %s (%s); pack kernels are not checked for staleness", spec.name, exc
        )
        entry, source_error = None, cc._describe(exc)
    refusals: list[str] = []
    fn = _from_packs(spec, target, entry, refusals)
    if fn is not None:
        return fn
    if refusals:
        log.warning(
            "cutefa: %s for %s: no kernel pack could serve it:\n%s",
            spec.name, target, "\n".join(f"  {r}" for r in refusals),
        )  # fmt: skip
    if entry is None:
        raise KernelUnavailableError(
            f"cutefa: {spec.name} for {target} is in no usable kernel pack, and it cannot be compiled "
            f"here: {source_error}. Build it where cutefa's sources are and put the pack on "
            f"CUTEFA_KERNEL_PATH: {build_command(spec.name, target, 'DIR')}"
        )
    fn = _from_cache(entry, refusals)
    if fn is not None:
        return fn
    searched = pack.search_dirs()
    if not jit_enabled():
        searched_text = ", ".join(str(d) for d in searched) or "no pack folder"
        head = (
            f"cutefa: no compiled kernel {spec.name} for {target}, and CUTEFA_JIT=0 forbids compiling "
            "it here. Build it ahead of time (no GPU needed) into a pack that is searched:"
        )
        lines = [
            head,
            f"    {build_command(spec.name, target)}",
            f"or into a directory named in CUTEFA_KERNEL_PATH. Searched: {searched_text}; the cache {entry.root}.",
            *(f"Refused: {r}" for r in refusals),
        ]
        raise KernelUnavailableError("\n".join(lines))
    home = cache.build_home(entry)
    log.warning(
        "cutefa: %s for %s is in no kernel pack (searched: %s) nor the cache; compiling it now (JIT) "
        "into %s. To ship it instead: %s",
        spec.name, target, ", ".join(str(d) for d in searched), home.root, build_command(spec.name, target),
    )  # fmt: skip
    fn = _jit(home)
    _ORIGINS[(spec.name, target)] = f"jit {home.root}"
    return fn


def _from_packs(
    spec: VariantSpec, target: str, entry: cache.Entry | None, refusals: list[str]
) -> Callable[..., Any] | None:
    """The kernel from the first pack whose kernel passes its checks and loads; the packs refused on
    the way are added to ``refusals`` (one whose kernel does not load is also warned about when a
    later pack serves)."""
    failed: list[str] = []
    for found in pack.candidates(spec.name, target, entry.fingerprint if entry else None, refusals):
        try:
            fn = load_library(found.file, found.function_name, found.runtime)
        except ffi.KernelLoadError as exc:
            failed.append(f"pack {found.pack}: {spec.name}: cannot be loaded: {exc}")
            refusals.append(failed[-1])
            continue
        if failed:
            log.warning(
                "cutefa: %s for %s: skipped:\n%s", spec.name, target, "\n".join(f"  {r}" for r in failed)
            )
        _ORIGINS[(spec.name, target)] = f"pack {found.pack}"
        return fn
    return None


def _from_cache(entry: cache.Entry, refusals: list[str]) -> Callable[..., Any] | None:
    """The kernel of the committed cache entry, or None. An entry that fails its checks or does not
    load is moved to the quarantine (when the cache can be written), warned about and added to
    ``refusals``; a cache dir that is not trusted is not read (one warning)."""
    problem = identity.cache_problem()
    if problem is not None:
        cache.warn_cache(entry.root, problem)
        refusals.append(f"cache {entry.root}: not used: {problem}")
        return None
    meta = entry.read_meta()
    if meta is None:
        return None
    try:
        fn = _load(entry, meta)
    except cache.DamagedEntry as exc:
        moved = cache.quarantine(entry)
        where = f"moved to {moved}" if moved else "left in place (the cache cannot be written)"
        log.warning("cutefa: cache entry %s: %s; %s", entry.dir, exc, where)
        refusals.append(f"cache {entry.dir}: {exc} ({where})")
        return None
    _ORIGINS[(entry.name, entry.target)] = f"cache {entry.dir}"
    return fn


def _load(entry: cache.Entry, meta: dict[str, Any]) -> Callable[..., Any]:
    """Load a committed entry's ``kernel.so`` (after its checks) and return its function; raises
    :class:`cutefa.cache.DamagedEntry` when it fails a check or does not load."""
    kernel = entry.open_kernel(meta)
    try:
        return load_library(kernel, meta["function_name"], meta["runtime"])
    except ffi.KernelLoadError as exc:
        raise cache.DamagedEntry(f"kernel.so cannot be loaded: {exc}") from None


def _jit(entry: cache.Entry) -> Callable[..., Any]:
    """Compile ``entry`` into the cache (here or in a child process) and load it; a kernel compiled
    here that cannot be committed or loaded runs from memory."""
    if cc.can_compile_here(entry.target):
        compiled = cc._build(entry)
        meta = entry.read_meta()
        if meta is None:
            return compiled
        try:
            return _load(entry, meta)
        except cache.DamagedEntry as exc:
            if compiled is None:
                raise RuntimeError(f"{entry.name} for {entry.target}: {exc}") from None
            log.warning("cutefa: %s: %s; it runs from memory", entry.dir, exc)
            return compiled
    ok, _, error = cc._build_isolated(entry, False)
    if not ok:
        raise RuntimeError(f"compiling {entry.name} for {entry.target} failed: {error}")
    meta = entry.read_meta()
    if meta is None:
        raise RuntimeError(
            f"{entry.name} for {entry.target} was compiled in a child process but could not be "
            "linked or written (is gcc installed? is the disk full?); compile it in-process instead"
        )
    try:
        return _load(entry, meta)
    except cache.DamagedEntry as exc:
        raise RuntimeError(f"{entry.name} for {entry.target}: {exc}") from None
