"""What the kernel-pack and cache tests share: two committed variants, a target, packs of dummy
kernel files with true checksums and fingerprints, the kernel search path, a stubbed kernel loader,
and for the tests that load real files: tiny shared objects built with the C compiler, a stand-in
for the DSL's compile whose export goes through the cache's real link and commit steps, and a file
system made read-only under one folder."""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cutefa import cache, ffi, identity, loader, pack
from cutefa import compile as cc
from cutefa.model import committed

TARGET = "sm_90a"
SPEC = next(s for s in committed.default_variants("sm80") if s.direction == "fwd" and s.head_dim == 64)
OTHER = next(s for s in committed.default_variants("sm80") if s.direction == "fwd" and s.head_dim == 128)


def stub_loader(tmp_path, monkeypatch) -> list:
    """An empty cache, no kernel path, JIT allowed, all packs searched, fresh memo tables, the loader
    stubbed: it records (path, function name, runtime) of each load in the list it returns and gives
    ("kernel", path)."""
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTEFA_KERNEL_PATH", raising=False)
    monkeypatch.delenv("CUTEFA_JIT", raising=False)
    monkeypatch.delenv("CUTEFA_TRUSTED_PACKS_ONLY", raising=False)
    monkeypatch.setattr(loader, "_KERNELS", {})
    monkeypatch.setattr(loader, "_ORIGINS", {})
    monkeypatch.setattr(pack, "_MANIFESTS", {})
    loads = []

    def load_library(kernel, function_name, runtime):
        path = Path(getattr(kernel, "path", kernel))  # a checked KernelFile, open, or a path
        loads.append((path, function_name, runtime))
        return ("kernel", path)

    monkeypatch.setattr(loader, "load_library", load_library)
    return loads


def write_pack(directory: Path, specs, *, target=TARGET, **overrides) -> Path:
    """A pack of dummy kernel files with true checksums and this cutefa's fingerprints."""
    directory.mkdir(parents=True, exist_ok=True)
    kernels = {}
    for spec in specs:
        data = f"not really an ELF: {spec.name}".encode()
        (directory / f"{spec.name}.so").write_bytes(data)
        kernels[spec.name] = {
            "family": spec.arch,
            "direction": spec.direction,
            "file": f"{spec.name}.so",
            "sha256": hashlib.sha256(data).hexdigest(),
            "fingerprint": cc.fingerprint(spec, target),
            "function_name": spec.name,
            "runtime": "cu12",
            "compile_seconds": 1.0,
        }
    manifest = {
        "format": pack.FORMAT,
        "target": target,
        "dsl_version": identity.dsl_version(),
        "abi": identity.ABI,
        "cutefa_version": "0.1.0",
        "updated": "2026-11-29T00:00:00+0000",
        "kernels": kernels,
    } | overrides
    (directory / pack.MANIFEST).write_text(json.dumps(manifest))
    return directory


def use_path(monkeypatch, *dirs: Path) -> None:
    monkeypatch.setenv("CUTEFA_KERNEL_PATH", os.pathsep.join(str(d) for d in dirs))


def commit_fake(entry, data: bytes = b"not really an ELF") -> None:
    """Make cache entry ``entry`` look committed without compiling: a kernel.so of ``data`` and a
    meta.json that names its fingerprint and records the file's sha256."""
    entry.dir.mkdir(parents=True, exist_ok=True)
    entry.so_path.write_bytes(data)
    meta = {
        "fingerprint": entry.fingerprint,
        "sha256": hashlib.sha256(data).hexdigest(),
        "function_name": entry.name,
        "runtime": "cu12",
    }
    entry.meta_path.write_text(json.dumps(meta))


# ---------------------------------------------------------------------------------------------
# Real shared objects, a stand-in compiler, read-only folders


def c_entry(function_name: str, rc: int) -> str:
    """C source of a TVM-FFI safe-call entry ``__tvm_ffi_<function_name>`` that returns ``rc``."""
    return f"int __tvm_ffi_{function_name}(void* s, const void* a, int n, void* r) {{ return {rc}; }}\n"


