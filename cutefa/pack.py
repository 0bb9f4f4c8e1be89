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
          "runtime": "cu12",          the DSL runtime flavour it was linked against (a token: the
                                      library is the installed DSL's)
          "compile_seconds": 3.2
        }
      }
    }

``cutefa compile --target T --pack DIR`` writes or extends one (:func:`cutefa.pack_build.build_pack`,
through a :class:`PackWriter`: each kernel enters the pack, file first and then the manifest, as
soon as it is built, so an interrupted build leaves a usable pack). At run time
:func:`candidates` looks through each directory of ``CUTEFA_KERNEL_PATH`` (``os.pathsep``-
separated; a directory is a pack or holds packs one level down), then ``<cache dir>/packs``
(unless ``CUTEFA_TRUSTED_PACKS_ONLY=1``). A pack that has the kernel is refused, with the reason,
when it is built for another target, with another DSL version, calling convention or manifest
format, when the manifest names anything but a plain file name inside the pack or a runtime
flavour that is not one (``cu12``), when the kernel file is a symbolic link or not a regular file,
when its sha256 differs from the manifest (tampered or truncated), or when the kernel's
fingerprint differs from the one this cutefa computes for it (a stale pack, built from other
kernel sources). A pack under the cache dir is used only when the cache dir, the pack's folder,
manifest and kernel file are yours and no one else can write them. A kernel that passes is handed
over open (:class:`cutefa.identity.KernelFile`): the file hashed is the file loaded.

Nothing here imports the DSL or the compiler: reading, checking and loading a pack needs only
``libtvm_ffi.so`` and the DSL's runtime library.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cutefa import identity, profile
from cutefa.identity import KernelFile, UnsafeFileError

FORMAT = "cutefa-pack/1"
MANIFEST = "manifest.json"
PATH_ENV = "CUTEFA_KERNEL_PATH"
TRUSTED_ONLY_ENV = "CUTEFA_TRUSTED_PACKS_ONLY"


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
    """A kernel that passed every check: where it is, how to load it, and the file, open (the
    bytes whose checksum passed)."""

    pack: Path
    path: Path
    function_name: str
    runtime: str
    file: KernelFile


# ---------------------------------------------------------------------------------------------
# Reading and checking


def sha256_file(path: Path) -> str:
    """The sha256 of the regular file ``path`` (a symbolic link is refused: UnsafeFileError)."""
    kernel = KernelFile(path)
    kernel.close()
    return kernel.sha256


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


