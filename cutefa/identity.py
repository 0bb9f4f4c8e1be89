"""What identifies a compiled kernel, and where cutefa keeps sources and builds.

A compiled kernel is valid for exactly one (generated source, kernel building blocks it imports,
DSL version, compile target, calling convention); :func:`fingerprint` hashes them, and the compile
cache and kernel packs both key and check their kernels by it. A module rendered on demand (a
variant not committed to ``generated/``) is kept under :func:`render_digest`, the hash of what
rendering reads (the templates, the cutefa modules that render them, jinja2's version), so a
later process finds it without rendering again.

This module is a leaf: it imports nothing from cutefa (it reads cutefa's files as text), so the
compile cache, packs and codegen can all use it without importing one another.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import os
import threading
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
TEMPLATES_DIR = REPO_ROOT / "templates"
GENERATED_DIR = REPO_ROOT / "generated"  # the committed, dispatchable modules
KERNELS_DIR = PACKAGE_DIR / "kernels"  # the CuTe DSL building blocks generated modules import

# The calling convention of compiled kernels (fake-tensor signature, export flavour): bump it when
# that changes, and every cache entry and pack built before is refused.
ABI = "tvm-ffi-v1"
DSL_DIST = "nvidia-cutlass-dsl"
CACHE_ENV = "CUTEFA_CACHE_DIR"


def dsl_version() -> str:
    """The installed ``nvidia-cutlass-dsl`` version (read without importing the DSL)."""
    return importlib.metadata.version(DSL_DIST)


def cache_dir() -> Path:
    """The on-disk cache root: ``$CUTEFA_CACHE_DIR`` or ``~/.cache/cutefa``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cutefa").expanduser()


# ---------------------------------------------------------------------------------------------
# Fingerprints


def fingerprint(source: str, target: str) -> str:
    """sha256 over the calling convention, the DSL version, the target, the building blocks the
    generated module ``source`` imports (:func:`building_blocks_digest`) and ``source`` itself."""
    h = hashlib.sha256()
    for part in (ABI, dsl_version(), target, building_blocks_digest(source), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def building_blocks_digest(source: str) -> str:
    """Digest (paths and contents) of the ``cutefa/kernels`` files a kernel module depends on: those
    its imports of ``cutefa.kernels`` reach, directly or through theirs, with the package
    ``__init__`` files on the way. An edit to a building block this kernel does not import leaves
    its fingerprint (and its packed and cached builds) valid. Where an import of
    ``cutefa.kernels`` resolves to no file, every file under it counts."""
    files = kernel_closure(source)
    every = files is None
    return files_digest(tuple(sorted(KERNELS_DIR.rglob("*.py") if every else files)), KERNELS_DIR)


def kernel_closure(source: str) -> set[Path] | None:
    """The ``cutefa/kernels`` files that ``source`` (a generated kernel module) imports, directly
    or through them; None when one of the imports names no file."""
    return _closure(
        imported_files(source, None, "cutefa.kernels", KERNELS_DIR), "cutefa.kernels", KERNELS_DIR
    )


@functools.cache
def render_digest() -> str:
    """Digest of what rendering a variant's module reads: the templates, the cutefa modules that
    ``cutefa/codegen.py`` imports (directly or through them; the whole package where one does not
    resolve) and jinja2's version. Rendered modules are kept under it (once per process)."""
    codegen = PACKAGE_DIR / "codegen.py"
    modules = _closure(
        imported_files(codegen.read_text(), "cutefa", "cutefa", PACKAGE_DIR), "cutefa", PACKAGE_DIR
    )
    if modules is None:
        modules = set(PACKAGE_DIR.rglob("*.py"))
    templates = sorted(p for p in TEMPLATES_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    h = hashlib.sha256()
    h.update(files_digest(tuple(sorted(modules | {codegen})), PACKAGE_DIR).encode())
    h.update(files_digest(tuple(templates), TEMPLATES_DIR).encode())
    h.update(importlib.metadata.version("jinja2").encode())
    return h.hexdigest()


@functools.cache
def files_digest(files: tuple[Path, ...], base: Path) -> str:
    """sha256 over the paths (relative to ``base``) and contents of ``files``, once per process."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(base).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Import closures (read from the source text: nothing is imported)


def _closure(todo: set[Path] | None, root: str, root_dir: Path, stop: Path | None = None) -> set[Path] | None:
    """``todo`` and every file of package ``root`` (at ``root_dir``) they import, transitively (the
    imports of ``stop`` not followed)."""
    if todo is None:
        return None
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path == stop:
            continue
        more = _file_imports(path, root, root_dir)
        if more is None:
            return None
        todo |= more - seen
    return seen


@functools.cache
def _file_imports(path: Path, root: str, root_dir: Path) -> frozenset[Path] | None:
    """:func:`imported_files` of a file of package ``root`` (read once per process)."""
    parts = path.relative_to(root_dir).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
        package = ".".join((root, *parts))
    else:
        package = ".".join((root, *parts[:-1]))
    found = imported_files(path.read_text(), package, root, root_dir)
    return None if found is None else frozenset(found)


def imported_files(source: str, package: str | None, root: str, root_dir: Path) -> set[Path] | None:
    """The files of package ``root`` (at ``root_dir``) that the import statements of ``source``
    name, not followed further: each imported module, the modules among the names a ``from`` import
    takes, and the package ``__init__`` files on the way. ``package``: the dotted package of
    ``source``, for its relative imports. None when a module of ``root`` resolves to no file."""
    found: set[Path] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imports = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                if package is None:
                    return None
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            imports = [(module, [alias.name for alias in node.names])]
        else:
            continue
        for module, names in imports:
            if not (module == root or module.startswith(root + ".")):
                continue
            files = _module_files(module, root, root_dir)
            if files is None:
                return None
            found |= files
            for name in names:  # ``from cutefa.kernels.sm90 import parts``: parts is a module
                found |= _module_files(f"{module}.{name}", root, root_dir) or set()
    return found


def _module_files(module: str, root: str, root_dir: Path) -> set[Path] | None:
    """The files importing ``module`` (in package ``root``) runs: the package ``__init__`` files
    from ``root_dir`` down, and the module's own file; None when it has none."""
    parts = module.split(".")[len(root.split(".")) :]
    files = {p for p in [root_dir / "__init__.py"] if p.is_file()}
    here = root_dir
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


# ---------------------------------------------------------------------------------------------
# Files that the cache and packs write


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temp file next to ``path`` and rename it into place: a reader sees the
    old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
