"""The benchmark's grid (tools/bench.py): its shapes and backends, the cells, and what a backend
gives on a cell (Result) and all backends on one (Row).

Layout (batch, seqlen, heads, head_dim) with batch x seqlen = TOKENS. Heads per cell (``--heads``):
"mha" has heads_q = heads_kv = MODEL_DIM / head_dim; "HQ/HKV" (e.g. 32/8, Llama 3 8B; 64/8, Llama
3 70B) grouped-query heads as given; "mqa" heads_q = MODEL_DIM / head_dim over one key/value head.
TFLOP/s counts 4*b*hq*s^2*d for the forward, 2.5x that for the backward, halved when causal.
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
HEADS = ("mha", "32/8", "64/8", "mqa")
QUICK_HEADS = ("mha", "32/8")
# SDPA's backends: "FA2" its FlashAttention-2, "efficient" its memory-efficient attention
BACKENDS = ("cutefa", "FA4", "cuDNN", "FA2", "efficient", "Flex")
PEERS = BACKENDS[1:]
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


def parse_heads(text: str) -> str:
    """One ``--heads`` entry, checked: "mha", "mqa" or "HQ/HKV" with HKV dividing HQ."""
    item = text.strip().lower()
    if item in ("mha", "mqa"):
        return item
    hq, sep, hkv = item.partition("/")
    if not sep or not hq.isdigit() or not hkv.isdigit() or int(hkv) == 0 or int(hq) % int(hkv):
        raise ValueError(f"--heads takes mha, mqa or HQ/HKV with HKV dividing HQ, got {text!r}")
    return f"{int(hq)}/{int(hkv)}"


@dataclass(frozen=True)
class Cell:
    """One benchmark problem. heads_q None: MODEL_DIM // hdim; heads_kv None: heads_q; batch None:
    TOKENS // seqlen."""

    dtype: str
    hdim: int
    causal: bool
    seqlen: int
    pass_: str = "fwd"
    heads_q: int | None = None
    heads_kv: int | None = None
    batch_: int | None = None

    @property
    def batch(self) -> int:
        return self.batch_ if self.batch_ is not None else max(1, TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return self.heads_q if self.heads_q is not None else max(1, MODEL_DIM // self.hdim)

    @property
    def kv_heads(self) -> int:
        return self.heads_kv if self.heads_kv is not None else self.heads

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.heads

    @property
    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen**2 * self.hdim
        f = f * 2.5 if self.pass_ == "bwd" else f  # backward: 5 matmuls to the forward's 2
        return f / 2 if self.causal else f

    @property
    def heads_label(self) -> str:
        return f"{self.heads}/{self.kv_heads}"

    @property
    def label(self) -> str:
        heads = f" h={self.heads_label}" if self.gqa else ""
        return f"{self.pass_} {self.dtype} hd{self.hdim}{heads} causal={int(self.causal)} s={self.seqlen}"


def cell_heads(entry: str, hdim: int) -> tuple[int, int]:
    """(heads_q, heads_kv) of a ``--heads`` entry at head dim ``hdim``."""
    mha = max(1, MODEL_DIM // hdim)
    if entry == "mha":
        return mha, mha
    if entry == "mqa":
        return mha, 1
    hq, hkv = entry.split("/")
    return int(hq), int(hkv)


def grid(args: argparse.Namespace) -> list[Cell]:
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    heads = getattr(args, "heads", ["mha"])
    cells = [
        Cell(dt, hd, c, s, p, *cell_heads(h, hd))
        for p in args.passes
        for dt in args.dtype
        for hd in args.hdim
        for h in heads
        for c in causals
        for s in args.seqlen
    ]
    return list(dict.fromkeys(cells))  # "mqa" and "HQ/1" may name one cell


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


@dataclass
class Result:
    """One backend on one cell. status: ok (checked, then timed) | FAIL (an output outside its bar
    or not finite: no time is taken) | err (the backend raised; see error) | missing (not installed).
    checks: output name -> its errors and bars (tools/bench_check.py), or "not returned"."""

    status: str
    ms: float | None = None
    tflops: float | None = None
    error: str | None = None
    rounds_ms: list[float] = field(default_factory=list)  # each round's time, in turns
    checks: dict = field(default_factory=dict)

    def text(self) -> str:
        if self.status == "ok" and self.tflops is not None:
            return f"{self.tflops:.0f}"
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
