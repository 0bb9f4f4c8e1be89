"""Compile variants with the CuTe DSL over fake tensors, cache them on disk, load them through TVM-FFI.

One compiled kernel serves every batch size, sequence length and head count: the DSL sees fake
tensors whose dynamic dims are shared ``SymInt`` objects. The kernel is exported with the TVM-FFI
calling convention, linked into ``kernel.so`` and called through that C ABI by :mod:`cutefa.ffi`, so a cached
kernel loads in about a millisecond without the DSL compiler, takes torch tensors directly and runs
on the caller's current torch stream.

Disk layout (``CUTEFA_CACHE_DIR``, default ``~/.cache/cutefa``)::

    <dir>/<target>/<name>-<fingerprint[:16]>/kernel.so   the linked kernel
                                            /meta.json   written last: the commit marker
                                            /.lock       flock'ed while building
    <dir>/sources/<arch>/<name>.py                        rendered modules of non-default variants

The DSL reads ``CUTE_DSL_ARCH`` once, at ``import cutlass``, and only compiles for that target. So
a process compiles in-process only for the target its DSL was set up for (the first compile picks
it when ``cutlass`` is not imported yet); other targets compile in child processes
(``python -m cutefa.compile ...``, one per variant) started with ``CUTE_DSL_ARCH`` set.

Where :func:`get_kernel` finds a kernel, in order: the kernel packs (:mod:`cutefa.pack`) on
``CUTEFA_KERNEL_PATH`` and in ``<cache dir>/packs``, then the cache entries above, then a JIT
compile into the cache (logged; ``CUTEFA_JIT=0`` makes it an error naming the command that builds
the kernel ahead of time). Nothing on the way to a packed or cached kernel imports the DSL compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
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

from cutefa import profile, space
from cutefa.spec import VariantSpec, parse_name, target_cc

log = logging.getLogger("cutefa")

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
# Where codegen commits the default variants' modules (codegen.module_path; a test keeps them equal).
# Reading them from here spares the kernel-loading path the import of codegen and jinja2.
GENERATED_DIR = Path(__file__).resolve().parent.parent / "generated"
# Bump when the compiled calling convention below changes (fake-tensor signature, export flavour).
_ABI = "tvm-ffi-v1"
ABI = _ABI
_DSL_DIST = "nvidia-cutlass-dsl"
_DSL_DTYPES = {"fp16": "Float16", "bf16": "BFloat16", "e4m3": "Float8E4M3FN"}
_ROW_ALIGN_BYTES = 16

# (variant name, target) -> callable(q, k, v, o, lse, softmax_scale); e4m3 forwards take
# (q, k, v, o, lse, q_descale, k_descale, v_descale, softmax_scale)
_KERNELS: dict[tuple[str, str], Callable[..., Any]] = {}
_KERNELS_LOCK = threading.Lock()
_RUNTIMES: dict[Path, ctypes.CDLL] = {}
# (variant name, target) -> where its kernel came from: "pack <dir>", "cache <dir>" or "jit <dir>"
_ORIGINS: dict[tuple[str, str], str] = {}

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


@dataclass(frozen=True)
class _Entry:
    """One cache entry: a variant's source compiled for one target."""

    name: str
    target: str
    source: Path
    fingerprint: str
    root: Path

    @property
    def dir(self) -> Path:
        return self.root / self.target / f"{self.name}-{self.fingerprint[:16]}"

    @property
    def so_path(self) -> Path:
        return self.dir / "kernel.so"

    @property
    def meta_path(self) -> Path:
        return self.dir / "meta.json"

    def read_meta(self) -> dict[str, Any] | None:
        """The committed meta.json, or None when the entry is not (validly) committed."""
        try:
            meta = json.loads(self.meta_path.read_text())
        except (OSError, ValueError):
            return None
        if meta.get("fingerprint") != self.fingerprint or not self.so_path.is_file():
            return None
        return meta


# ---------------------------------------------------------------------------------------------
# Paths, sources and fingerprints


def cache_dir() -> Path:
    """The on-disk cache root: ``$CUTEFA_CACHE_DIR`` or ``~/.cache/cutefa``."""
    return Path(os.environ.get("CUTEFA_CACHE_DIR") or Path.home() / ".cache" / "cutefa").expanduser()


