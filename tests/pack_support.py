"""What the kernel-pack tests share: two committed variants, a target, packs of dummy kernel files
with true checksums and fingerprints, the kernel search path, and a stubbed kernel loader."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cutefa import compile as cc
from cutefa import identity, loader, pack
from cutefa.model import committed

TARGET = "sm_90a"
SPEC = next(s for s in committed.default_variants("sm80") if s.direction == "fwd" and s.head_dim == 64)
OTHER = next(s for s in committed.default_variants("sm80") if s.direction == "fwd" and s.head_dim == 128)


def stub_loader(tmp_path, monkeypatch) -> list:
    """An empty cache, no kernel path, JIT allowed, fresh memo tables, the loader stubbed: it records
    (path, function name, runtime) of each load in the list it returns and gives ("kernel", path)."""
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTEFA_KERNEL_PATH", raising=False)
    monkeypatch.delenv("CUTEFA_JIT", raising=False)
    monkeypatch.setattr(loader, "_KERNELS", {})
    monkeypatch.setattr(loader, "_ORIGINS", {})
    monkeypatch.setattr(pack, "_MANIFESTS", {})
    loads = []

    def load_library(path, function_name, runtime):
        loads.append((Path(path), function_name, runtime))
        return ("kernel", Path(path))

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
