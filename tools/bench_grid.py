"""The benchmark's grid (tools/bench.py): its shapes and backends, the cells, and what a backend
gives on a cell (Result) and all backends on one (Row).

Layout (batch, seqlen, heads, head_dim) with batch x seqlen = TOKENS and heads x head_dim =
MODEL_DIM. TFLOP/s counts 4*b*h*s^2*d for the forward, 2.5x that for the backward, halved when causal.
"""

# No `from __future__ import annotations`: tools load this file by path, not always registering it
# in sys.modules, and dataclasses cannot resolve string annotations then.
import argparse
from dataclasses import dataclass, field

TOKENS = 16384
MODEL_DIM = 2048
SEQLENS = (1024, 2048, 4096, 8192, 16384)
HDIMS = (64, 128, 256)
QUICK_SEQLENS = (1024, 4096)
QUICK_HDIMS = (128,)
BACKENDS = ("cutefa", "FA4", "cuDNN", "FA2")
PEERS = ("FA4", "cuDNN", "FA2")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Cell:
    dtype: str
    hdim: int
    causal: bool
    seqlen: int
    pass_: str = "fwd"

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return max(1, MODEL_DIM // self.hdim)

    @property
    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen**2 * self.hdim
        f = f * 2.5 if self.pass_ == "bwd" else f  # backward: 5 matmuls to the forward's 2
        return f / 2 if self.causal else f

    @property
    def label(self) -> str:
        return f"{self.pass_} {self.dtype} hd{self.hdim} causal={int(self.causal)} s={self.seqlen}"


def grid(args: argparse.Namespace) -> list[Cell]:
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    return [
        Cell(dt, hd, c, s, p)
        for p in args.passes
        for dt in args.dtype
        for hd in args.hdim
        for c in causals
        for s in args.seqlen
    ]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


@dataclass
class Result:
    """One backend on one cell. status: ok | WRONG | err | missing | unchecked (no SDPA to check against)."""

    status: str
    ms: float | None = None
    tflops: float | None = None
    rel_err: float | None = None
    error: str | None = None
    rounds_ms: list[float] = field(default_factory=list)  # --rounds: each round's time

    def text(self) -> str:
        if self.status == "ok" and self.tflops is not None:
            return f"{self.tflops:.0f}"
        if self.status == "unchecked" and self.tflops is not None:
            return f"{self.tflops:.0f} (unchecked)"
        return "" if self.status == "missing" else self.status


@dataclass
class Row:
    cell: Cell
    results: dict[str, Result] = field(default_factory=dict)
    variant: str | None = None
    # --bwd-variants: variant name -> its result on this cell (backward cells it serves only)
    bwd_variants: dict[str, Result] = field(default_factory=dict)

    def value(self, backend: str) -> float | None:
        r = self.results.get(backend)
        return r.tflops if r is not None and r.status == "ok" else None

    def ratio_best(self) -> float | None:
        mine = self.value("cutefa")
        peers = [v for v in (self.value(b) for b in PEERS) if v]
        return mine / max(peers) if mine is not None and peers else None

    def ratio_fa2(self) -> float | None:
        mine, fa2 = self.value("cutefa"), self.value("FA2")
        return mine / fa2 if mine is not None and fa2 else None


def variant_serves(name: str, cell: Cell) -> bool:
    """Whether backward variant ``name`` runs the backward of ``cell`` (dtype, head dim, mask)."""
    from cutefa.model.spec import parse_name

    spec = parse_name(name)
    return (
        cell.pass_ == "bwd"
        and spec.dtype == cell.dtype
        and spec.head_dim == cell.hdim
        and spec.causal == cell.causal
    )