def dsl_version() -> str:
    """The installed ``nvidia-cutlass-dsl`` version (read without importing the DSL)."""
    return importlib.metadata.version(_DSL_DIST)


def kernel_source_path(spec: VariantSpec) -> Path:
    """The variant's generated module: the committed file, else one rendered into the cache dir."""
    committed = GENERATED_DIR / spec.arch / f"{spec.name}.py"
    if committed.is_file():
        return committed
    from cutefa import codegen

    committed = Path(codegen.module_path(spec))
    if committed.is_file():
        return committed
    text = codegen.render_source(spec)
    path = cache_dir() / "sources" / spec.arch / f"{spec.name}.py"
    if not path.is_file() or path.read_text() != text:
        _atomic_write(path, text)
    return path


def load_kernel_module(spec: VariantSpec) -> ModuleType:
    """Import the variant's generated module from its file (the DSL reads kernel source with inspect).

    Importing it imports ``cutlass``: set the target up first (see module docs).
    """
    return _import_file(kernel_source_path(spec), spec.name)


def fingerprint(spec: VariantSpec, target: str) -> str:
    """sha256 over everything the compiled kernel depends on (see :func:`_fingerprint`)."""
    return _fingerprint(kernel_source_path(spec).read_text(), target)


def _fingerprint(source: str, target: str) -> str:
    """Hash the generated source, the kernel building blocks it imports, the DSL version, target and ABI."""
    h = hashlib.sha256()
    for part in (_ABI, dsl_version(), target, _building_blocks_digest(source), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


_KERNELS_PACKAGE = "cutefa.kernels"


def _building_blocks_digest(source: str) -> str:
    """Digest (paths and contents) of the ``cutefa/kernels`` files a kernel module depends on: the
    ones its imports of ``cutefa.kernels`` name, the package ``__init__`` files on their way, and so
    on through their own imports. An edit to a building block this kernel does not import leaves its
    fingerprint (and its packed and cached builds) valid. Where an import of ``cutefa.kernels``
    cannot be resolved to a file, every file under it counts."""
    files = _kernel_closure(source)
    return _files_digest(
        tuple(sorted(files)) if files is not None else tuple(sorted(KERNELS_DIR.rglob("*.py")))
    )


@functools.cache
def _files_digest(files: tuple[Path, ...]) -> str:
    """sha256 over the paths (relative to cutefa/kernels) and contents of ``files``, once per process."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(KERNELS_DIR).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _kernel_closure(source: str) -> set[Path] | None:
    """The ``cutefa/kernels`` files that ``source`` (a generated kernel module) imports, directly or
    through them; None when one of the imports names no file."""
    todo = _kernel_imports(source, None)
    if todo is None:
        return None
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        more = _file_kernel_imports(path)
        if more is None:
            return None
        todo |= more - seen
    return seen


@functools.cache
def _file_kernel_imports(path: Path) -> frozenset[Path] | None:
    """:func:`_kernel_imports` of a building-block file (read once per process)."""
    parts = path.relative_to(KERNELS_DIR).with_suffix("").parts
    package = ".".join((_KERNELS_PACKAGE, *parts[:-1]))
    found = _kernel_imports(path.read_text(), package)
    return None if found is None else frozenset(found)


# Import statements, as the generated modules and the building blocks write them: ``from X import
# a, b`` (names possibly parenthesized over lines, ``as`` aliases, comments) and ``import X[, Y]``.
_FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)", re.MULTILINE)
_PLAIN_IMPORT = re.compile(r"^[ \t]*import[ \t]+([^\n]*)", re.MULTILINE)


def _import_names(text: str) -> list[str]:
    """The imported names of an import list (``a, b as c`` or ``(a,\n b)``), comments dropped."""
    text = re.sub(r"#[^\n]*", "", text).strip("() \t\n")
    return [part.split()[0] for part in text.replace("\n", " ").split(",") if part.strip()]


def _kernel_imports(source: str, package: str | None) -> set[Path] | None:
    """The ``cutefa/kernels`` files the import statements of ``source`` name (not followed): each
    imported module of the package, the modules among the names a ``from`` import takes, and the
    package ``__init__`` files on the way. ``package``: the dotted package of ``source``, for its
    relative imports. None when a module of the package resolves to no file."""
    found: set[Path] = set()
    imports = [(m.group(1), _import_names(m.group(2))) for m in _FROM_IMPORT.finditer(source)]
    imports += [(name, []) for m in _PLAIN_IMPORT.finditer(source) for name in _import_names(m.group(1))]
    for module, names in imports:
        level = len(module) - len(module.lstrip("."))
        if level:
            if package is None:
                return None
            base = package.split(".")[: len(package.split(".")) - (level - 1)]
            module = ".".join([*base, module[level:]] if module[level:] else base)
        if not (module == _KERNELS_PACKAGE or module.startswith(_KERNELS_PACKAGE + ".")):
            continue
        files = _module_files(module)
        if files is None:
            return None
        found |= files
        for name in names:  # ``from cutefa.kernels.sm90 import parts``: parts is a module
            found |= _module_files(f"{module}.{name}") or set()
    return found


def _module_files(module: str) -> set[Path] | None:
    """The files importing ``module`` (in cutefa.kernels) runs: the package ``__init__`` files from
    cutefa/kernels down, and the module's own file; None when it has none."""
    parts = module.split(".")[2:]
    files = {p for p in [KERNELS_DIR / "__init__.py"] if p.is_file()}
    here = KERNELS_DIR
    for part in parts[:-1]:
        here = here / part
        if (here / "__init__.py").is_file():
            files.add(here / "__init__.py")
    if not parts:
        return files
    leaf = here / parts[-1]
    if leaf.with_suffix(".py").is_file():
        return files | {leaf.with_suffix(".py")}
    if leaf.is_dir():
        return files | ({leaf / "__init__.py"} if (leaf / "__init__.py").is_file() else set())
    return None


def _entry(spec: VariantSpec, target: str) -> _Entry:
    target_cc(target)  # raises ValueError naming the known targets
    if not spec.runs_on(target):
        raise ValueError(f"{spec.name}: kernel family {spec.arch} does not run on target {target!r}")
    source = kernel_source_path(spec)
    return _Entry(spec.name, target, source, _fingerprint(source.read_text(), target), cache_dir())


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temp file next to ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    grid = (cutlass.Int32(1),) if spec.persistent else ()
    return q, k, v, o, lse, cutlass.Float32(1.0), *grid, stream


def compile_object(spec: VariantSpec, target: str) -> Any:
    """Trace and compile ``spec`` for ``target`` in this process, bypassing every cache (inspection,
    SASS dumps). The process must be set up for ``target`` (see :func:`can_compile_here`)."""
    return _compile(_entry(spec, target))


def _compile(entry: _Entry) -> Any:
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
    args = make_args(parse_name(entry.name), cutlass, cute)
    # A generated module may name ptxas options of its own (e.g. a register-usage level that keeps
    # ptxas on the uniform datapath); the constant is part of the hashed source.
    ptxas = getattr(module, "PTXAS_OPTIONS", "")
    options = "--enable-tvm-ffi" + (f" --ptxas-options '{ptxas}'" if ptxas else "")
    return cute.compile(module.Kernel(), *args, options=options)


# ---------------------------------------------------------------------------------------------
# Building an entry: lock, compile, export, link, commit


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(entry: _Entry, force: bool = False) -> Any:
    """Compile ``entry`` here and commit it to disk unless already committed.

    Returns the compiled object when this call compiled it, None when the entry was already
    committed (perhaps by another process while we waited for the lock).
    """
    if not force and entry.read_meta():
        return None
    entry.dir.mkdir(parents=True, exist_ok=True)
    with _locked(entry.dir / ".lock"):
        if not force and entry.read_meta():
            return None
        entry.meta_path.unlink(missing_ok=True)
        start = time.perf_counter()
        compiled = _compile(entry)
        seconds = time.perf_counter() - start
        runtime = _export(compiled, entry)
        if runtime is not None:
            _commit(entry, runtime, seconds)
        return compiled


def _export(compiled: Any, entry: _Entry) -> Path | None:
    """Export the TVM-FFI object and link ``kernel.so``; returns the DSL runtime library linked against.

    Returns None (after a warning) when no linker is available or linking fails.
    """
    linker = shutil.which("gcc") or shutil.which("cc")
    if linker is None:
        log.warning("cutefa: no gcc/cc found; %s stays in memory and is not cached on disk", entry.name)
        return None
    from cutlass import cute

    libs = [Path(p) for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)]
    runtime = next((p for p in libs if p.name.startswith("libcute_dsl_runtime")), None)
    if runtime is None:
        raise RuntimeError(f"the installed {_DSL_DIST} has no libcute_dsl_runtime library to link against")
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
        os.replace(so, entry.so_path)
    finally:
        obj.unlink(missing_ok=True)
        so.unlink(missing_ok=True)
    return runtime


