"""The compile cache on disk: its entries, their commit marker and checks, and where a build goes.

One entry holds a variant's kernel compiled for one target (layout: :mod:`cutefa.compile`)::

    <cache dir>/<target>/<name>-<fingerprint[:16]>/kernel.so, meta.json, .lock

An entry is committed when its ``meta.json`` (written last) names its fingerprint and records
kernel.so's sha256. It is used only when the cache dir and the entry's folder and files are yours
and no one else can write them (:func:`cutefa.identity.why_untrusted`), and kernel.so is loaded
only through the descriptor whose bytes matched that sha256 (:meth:`Entry.open_kernel`), so a
truncated file never reaches the dynamic loader. A damaged entry is moved to
``<cache dir>/quarantine/`` (:func:`quarantine`) and built again. A build goes into the cache dir
when it can take one, else into a private temporary folder of the process (:func:`build_home`),
with one warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cutefa import identity
from cutefa.identity import KernelFile, UnsafeFileError, cache_dir, locked

log = logging.getLogger("cutefa")


@dataclass(frozen=True)
class Entry:
    """One cache entry: a variant's source (``source``, whose :func:`cutefa.identity.fingerprint`
    is ``fingerprint``) compiled for ``target``, under the cache dir ``root``."""

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
        well_formed = (
            isinstance(meta, dict)
            and meta.get("fingerprint") == self.fingerprint
            and isinstance(meta.get("sha256"), str)
            and identity.RUNTIME_FLAVOUR.fullmatch(str(meta.get("runtime")))
            and str(meta.get("function_name")).isidentifier()
        )
        return meta if well_formed and self.so_path.is_file() else None

    def open_kernel(self, meta: dict[str, Any]) -> KernelFile:
        """kernel.so, open, once it passed its checks: the entry's folder and files are trusted and
        the file's sha256 is the one ``meta`` records (checked before anything loads it). Raises
        :class:`DamagedEntry` saying what failed."""
        why = identity.why_untrusted_under(self.root, self.meta_path)
        if why is not None:
            raise DamagedEntry(f"not trusted: {why}")
        try:
            kernel = KernelFile(self.so_path)
        except (OSError, UnsafeFileError) as exc:
            raise DamagedEntry(f"cannot read kernel.so: {exc}") from None
        why = identity.why_untrusted(kernel.path, kernel.stat)
        if why is None and kernel.sha256 != meta["sha256"]:
            why = (
                f"kernel.so fails its checksum ({kernel.stat.st_size} bytes, sha256 {kernel.sha256[:16]}..., "
                f"meta.json records {str(meta['sha256'])[:16]}...): truncated or changed after it was built"
            )
        if why is not None:
            kernel.close()
            raise DamagedEntry(why)
        return kernel

    def committed(self) -> dict[str, Any] | None:
        """meta.json when the entry is committed and its kernel.so passes :meth:`open_kernel`."""
        meta = self.read_meta()
        if meta is None:
            return None
        try:
            self.open_kernel(meta).close()
        except DamagedEntry:
            return None
        return meta


class DamagedEntry(RuntimeError):
    """A committed cache entry whose kernel.so must not be loaded: it fails its checksum, cannot be
    read or loaded, or its files are not trusted."""


def quarantine(entry: Entry) -> Path | None:
    """Move a damaged entry's folder to ``<root>/quarantine/<target>/`` (kept to look at; delete at
    will) so that it is built again; None when it cannot be moved (e.g. a read-only cache)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = entry.root / "quarantine" / entry.target / f"{entry.dir.name}.{stamp}.{os.getpid()}"
    try:
        identity.make_dirs(dest.parent)
        os.rename(entry.dir, dest)
    except OSError:
        return None
    return dest


_WARNED: set[Path] = set()


def warn_cache(root: Path, why: str) -> None:
    """Warn, once per process and cache dir, that ``root`` is not used, and why."""
    if root not in _WARNED:
        _WARNED.add(root)
        log.warning(
            "cutefa: not using the kernel cache %s: %s; kernels are built in a private temporary folder "
            "of this process (or kept in memory) and built again by the next process",
            root, why,
        )  # fmt: skip


def build_home(entry: Entry) -> Entry:
    """``entry`` when its cache dir can take a build; else the same entry in this process's private
    temporary cache (:func:`cutefa.identity.private_dir`), with one warning naming the cache dir and
    why (read-only, not writable, not trusted)."""
    why = identity.cache_problem() if entry.root == cache_dir() else None
    if why is None:
        try:
            identity.make_dirs(entry.dir)
            with locked(entry.dir / ".lock"):
                pass
        except OSError as exc:
            why = f"cannot write it: {exc.strerror or exc}"
    if why is None:
        return entry
    warn_cache(entry.root, why)
    return dataclasses.replace(entry, root=identity.private_dir("cache"))
