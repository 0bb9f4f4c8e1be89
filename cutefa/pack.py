"""Kernel packs: kernels compiled for one GPU target, shipped as files, loaded with no compiler.

A pack is a directory of linked TVM-FFI kernels plus a manifest::

    <pack>/manifest.json
    <pack>/<variant name>.so        one kernel per variant

``manifest.json``::

    {
      "format": "cutefa-pack/1",
      "target": "sm_90a",             every kernel of the pack is compiled for this GPU target
      "dsl_version": "4.8.1",         the nvidia-cutlass-dsl that compiled them
      "abi": "tvm-ffi-v1",            cutefa's kernel calling convention
      "cutefa_version": "0.1.0",
      "updated": "2026-11-29T12:00:00+0000",
      "kernels": {
        "<variant name>": {
          "family": "sm80", "direction": "fwd",
          "file": "<variant name>.so",
          "sha256": "<digest of the file>",
          "fingerprint": "<the variant's source fingerprint: generated module, building blocks,
                          DSL version, target and calling convention>",
          "function_name": "<exported function>",
          "runtime": "cu12",          the DSL runtime flavour it was linked against
          "compile_seconds": 3.2
        }
      }
    }

``cutefa compile --target T --pack DIR`` writes or extends one (:func:`cutefa.pack_build.build_pack`,
through a :class:`PackWriter`: each kernel enters the pack, file first and then the manifest, as
soon as it is built, so an interrupted build leaves a usable pack). At run time
:func:`find_kernel` looks through each directory of ``CUTEFA_KERNEL_PATH`` (``os.pathsep``-
separated; a directory is a pack or holds packs one level down), then ``<cache dir>/packs``. A
pack that has the kernel is refused, with the reason, when it is built for another target, with
another DSL version, calling convention or manifest format, when the kernel file's sha256 differs
from the manifest (tampered or truncated), or when the kernel's fingerprint differs from the one
this cutefa computes for it (a stale pack, built from other kernel sources).

Nothing here imports the DSL or the compiler: reading, checking and loading a pack needs only
``libtvm_ffi.so`` and the DSL's runtime library.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cutefa import identity, profile

FORMAT = "cutefa-pack/1"
MANIFEST = "manifest.json"
PATH_ENV = "CUTEFA_KERNEL_PATH"


class PackError(ValueError):
    """A pack directory that cannot be read, or cannot take the kernels being written into it."""


@dataclass(frozen=True)
class KernelRecord:
    """One kernel of a pack, as the manifest describes it."""

    name: str
    family: str
    direction: str
    file: str
    sha256: str
    fingerprint: str
    function_name: str
    runtime: str
    compile_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        del fields["name"]
        return fields


@dataclass(frozen=True)
class Pack:
    """A pack directory and its manifest."""

    path: Path
    format: str
    target: str
    dsl_version: str
    abi: str
    cutefa_version: str | None
    kernels: dict[str, KernelRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "target": self.target,
            "dsl_version": self.dsl_version,
            "abi": self.abi,
            "cutefa_version": self.cutefa_version,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "kernels": {name: self.kernels[name].to_json() for name in sorted(self.kernels)},
        }


@dataclass(frozen=True)
class Found:
    """A kernel that passed every check: where it is and how to load it."""

    pack: Path
    path: Path
    function_name: str
    runtime: str


# ---------------------------------------------------------------------------------------------
# Reading and checking


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_pack(path: Path | str) -> Pack:
    """Parse ``<path>/manifest.json``; raises :class:`PackError` saying what is wrong with it."""
    path = Path(path)
    manifest = path / MANIFEST
    try:
        raw = json.loads(manifest.read_text())
    except OSError as exc:
        raise PackError(f"cannot read {manifest}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PackError(f"{manifest} is not valid JSON: {exc}") from None
    try:
        kernels = {
            name: KernelRecord(
                name=name,
                family=str(rec["family"]),
                direction=str(rec["direction"]),
                file=str(rec["file"]),
                sha256=str(rec["sha256"]),
                fingerprint=str(rec["fingerprint"]),
                function_name=str(rec["function_name"]),
                runtime=str(rec["runtime"]),
                compile_seconds=rec.get("compile_seconds"),
            )
            for name, rec in raw["kernels"].items()
        }
        return Pack(
            path=path,
            format=str(raw["format"]),
            target=str(raw["target"]),
            dsl_version=str(raw["dsl_version"]),
            abi=str(raw["abi"]),
            cutefa_version=raw.get("cutefa_version"),
            kernels=kernels,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise PackError(
            f"{manifest} does not follow the {FORMAT} manifest format: {type(exc).__name__}: {exc}"
        ) from None


def why_refused(pack: Pack, target: str) -> str | None:
    """Why no kernel of ``pack`` may run for compile target ``target`` here, or None."""
    if pack.format != FORMAT:
        return f"manifest format {pack.format!r}; this cutefa reads {FORMAT!r}"
    if pack.target != target:
        return f"built for target {pack.target}, but this GPU needs {target}"
    installed = identity.dsl_version()
    if pack.dsl_version != installed:
        return f"built with nvidia-cutlass-dsl {pack.dsl_version}, but {installed} is installed"
    if pack.abi != identity.ABI:
        return f"kernel calling convention {pack.abi!r}; this cutefa calls {identity.ABI!r}"
    return None


def verify_kernel(pack: Pack, record: KernelRecord, fingerprint: str | None) -> str | None:
    """Why the kernel file of ``record`` must not be loaded, or None. ``fingerprint`` is the one
    this cutefa computes for the variant (None: its source is not available, not checked)."""
    path = pack.path / record.file
    if Path(record.file).name != record.file:
        return f"{record.name}: file {record.file!r} is not a plain file name inside the pack"
    try:
        digest = sha256_file(path)
    except OSError as exc:
        return f"{record.name}: cannot read {record.file}: {exc.strerror or exc}"
    if digest != record.sha256:
        return (
            f"{record.name}: checksum mismatch: {record.file} has sha256 {digest[:16]}..., the manifest "
            f"says {record.sha256[:16]}... (the file changed after the pack was built)"
        )
    if fingerprint is not None and record.fingerprint != fingerprint:
        return (
            f"{record.name}: stale: built from other kernel sources than this cutefa's (fingerprint "
            f"{record.fingerprint[:16]}..., expected {fingerprint[:16]}...); rebuild the pack"
        )
    return None


def search_dirs() -> list[Path]:
    """The directories searched for packs: ``CUTEFA_KERNEL_PATH``'s, then ``<cache dir>/packs``."""
    entries = [Path(p).expanduser() for p in os.environ.get(PATH_ENV, "").split(os.pathsep) if p.strip()]
    return [*entries, identity.cache_dir() / "packs"]