def _commit(entry: _Entry, runtime: Path, seconds: float) -> None:
    """Write meta.json last and atomically: its presence means kernel.so is complete."""
    meta = {
        "name": entry.name,
        "target": entry.target,
        "fingerprint": entry.fingerprint,
        "function_name": entry.name,
        "dsl_version": dsl_version(),
        "abi": _ABI,
        # the DSL runtime flavour linked against (e.g. cu12), relative to the nvidia_cutlass_dsl wheel
        "runtime": runtime.parent.parent.name,
        "compile_seconds": round(seconds, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _atomic_write(entry.meta_path, json.dumps(meta, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Loading linked kernels (no DSL import)


class KernelUnavailableError(RuntimeError):
    """No pack or cache entry has the kernel, and JIT compiling is turned off (``CUTEFA_JIT=0``)."""


def jit_enabled() -> bool:
    """Whether a kernel found in no pack and not in the cache may be compiled at run time."""
    return os.environ.get("CUTEFA_JIT", "1").strip().lower() not in ("0", "false", "no", "off")


def runtime_library(flavour: str) -> Path:
    """``libcute_dsl_runtime.so`` of the installed DSL wheel for ``flavour`` (e.g. 'cu12')."""
    import nvidia_cutlass_dsl

    for base in nvidia_cutlass_dsl.__path__:
        path = Path(base) / flavour / "lib" / "libcute_dsl_runtime.so"
        if path.is_file():
            return path
    raise RuntimeError(f"the installed {_DSL_DIST} has no {flavour}/lib/libcute_dsl_runtime.so")


def _runtime_for(flavour: str) -> Path:
    """The DSL runtime to load for a kernel linked against ``flavour``; another flavour of the same
    DSL version when that one is not installed (a kernel names the runtime by soname only, and the
    flavours export one ABI: a cu12-linked kernel was seen running on a cu13 runtime)."""
    try:
        return runtime_library(flavour)
    except RuntimeError:
        import nvidia_cutlass_dsl

        for base in nvidia_cutlass_dsl.__path__:
            for path in sorted(Path(base).glob("*/lib/libcute_dsl_runtime.so")):
                log.debug("cutefa: no %s DSL runtime installed; using %s", flavour, path)
                return path
        raise


def load_library(so_path: Path, function_name: str, runtime: str) -> Callable[..., Any]:
    """Load a linked kernel ``.so`` (after the DSL runtime it needs) and return its function, called
    through the TVM-FFI C ABI by :mod:`cutefa.ffi` (the ``tvm_ffi`` package is not imported)."""
    with profile.phase("DSL runtime library (find, dlopen)"):
        lib = _runtime_for(runtime)
        if lib not in _RUNTIMES:
            _RUNTIMES[lib] = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    from cutefa import ffi

    with profile.phase("kernel library (dlopen libtvm_ffi and the kernel)"):
        return ffi.load(so_path, function_name)


def _load(entry: _Entry) -> Callable[..., Any]:
    """Load a committed entry's ``kernel.so`` and return its function."""
    meta = entry.read_meta()
    if meta is None:
        raise RuntimeError(f"cache entry {entry.dir} is not committed")
    return load_library(entry.so_path, meta["function_name"], meta["runtime"])


def loaded_kernels() -> dict[tuple[str, str], str]:
    """(variant name, target) -> where this process got the kernel: 'pack DIR', 'cache DIR' or 'jit DIR'."""
    return dict(_ORIGINS)


# ---------------------------------------------------------------------------------------------
# Public entry points


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
            _KERNELS[key] = _with_sm_count(fn) if spec.persistent else fn
        return _KERNELS[key]


def _with_sm_count(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(q, k, v, o, lse, softmax_scale)`` (the fp8 forward: with its three descales before the
    scale) for a persistent kernel, whose compiled entry also takes the number of CTAs to launch:
    the SM count of q's GPU (looked up once per device)."""
    return _WithSmCount(fn)


class _WithSmCount:
    __slots__ = ("_counts", "fn")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._counts: dict[int, int] = {}

    def sms(self, device: int) -> int:
        sms = self._counts.get(device)
        if sms is None:
            import torch

            # Tensors not on a GPU (device -1) get 1: the kernel's own checks then refuse them.
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device >= 0 else 1
            self._counts[device] = sms
        return sms

    def __call__(self, *args: Any) -> Any:
        # (q, k, v, o, lse, softmax_scale) or the fp8 forward's (q, k, v, o, lse, q_descale,
        # k_descale, v_descale, softmax_scale): the SM count goes last either way.
        return self.fn(*args, self.sms(args[0].get_device()))

    def bind(self, args: Sequence[Any], tensor_slots: Sequence[int]) -> Any:
        """:meth:`cutefa.ffi.Function.bind` of the kernel with the SM count appended (AttributeError
        when the kernel has none: a DSL object kept in memory, not loaded from a file)."""
        return self.fn.bind([*args, self.sms(args[0].get_device())], tensor_slots)


def build_command(name: str, target: str, pack_dir: Path | str | None = None) -> str:
    """The command line that builds variant ``name`` for ``target`` into a kernel pack."""
    from cutefa import pack

    where = pack_dir if pack_dir is not None else pack.default_pack_dir(target)
    return f"cutefa compile --target {target} --kernels {name} --pack {where}"


def _prepare(spec: VariantSpec, target: str) -> Callable[..., Any]:
    """Find, load or build the kernel (see the module docs); never imports the DSL unless it compiles."""
    if "cutefa.pack" not in sys.modules:
        with profile.phase("import cutefa.pack"):
            from cutefa import pack
    from cutefa import pack

    target_cc(target)  # raises ValueError naming the known targets
    if not spec.runs_on(target):
        raise ValueError(f"{spec.name}: kernel family {spec.arch} does not run on target {target!r}")
    too_big = space.why_not_on(spec, target)
    if too_big is not None:
        raise ValueError(f"{spec.name} cannot run on target {target!r}: {too_big}")
    try:
        with profile.phase("kernel source fingerprint"):
            entry: _Entry | None = _entry(spec, target)
    except Exception as exc:  # noqa: BLE001 -- no source here (e.g. no templates): packs may still serve
        log.debug(
            "cutefa: no kernel source for %s (%s); pack kernels are not checked for staleness", spec.name, exc
        )
        entry, source_error = None, _describe(exc)
    found, refusals = pack.find_kernel(spec.name, target, entry.fingerprint if entry else None)
    if found is not None:
        fn = load_library(found.path, found.function_name, found.runtime)
        _ORIGINS[(spec.name, target)] = f"pack {found.pack}"
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
    if entry.read_meta():
        fn = _load(entry)
        _ORIGINS[(spec.name, target)] = f"cache {entry.dir}"
        return fn
    searched = pack.search_dirs()
    if not jit_enabled():
        searched_text = ", ".join(str(d) for d in searched)
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
    log.warning(
        "cutefa: %s for %s is in no kernel pack (searched: %s) nor the cache; compiling it now (JIT) "
        "into %s. To ship it instead: %s",
        spec.name, target, ", ".join(str(d) for d in searched), entry.root, build_command(spec.name, target),
    )  # fmt: skip
    fn = _jit(entry)
    _ORIGINS[(spec.name, target)] = f"jit {entry.root}"
    return fn


def _jit(entry: _Entry) -> Callable[..., Any]:
    """Compile ``entry`` into the cache (here or in a child process) and load it."""
    if can_compile_here(entry.target):
        compiled = _build(entry)
        return _load(entry) if entry.read_meta() else compiled
    ok, _, error = _build_isolated(entry, False)
    if not ok:
        raise RuntimeError(f"compiling {entry.name} for {entry.target} failed: {error}")
    if not entry.read_meta():
        raise RuntimeError(
            f"{entry.name} for {entry.target} was compiled in a child process but could not be "
            "linked (is gcc installed?); compile it in-process instead"
        )
    return _load(entry)


def compile_variant(spec: VariantSpec, target: str, *, force: bool = False) -> Path | None:
    """Fill the disk cache for ``spec`` on ``target``; returns ``kernel.so``, or None if it could not be linked.

    Compiler errors propagate; from a child process (another target) they come as ``RuntimeError``.
    """
    entry = _entry(spec, target)
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
    """Compile many variants for ``target`` in ``jobs`` processes; a failure does not stop the others."""
    from tqdm import tqdm

    results: dict[int, CompileResult] = {}
    entries: dict[int, _Entry] = {}
    for i, spec in enumerate(specs):
        try:
            entries[i] = _entry(spec, target)
        except Exception as exc:  # noqa: BLE001 -- a broken render or bad target fails that variant only
            results[i] = CompileResult(spec, False, 0.0, _describe(exc))
    here = jobs <= 1 and can_compile_here(target)
    outcomes = _run_here(entries, force) if here else _run_in_processes(entries, force, jobs)
    with tqdm(total=len(specs), disable=not progress, desc=f"cutefa compile {target}", unit="kernel") as bar:
        bar.update(len(results))
        for i, (ok, seconds, error) in outcomes:
            path = entries[i].so_path if ok and entries[i].read_meta() else None
            results[i] = CompileResult(specs[i], ok, seconds, error, path)
            bar.set_postfix_str(specs[i].name if ok else f"FAILED {specs[i].name}")
            bar.update(1)
    return [results[i] for i in range(len(specs))]


# ---------------------------------------------------------------------------------------------
# Running builds here or in child processes (``python -m cutefa.compile``)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _build_outcome(entry: _Entry, force: bool) -> _Outcome:
    """Build one entry in this process, catching its failure."""
    start = time.perf_counter()
    try:
        _build(entry, force)
    except Exception as exc:  # noqa: BLE001 -- any compiler error fails this variant only
        return False, time.perf_counter() - start, _describe(exc)
    return True, time.perf_counter() - start, None


def _run_here(entries: dict[int, _Entry], force: bool) -> Iterator[tuple[int, _Outcome]]:
    for i, entry in entries.items():
        yield i, _build_outcome(entry, force)


def _run_in_processes(entries: dict[int, _Entry], force: bool, jobs: int) -> Iterator[tuple[int, _Outcome]]:
    """Build each entry in its own child process, ``jobs`` at a time."""
    with ThreadPoolExecutor(max(1, jobs)) as threads:
        futures = {threads.submit(_build_isolated, entry, force): i for i, entry in entries.items()}
        for fut in as_completed(futures):
            yield futures[fut], fut.result()


def _build_isolated(entry: _Entry, force: bool) -> _Outcome:
    """Build one entry in a child process set up for its target; a crash there fails this entry only."""
    cmd = [
        sys.executable,
        "-m",
        "cutefa.compile",
        "--target",
        entry.target,
        "--name",
        entry.name,
        "--source",
        str(entry.source),
        "--fingerprint",
        entry.fingerprint,
        "--cache-dir",
        str(entry.root),
    ]
    package_root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "CUTE_DSL_ARCH": entry.target, "PYTHONPATH": pythonpath}
    start = time.perf_counter()
    proc = subprocess.run(
        cmd + (["--force"] if force else []), env=env, capture_output=True, text=True, check=False
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_TAG):
            ok, seconds, error = json.loads(line[len(_RESULT_TAG) :])
            return ok, seconds, error
    tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
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
    entry = _Entry(args.name, args.target, Path(args.source), args.fingerprint, Path(args.cache_dir))
    ok, seconds, error = _build_outcome(entry, args.force)
    print(_RESULT_TAG + json.dumps([ok, seconds, error]), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_worker_main())
