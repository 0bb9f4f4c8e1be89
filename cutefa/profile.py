"""Start-up phases: where the time to the first result goes, recorded when ``CUTEFA_PROFILE=1``.

With profiling on, each phase of getting a kernel to run the first time is timed and kept in
order: importing cutefa's torch-side modules, the device query, dispatch (with the tuned
tables), the kernel source fingerprint, reading pack manifests, checking a kernel file's
sha256, loading the DSL runtime library, importing ``tvm_ffi``, ``tvm_ffi.load_module`` and the
first call of each loaded kernel (where the CUDA module of its cubin is loaded). Off (the
default), a phase costs one attribute check and records nothing; the memoized call plans never
go through here.

::

    CUTEFA_PROFILE=1 python -c "import cutefa, cutefa.profile as p; ...; print(p.report())"

This module imports nothing beyond the standard library, so ``import cutefa`` stays light.
"""

from __future__ import annotations

import os
import time

ENV = "CUTEFA_PROFILE"
MAX_RECORDS = 4096  # later phases are dropped: a long-running process must not grow a list

ENABLED = os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
_RECORDS: list[tuple[str, float]] = []


class _Phase:
    __slots__ = ("name", "start")

    def __init__(self, name: str) -> None:
        self.name = name
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        record(self.name, time.perf_counter() - self.start)


class _Off:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


OFF = _Off()  # a context manager that records nothing


def phase(name: str) -> _Phase | _Off:
    """A context manager that records how long its block took under ``name`` (when enabled)."""
    return _Phase(name) if ENABLED else OFF


def record(name: str, seconds: float) -> None:
    """Record one phase of ``seconds`` (when enabled)."""
    if ENABLED and len(_RECORDS) < MAX_RECORDS:
        _RECORDS.append((name, seconds * 1e3))


def enable(on: bool = True) -> None:
    """Turn recording on or off in this process (``CUTEFA_PROFILE`` sets it at import)."""
    global ENABLED
    ENABLED = on


def clear() -> None:
    """Forget the recorded phases."""
    _RECORDS.clear()


def phases() -> list[tuple[str, float]]:
    """Every recorded phase in order: (name, milliseconds)."""
    return list(_RECORDS)


def totals() -> dict[str, float]:
    """Milliseconds per phase name, summed, in the order each name was first recorded."""
    out: dict[str, float] = {}
    for name, ms in _RECORDS:
        out[name] = out.get(name, 0.0) + ms
    return out


def report() -> str:
    """The recorded phases as aligned text, one per line, with their sum."""
    sums = totals()
    if not sums:
        return f"cutefa: no start-up phases recorded (set {ENV}=1 before the first call)"
    width = max(len(name) for name in sums)
    lines = [f"{name:<{width}}  {ms:9.2f} ms" for name, ms in sums.items()]
    lines.append(f"{'total':<{width}}  {sum(sums.values()):9.2f} ms")
    return "\n".join(lines)
