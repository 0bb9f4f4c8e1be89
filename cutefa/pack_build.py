"""Build a kernel pack: compile variants through the cache and add each kernel to the pack as it is built.

``cutefa compile --pack DIR`` runs :func:`build_pack`. The compile cache (:mod:`cutefa.compile`)
builds the kernels; :class:`cutefa.pack.PackWriter` copies each one into the pack and lists it in
the manifest, so the pack is usable after every kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from cutefa import cache, pack
from cutefa import compile as cc
from cutefa.compile import CompileResult
from cutefa.model.spec import VariantSpec


def build_pack(
    specs: Sequence[VariantSpec],
    *,
    target: str,
    pack_dir: Path | str,
    jobs: int = 1,
    progress: bool = True,
    force: bool = False,
) -> list[CompileResult]:
    """Compile ``specs`` for ``target`` (in ``jobs`` processes, through the cache) into the kernel
    pack at ``pack_dir``, adding to the kernels already there.

    Each kernel enters the pack (file, then manifest) as soon as it is built, so an interrupted
    build leaves a usable pack of the kernels finished so far; a kernel the pack already holds,
    built from the same sources, is kept without compiling (unless ``force``). A variant that fails
    is reported in its result and does not stop the others; a successful result's ``path`` is the
    kernel file inside the pack. Raises :class:`cutefa.pack.PackError` before compiling anything
    when ``pack_dir`` holds a pack for another target or DSL version.
    """
    writer = pack.PackWriter(Path(pack_dir), target)  # refuses a conflicting directory first
    held: dict[int, CompileResult] = {}
    if not force:
        for i, spec in enumerate(specs):
            with contextlib.suppress(Exception):  # no source here: compile_variants reports it
                path = writer.holds(spec.name, cc.fingerprint(spec, target))
                if path is not None:
                    held[i] = CompileResult(spec, True, 0.0, None, path)
    todo = [spec for i, spec in enumerate(specs) if i not in held]

    def keep(result: CompileResult, entry: cache.Entry) -> CompileResult:
        meta = entry.committed()  # kernel.so checked against its recorded sha256
        if result.path is None or meta is None:
            error = "compiled, but no linked kernel.so was committed (is gcc installed? see the warnings)"
            return dataclasses.replace(result, ok=False, error=error, path=None)
        spec = result.spec
        try:
            dest = writer.add(
                spec.name, spec.arch, spec.direction, entry.so_path, fingerprint=entry.fingerprint,
                function_name=meta["function_name"], runtime=meta["runtime"],
                compile_seconds=meta.get("compile_seconds"), sha256=meta["sha256"],
            )  # fmt: skip
        except (OSError, pack.PackError) as exc:  # e.g. a full disk: the pack keeps what it had
            error = f"compiled, but not added to the pack: {cc._describe(exc)}"
            return dataclasses.replace(result, ok=False, error=error, path=None)
        return dataclasses.replace(result, path=dest)

    built = iter(cc._compile_all(todo, target, jobs, progress, force, keep))
    return [held[i] if i in held else next(built) for i in range(len(specs))]