def plain_name(name: str) -> bool:
    """Whether ``name`` names a file directly inside a folder: no separator, no ``..``, not absolute."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def why_malformed(record: KernelRecord) -> str | None:
    """Why the manifest entry ``record`` must not be followed: a file that is not a plain file name
    inside the pack, a runtime flavour that is not one, a function name that is no identifier."""
    if not plain_name(record.file):
        return f"{record.name}: file {record.file!r} is not a plain file name inside the pack"
    if not identity.RUNTIME_FLAVOUR.fullmatch(record.runtime):
        return (
            f"{record.name}: runtime {record.runtime!r} is not a DSL runtime flavour (cu12, cu13, ...); "
            "the runtime library always comes from the installed DSL"
        )
    if not record.function_name.isidentifier():
        return f"{record.name}: function name {record.function_name!r} is not an identifier"
    return None


def open_kernel(pack: Pack, record: KernelRecord, fingerprint: str | None) -> KernelFile | str:
    """The kernel file of ``record``, open and checked (see the module docs), or why it must not be
    loaded. ``fingerprint`` is the one this cutefa computes for the variant (None: its source is not
    available, not checked)."""
    why = why_malformed(record)
    if why is not None:
        return why
    try:
        kernel = KernelFile(pack.path / record.file)
    except UnsafeFileError as exc:
        return f"{record.name}: {exc}"
    except OSError as exc:
        return f"{record.name}: cannot read {record.file}: {exc.strerror or exc}"
    if kernel.sha256 != record.sha256:
        kernel.close()
        return (
            f"{record.name}: checksum mismatch: {record.file} has sha256 {kernel.sha256[:16]}..., the manifest "
            f"says {record.sha256[:16]}... (the file changed after the pack was built)"
        )
    if fingerprint is not None and record.fingerprint != fingerprint:
        kernel.close()
        return (
            f"{record.name}: stale: built from other kernel sources than this cutefa's (fingerprint "
            f"{record.fingerprint[:16]}..., expected {fingerprint[:16]}...); rebuild the pack"
        )
    return kernel


def verify_kernel(pack: Pack, record: KernelRecord, fingerprint: str | None) -> str | None:
    """Why the kernel file of ``record`` must not be loaded (:func:`open_kernel`), or None."""
    kernel = open_kernel(pack, record, fingerprint)
    if isinstance(kernel, str):
        return kernel
    kernel.close()
    return None


def trusted_only() -> bool:
    """Whether only the packs on ``CUTEFA_KERNEL_PATH`` are searched (``CUTEFA_TRUSTED_PACKS_ONLY=1``)."""
    return os.environ.get(TRUSTED_ONLY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def search_dirs() -> list[Path]:
    """The directories searched for packs: ``CUTEFA_KERNEL_PATH``'s, then ``<cache dir>/packs``
    (not with ``CUTEFA_TRUSTED_PACKS_ONLY=1``)."""
    entries = [Path(p).expanduser() for p in os.environ.get(PATH_ENV, "").split(os.pathsep) if p.strip()]
    return entries if trusted_only() else [*entries, identity.cache_dir() / "packs"]


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


def candidates(name: str, target: str, fingerprint: str | None, refusals: list[str]) -> Iterator[Found]:
    """Each pack on the search path that has a usable kernel ``name`` for ``target``, in order, its
    file open; why each pack that has it (or could not be read) was refused goes into ``refusals``."""
    for directory in search_dirs():
        implicit = not trusted_only() and directory == identity.cache_dir() / "packs"
        problem = identity.cache_problem() if implicit else None
        if problem is not None:
            refusals.append(f"packs under {directory}: not used: {problem}")
            continue
        for path in pack_dirs(directory):
            why = identity.why_untrusted_under(identity.cache_dir(), path / MANIFEST) if implicit else None
            if why is not None:
                refusals.append(f"pack {path}: not trusted: {why}")
                continue
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
            if why is not None:
                refusals.append(f"pack {path}: {why}")
                continue
            with profile.phase("pack kernel sha256"):
                kernel = open_kernel(pack, record, fingerprint)
            if isinstance(kernel, str):
                refusals.append(f"pack {path}: {kernel}")
                continue
            why = identity.why_untrusted(kernel.path, kernel.stat) if implicit else None
            if why is not None:
                kernel.close()
                refusals.append(f"pack {path}: not trusted: {why}")
                continue
            yield Found(path, kernel.path, record.function_name, record.runtime, kernel)


def find_kernel(name: str, target: str, fingerprint: str | None) -> tuple[Found | None, list[str]]:
    """The first of :func:`candidates`, and why each pack before it that has the kernel (or could
    not be read) was refused."""
    refusals: list[str] = []
    return next(candidates(name, target, fingerprint, refusals), None), refusals


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


def _copy_into(src: Path, dest: Path, sha256: str | None) -> str:
    """Copy the regular file ``src`` to ``dest`` through a temp file, fsynced and renamed (a reader
    never sees half a file; a failed write leaves no temp file); returns the sha256 of the bytes
    copied, which must be ``sha256`` when given."""
    kernel = KernelFile(src)
    try:
        if sha256 is not None and kernel.sha256 != sha256:
            raise PackError(
                f"{src} changed since it was built: sha256 {kernel.sha256[:16]}..., expected {sha256[:16]}..."
            )
        return identity.write_file(dest, kernel.chunks(), 0o755)
    finally:
        kernel.close()


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
        sha256: str | None = None,
    ) -> Path:
        """Copy the linked kernel ``so_path`` (whose sha256 must be ``sha256`` when given) into the
        pack as ``<name>.so``, durably, then list it in the manifest; returns the file inside the pack."""
        identity.make_dirs(self.path)
        with identity.locked(self.path / ".lock"):
            pack = _pack_for_update(self.path, self.target)
            dest = self.path / f"{name}.so"
            digest = _copy_into(so_path, dest, sha256)
            record = KernelRecord(
                name=name, family=family, direction=direction, file=dest.name, sha256=digest,
                fingerprint=fingerprint, function_name=function_name, runtime=runtime,
                compile_seconds=compile_seconds,
            )  # fmt: skip
            updated = dataclasses.replace(pack, kernels={**pack.kernels, name: record})
            identity.atomic_write(self.path / MANIFEST, json.dumps(updated.to_json(), indent=2) + "\n")
        return dest


def size_on_disk(pack_dir: Path | str) -> int:
    """Bytes of the pack's manifest and the kernel files it lists."""
    pack = read_pack(pack_dir)
    kernels = [pack.path / record.file for record in pack.kernels.values() if plain_name(record.file)]
    files = [pack.path / MANIFEST, *kernels]
    return sum(path.stat().st_size for path in files if path.is_file())
