"""The tuned dispatch tables: per GPU model, the variant of one kernel family that measured fastest.

A table (``cutefa/tuned/<arch>_<gpu>.json``, or ``<arch>_bwd_<gpu>.json`` for a backward; schema in
``cutefa/tuned/README.md``) maps (dtype, head_dim, causal, seqlen_k bucket) to a variant name.
This module reads the committed tables and those of ``$CUTEFA_TUNED_DIR``, checks their format
(a malformed file is skipped with a warning on the ``cutefa`` logger), keeps them once read, and
answers which entry of which table applies to a problem. What to make of an entry (a valid
variant for the problem, or a reason to reject it) is :mod:`cutefa.dispatch`'s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cutefa.identity import TUNED_DIR
from cutefa.model.spec import DIRECTIONS

log = logging.getLogger("cutefa")

# Problems are bucketed by seqlen_k rounded up to a power of two; longer ones share one bucket.
MAX_SEQLEN_BUCKET = 65536


def seqlen_bucket(seqlen_k: int) -> int | None:
    """``seqlen_k`` rounded up to a power of two; None when above :data:`MAX_SEQLEN_BUCKET`."""
    bucket = 1 << max(0, seqlen_k - 1).bit_length()
    return bucket if bucket <= MAX_SEQLEN_BUCKET else None


class TableQuery(Protocol):
    """The facts of a problem a table is asked with (:class:`cutefa.dispatch.Problem` has them)."""

    @property
    def target(self) -> str: ...
    @property
    def gpu_name(self) -> str | None: ...
    @property
    def dtype(self) -> str: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def causal(self) -> bool: ...
    @property
    def v_centered(self) -> bool: ...
    @property
    def bucket(self) -> int | None: ...


@dataclass(frozen=True)
class TunedEntry:
    """One row of a tuned table: the variant to use up to ``max_seqlen_k`` (None: any length)."""

    dtype: str
    head_dim: int
    causal: bool
    max_seqlen_k: int | None
    variant: str
    # For fp8 problems whose v was centered (Problem.v_centered) only; they fall back to the others.
    v_centered: bool = False

    def matches(self, problem: TableQuery) -> bool:
        if (self.dtype, self.head_dim, self.causal) != (problem.dtype, problem.head_dim, problem.causal):
            return False
        if self.v_centered and not problem.v_centered:
            return False
        return self.max_seqlen_k is None or (
            problem.bucket is not None and problem.bucket <= self.max_seqlen_k
        )

    def describe(self) -> str:
        return (
            f"dtype={self.dtype} head_dim={self.head_dim} causal={self.causal} "
            f"max_seqlen_k={self.max_seqlen_k}{' v_centered=True' if self.v_centered else ''}"
        )


@dataclass(frozen=True)
class TunedTable:
    """A dispatch table measured on one GPU for one kernel family compiled for one target."""

    path: Path
    arch: str
    gpu: str
    target: str
    measured_on: str
    entries: tuple[TunedEntry, ...]
    direction: str = "fwd"  # the pass its variants compute: fwd, or bwd (files <arch>_bwd_<gpu>.json)

    def lookup(self, problem: TableQuery) -> TunedEntry | None:
        """The matching entry with the tightest ``max_seqlen_k``; for a problem with centered v, among
        the ``v_centered`` entries when it has one, else among the others."""
        hits = [e for e in self.entries if e.matches(problem)]
        if problem.v_centered and any(e.v_centered for e in hits):
            hits = [e for e in hits if e.v_centered]
        return min(hits, key=lambda e: (e.max_seqlen_k is None, e.max_seqlen_k or 0), default=None)


def _parse_entry(raw: dict[str, Any]) -> TunedEntry:
    max_seqlen_k = raw["max_seqlen_k"]
    if max_seqlen_k is not None and (max_seqlen_k > MAX_SEQLEN_BUCKET or max_seqlen_k & (max_seqlen_k - 1)):
        raise ValueError(f"max_seqlen_k={max_seqlen_k} is not null or a power of two <= {MAX_SEQLEN_BUCKET}")
    v_centered = raw.get("v_centered", False)
    if not isinstance(v_centered, bool) or (v_centered and raw["dtype"] != "e4m3"):
        raise ValueError(f"v_centered={v_centered!r}: a bool, true only on e4m3 entries")
    return TunedEntry(
        raw["dtype"], int(raw["head_dim"]), bool(raw["causal"]), max_seqlen_k, raw["variant"], v_centered
    )


def load_table(path: Path) -> TunedTable:
    """Read one tuned table; raises ``ValueError``/``KeyError`` when it does not follow the schema."""
    raw = json.loads(Path(path).read_text())
    entries = tuple(_parse_entry(e) for e in raw["entries"])
    direction = raw.get("direction", "fwd")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")
    return TunedTable(
        Path(path), raw["arch"], raw["gpu"], raw["target"], raw["measured_on"], entries, direction
    )


# ---------------------------------------------------------------------------------------------
# The tables read, kept until forget_tables


_TABLES: list[TunedTable] | None = None
_LOCK = threading.Lock()  # held while the tables are read and while they are forgotten


def tuned_tables() -> list[TunedTable]:
    """Every readable table in ``$CUTEFA_TUNED_DIR`` (searched first, for freshly measured tables)
    and :data:`TUNED_DIR`; malformed ones are skipped with a warning."""
    global _TABLES
    tables = _TABLES
    if tables is None:
        with _LOCK:
            tables = _TABLES  # another thread may have read them meanwhile
            if tables is None:
                tables = _TABLES = _read_tables()
    return tables


def _read_tables() -> list[TunedTable]:
    tables = []
    extra = os.environ.get("CUTEFA_TUNED_DIR")
    dirs = ([Path(extra)] if extra else []) + [TUNED_DIR]
    for path in [p for d in dirs for p in sorted(d.glob("*.json"))]:
        try:
            tables.append(load_table(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("cutefa: ignoring tuned table %s: %s: %s", path.name, type(exc).__name__, exc)
    return tables


def forget_tables() -> None:
    """Forget the tables read, so the next look-up reads them again. A reading under way finishes
    first (its reader still gets what it read). Users call :func:`cutefa.dispatch.clear_caches`,
    which also forgets the choices made from the tables."""
    global _TABLES
    with _LOCK:
        _TABLES = None


def tables_for(family: str, problem: TableQuery, direction: str = "fwd") -> list[TunedTable]:
    """The family's tables of ``direction`` for this target in the order they are asked: those
    measured on this GPU first, each group in :func:`tuned_tables` order ($CUTEFA_TUNED_DIR first).
    A table without an entry for a problem (a fresh table of some head dims) passes it on to the next."""
    tables = [
        t
        for t in tuned_tables()
        if t.arch == family and t.target == problem.target and t.direction == direction
    ]
    gpu = (problem.gpu_name or "").lower()
    same_gpu = [t for t in tables if gpu and t.gpu.lower() in gpu]
    return same_gpu + [t for t in tables if t not in same_gpu]
