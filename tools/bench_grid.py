"""The benchmark's grid (tools/bench.py): its shapes and backends, the cells, and what a backend
gives on a cell (Result) and all backends on one (Row).

Layout (batch, seqlen, heads, head_dim) with batch x seqlen = TOKENS. A cell's head dims
(``--hdim``): one head dim d for q, k and v, or a pair ``QK:V`` (q and k of head dim d_qk, v and the
output of d_v, e.g. 192:128, DeepSeek's prefill). Heads per cell (``--heads``): "mha" has heads_q =
heads_kv = MODEL_DIM // d_qk (rounded down where it does not divide: 25 at 80, 18 at 112, 10 at 192
and 192:128); "HQ/HKV" (e.g. 32/8, Llama 3 8B; 64/8, Llama 3 70B) grouped-query heads as given;
"mqa" heads_q = MODEL_DIM // d_qk over one key/value head. TFLOP/s counts 2*b*hq*s^2*(d_qk + d_v)
for the forward (4*b*hq*s^2*d with one head dim), 2.5x that for the backward (FlashAttention's
convention), halved when causal.
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


def parse_hdim(text: str) -> tuple[int, int]:
    """One ``--hdim`` item, checked: "D" (q, k and v of head dim D) or "QK:V", positive integers;
    returns (d_qk, d_v)."""
    qk, sep, v = text.strip().partition(":")
    dims = (qk, v) if sep else (qk, qk)
    if not all(d.strip().isdigit() and int(d) > 0 for d in dims):
        raise ValueError(
            f"--hdim takes head dims D or QK:V pairs of positive integers (e.g. 80,112,192:128), got {text!r}"
        )
    return int(dims[0]), int(dims[1])


def hdim_text(d_qk: int, d_v: int) -> str:
    """A cell's head dims as ``--hdim`` spells them: "128", or "192:128" where v's differs."""
    return str(d_qk) if d_v == d_qk else f"{d_qk}:{d_v}"


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
    """One benchmark problem: q and k of head dim ``hdim``, v and the output of ``hdim_v`` (None:
    ``hdim``). heads_q None: MODEL_DIM // hdim; heads_kv None: heads_q; batch None: TOKENS // seqlen."""

    dtype: str
    hdim: int
    causal: bool
    seqlen: int
    pass_: str = "fwd"
    heads_q: int | None = None
    heads_kv: int | None = None
    batch_: int | None = None
    hdim_v: int | None = None

    def __post_init__(self):
        if self.hdim_v == self.hdim:  # one head dim: one cell, however it was spelled
            object.__setattr__(self, "hdim_v", None)

    @property
    def v_dim(self) -> int:
        """The head dim of v and the output."""
        return self.hdim if self.hdim_v is None else self.hdim_v

    @property
    def hdim_text(self) -> str:
        return hdim_text(self.hdim, self.v_dim)

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
        f = 2.0 * self.batch * self.heads * self.seqlen**2 * (self.hdim + self.v_dim)
        # backward: 5 matmuls to the forward's 2 (FlashAttention's convention; where d_v differs the five
        # count 2*b*h*s^2*(3*d_qk + 2*d_v) exactly, 4% above it at 192:128)
        f = f * 2.5 if self.pass_ == "bwd" else f
        return f / 2 if self.causal else f

    @property
    def heads_label(self) -> str:
        return f"{self.heads}/{self.kv_heads}"

    @property
    def label(self) -> str:
        heads = f" h={self.heads_label}" if self.gqa else ""
        dims = f"hd{self.hdim}" + (f"v{self.v_dim}" if self.v_dim != self.hdim else "")
        batch = f" b={self.batch_}" if self.batch_ is not None else ""
        return f"{self.pass_} {self.dtype} {dims}{heads} causal={int(self.causal)} s={self.seqlen}{batch}"


def cell_heads(entry: str, hdim: int) -> tuple[int, int]:
    """(heads_q, heads_kv) of a ``--heads`` entry at head dim ``hdim``."""
    mha = max(1, MODEL_DIM // hdim)
    if entry == "mha":
        return mha, mha
    if entry == "mqa":
        return mha, 1
    hq, hkv = entry.split("/")
    return int(hq), int(hkv)


def head_dim_pairs(hdims) -> list[tuple[int, int]]:
    """``--hdim``'s items as (d_qk, d_v): an int d is (d, d)."""
    return [(hd, hd) if isinstance(hd, int) else (int(hd[0]), int(hd[1])) for hd in hdims]


def grid(args: argparse.Namespace) -> list[Cell]:
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    heads = getattr(args, "heads", ["mha"])
    batches = getattr(args, "batch", None) or [None]  # None: TOKENS // seqlen
    cells = [
        Cell(dt, hd, c, s, p, *cell_heads(h, hd), batch_=b, hdim_v=hv)
        for p in args.passes
        for dt in args.dtype
        for hd, hv in head_dim_pairs(args.hdim)
        for h in heads
        for c in causals
        for b in batches
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
    """Whether backward variant ``name`` runs the backward of ``cell`` (dtype, head dims, mask)."""
    from cutefa.model.spec import parse_name

    spec = parse_name(name)
    return (
        cell.pass_ == "bwd"
        and spec.dtype == cell.dtype
        and spec.head_dim == cell.hdim
        and spec.head_dim_v == cell.v_dim
        and spec.causal == cell.causal
    )