def default_pack_dir(target: str) -> Path:
    """The pack that is searched without any setting: ``<cache dir>/packs/<target>``."""
    return identity.cache_dir() / "packs" / target


def pack_dirs(directory: Path) -> list[Path]:
    """``directory`` when it is a pack, else the packs one level below it (sorted by name)."""
    if (directory / MANIFEST).is_file():
        return [directory]
    try:
        children = sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError:
        return []
    return [p for p in children if (p / MANIFEST).is_file()]


# Parsed manifests, keyed by (manifest path, mtime_ns, size): re-read when a pack is rewritten.
_MANIFESTS: dict[tuple[Path, int, int], Pack | PackError] = {}


def _cached_read(path: Path) -> Pack | PackError:
    manifest = path / MANIFEST
    try:
        st = manifest.stat()
    except OSError as exc:
        return PackError(f"cannot read {manifest}: {exc.strerror or exc}")
    key = (manifest, st.st_mtime_ns, st.st_size)
    if key not in _MANIFESTS:
        try:
            _MANIFESTS[key] = read_pack(path)
        except PackError as exc:
            _MANIFESTS[key] = exc
    return _MANIFESTS[key]


def find_kernel(name: str, target: str, fingerprint: str | None) -> tuple[Found | None, list[str]]:
    """The first pack on the search path that has a usable kernel ``name`` for ``target``.

    Returns (the kernel or None, why each pack that has it, or could not be read, was refused).
    """
    refusals: list[str] = []
    for directory in search_dirs():
        for path in pack_dirs(directory):
            with profile.phase("pack manifest"):
                pack = _cached_read(path)
            if isinstance(pack, PackError):
                refusals.append(f"{path}: {pack}")
                continue
            record = pack.kernels.get(name)
            if record is None:
                continue
            with profile.phase("pack checks (target, DSL version)"):
                why = why_refused(pack, target)
            if why is None:
                with profile.phase("pack kernel sha256"):
                    why = verify_kernel(pack, record, fingerprint)
            if why is not None:
                refusals.append(f"pack {path}: {why}")
                continue
            return Found(path, path / record.file, record.function_name, record.runtime), refusals
    return None, refusals