def compile_c(source: str, out: Path, *flags: str) -> Path:
    """Compile C ``source`` with the system compiler (what the cache links kernels with) into ``out``."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler, "these tests need gcc or cc, as linking kernels does"
    with tempfile.TemporaryDirectory() as scratch:
        src = Path(scratch) / "entry.c"
        src.write_text(source)
        subprocess.run([compiler, *flags, "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


def build_so(out: Path, function_name: str, rc: int = 0) -> Path:
    """A linked shared object exporting one kernel entry that returns ``rc`` (0: success)."""
    return compile_c(c_entry(function_name, rc), out, "-shared")


class FakeCompiled:
    """What the DSL's compile returns, as far as the cache uses it: ``export_to_c`` writes a real
    object file (an entry returning ``rc``), and calling it runs the kernel "from memory"."""

    def __init__(self, rc: int = 0) -> None:
        self.rc = rc

    def export_to_c(self, path: str, function_name: str, enable_pic: bool) -> None:
        compile_c(c_entry(function_name, self.rc), Path(path), "-c")

    def __call__(self, *args):
        return "ran from memory"


def fake_compiler(tmp_path, monkeypatch) -> list:
    """An empty cache, no kernel path, JIT allowed, fresh memo tables, and the DSL's compile replaced
    by :class:`FakeCompiled`: the cache's export, link, commit and load steps run for real. Returns
    the list of entry names compiled."""
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("CUTEFA_KERNEL_PATH", "CUTEFA_JIT", "CUTEFA_TRUSTED_PACKS_ONLY"):
        monkeypatch.delenv(var, raising=False)
    for module, name in ((loader, "_KERNELS"), (loader, "_ORIGINS"), (pack, "_MANIFESTS"),
                         (ffi, "_LIBRARIES"), (ffi, "_DIGESTS")):  # fmt: skip
        monkeypatch.setattr(module, name, {})
    monkeypatch.setattr(cache, "_WARNED", set())
    compiled = []
    monkeypatch.setattr(cc, "can_compile_here", lambda target: True)
    monkeypatch.setattr(cc, "_compile", lambda entry: compiled.append(entry.name) or FakeCompiled())
    monkeypatch.setattr(
        cc, "_runtime_libraries", lambda: [ffi.runtime_library("cu12"), ffi.tvm_ffi_library_path()]
    )
    return compiled


def files_under(root: Path) -> list[str]:
    """Every file under ``root``, relative, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def read_only(monkeypatch, root: Path) -> None:
    """Make every write under ``root`` fail as on a read-only file system (EROFS), whoever runs the
    tests (root ignores permission bits): creating, writing, renaming, removing files and folders."""
    inside = str(root) + os.sep

    def refuse(path) -> None:
        where = os.path.abspath(os.fsdecode(path))
        if where == str(root) or where.startswith(inside):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), where)

    real_open, real_bopen = os.open, builtins.open
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def os_open(path, flags, *args, **kwargs):
        if flags & writes:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def b_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_bopen(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", b_open)
    monkeypatch.setattr(io, "open", b_open)  # pathlib's
    for name in ("mkdir", "unlink", "rmdir", "chmod"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda path, *a, _real=real, **k: refuse(path) or _real(path, *a, **k))
    for name in ("rename", "replace"):
        real = getattr(os, name)
        monkeypatch.setattr(
            os,
            name,
            lambda src, dst, *a, _real=real, **k: refuse(src) or refuse(dst) or _real(src, dst, *a, **k),
        )


def full_disk(monkeypatch, root: Path) -> list[str]:
    """Make every write to a file under ``root`` fail with ENOSPC (a full disk), through ``os.write``
    or a file object; returns the files whose write failed."""
    failed = []

    def no_space(path: str) -> None:
        if path.startswith(str(root) + os.sep):
            failed.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_write, real_open = os.write, builtins.open

    def write(fd, data):
        no_space(os.readlink(f"/proc/self/fd/{fd}"))
        return real_write(fd, data)

    class Full:
        """A file object open for writing whose writes fail."""

        def __init__(self, f) -> None:
            self._f = f

        def write(self, data):
            no_space(os.path.abspath(self._f.name))

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def b_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+") else f

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(builtins, "open", b_open)
    monkeypatch.setattr(io, "open", b_open)
    return failed