# ---------------------------------------------------------------------------------------------
# Writing


def _pack_for_update(pack_dir: Path, target: str) -> Pack:
    """The pack at ``pack_dir`` to add kernels to (an empty one if there is none yet)."""
    fresh = Pack(pack_dir, FORMAT, target, identity.dsl_version(), identity.ABI, _cutefa_version(), {})
    if not (pack_dir / MANIFEST).exists():
        if pack_dir.exists() and not pack_dir.is_dir():
            raise PackError(f"{pack_dir} exists and is not a directory")
        return fresh
    existing = read_pack(pack_dir)
    if existing.format != FORMAT:
        raise PackError(
            f"{pack_dir} holds a pack of format {existing.format!r}; write {FORMAT!r} packs elsewhere"
        )
    if existing.target != target:
        raise PackError(
            f"{pack_dir} holds a pack for target {existing.target}; a pack has one target: "
            f"write the {target} kernels into another directory"
        )
    if (existing.dsl_version, existing.abi) != (fresh.dsl_version, fresh.abi):
        raise PackError(
            f"{pack_dir} holds kernels built with nvidia-cutlass-dsl {existing.dsl_version} "
            f"({existing.abi}); this cutefa builds with {fresh.dsl_version} ({fresh.abi}): "
            "use an empty directory"
        )
    return dataclasses.replace(existing, cutefa_version=fresh.cutefa_version)


def _cutefa_version() -> str:
    from cutefa import __version__

    return __version__


def _copy_into(src: Path, dest: Path) -> None:
    """Copy ``src`` to ``dest`` through a temp file and a rename: a reader never sees half a file."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


class PackWriter:
    """Adds kernels to the pack at ``pack_dir`` for ``target``, one at a time.

    Creating one refuses (:class:`PackError`) a directory that holds a pack for another target,
    DSL version, calling convention or format. Each :meth:`add` copies the kernel file in and then
    rewrites the manifest (atomically, under the pack's lock, re-read first so that concurrent
    writers keep each other's kernels): at every moment the pack is usable and lists exactly the
    kernels whose files are complete.
    """

    def __init__(self, pack_dir: Path | str, target: str) -> None:
        self.path = Path(pack_dir)
        self.target = target
        _pack_for_update(self.path, target)

    def holds(self, name: str, fingerprint: str) -> Path | None:
        """The kernel file of ``name`` when the pack holds it built from the sources of
        ``fingerprint``, with the checksum the manifest gives; else None."""
        if not (self.path / MANIFEST).is_file():
            return None
        existing = read_pack(self.path)
        record = existing.kernels.get(name)
        if record is None or verify_kernel(existing, record, fingerprint) is not None:
            return None
        return self.path / record.file

    def add(
        self,
        name: str,
        family: str,
        direction: str,
        so_path: Path,
        *,
        fingerprint: str,
        function_name: str,
        runtime: str,
        compile_seconds: float | None = None,
    ) -> Path:
        """Copy the linked kernel ``so_path`` into the pack as ``<name>.so`` and list it in the
        manifest; returns the file inside the pack."""
        self.path.mkdir(parents=True, exist_ok=True)
        with identity.locked(self.path / ".lock"):
            pack = _pack_for_update(self.path, self.target)
            dest = self.path / f"{name}.so"
            _copy_into(so_path, dest)
            record = KernelRecord(
                name=name, family=family, direction=direction, file=dest.name, sha256=sha256_file(dest),
                fingerprint=fingerprint, function_name=function_name, runtime=runtime,
                compile_seconds=compile_seconds,
            )  # fmt: skip
            updated = dataclasses.replace(pack, kernels={**pack.kernels, name: record})
            identity.atomic_write(self.path / MANIFEST, json.dumps(updated.to_json(), indent=2) + "\n")
        return dest


def size_on_disk(pack_dir: Path | str) -> int:
    """Bytes of the pack's manifest and the kernel files it lists."""
    pack = read_pack(pack_dir)
    files = [pack.path / MANIFEST, *(pack.path / record.file for record in pack.kernels.values())]
    return sum(path.stat().st_size for path in files if path.is_file())
