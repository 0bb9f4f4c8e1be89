"""Decode benchmark: cutefa.flash_attn_with_kvcache beside its peers, as effective bandwidth.

Each cell is one decode step: ``batch`` sequences, each with ``cache`` keys in the KV cache (every
sequence at that length), ``tokens`` new query tokens (causal, bottom-right, when more than one),
heads ``hq/hkv``, head dim 128, bf16, the cache dense (batch, cache, hkv, d) or paged (pages of
``page`` tokens in scrambled order, int32 page table). Effective bandwidth = bytes of K and V read
(batch * cache * hkv * d * 2 * 2) / time, printed beside the GPU's device-to-device copy bandwidth
measured in the same run (bytes read + written by ``dst.copy_(src)`` of 1 GiB).

Peers, where installed: FA4 (``flash_attn.cute``: ``flash_attn_func`` on a dense cache,
``flash_attn_varlen_func(..., seqused_k=, page_table=)`` on a paged one, its own split heuristic
where its signature takes ``num_splits=0``), SDPA's cuDNN and flash backends on the dense cache
(``enable_gqa``; a bottom-right causal mask with several tokens), FlashInfer's
``BatchDecodeWithPagedKVCacheWrapper`` on the paged cache (one token). Every backend's output is
checked against a float32 reference (on the first and last sequence of the batch) before it is
timed; one that fails is FAIL and not timed, one that cannot run the cell is n/a.

Usage (on the GPU machine)::

    python tools/bench_decode.py --out DIR                      # the default grid
    python tools/bench_decode.py --batches 1,64 --caches 8192 --layouts dense,16 --tokens 1,4
    python tools/bench_decode.py --grid full --mem-gib 24       # the issue's grid, cells within memory
    python tools/bench_decode.py --grid quick --variants rows,keys   # both decode schedules side by side
    python tools/bench_decode.py --grid quick --variants rows,rows/sectors   # the policy's copy vs sectors
    python tools/bench_decode.py --grid quick --layouts 16,64 --variants rows/lines/rows,rows/lines/chunks
    python tools/bench_decode.py --batches 64 --caches 1024 --splits 1,2,3   # forced split counts beside the policy's

``--variants`` takes decode schedules (cutefa.model.policy_decode.DecodeSchedule: ``rows``, one warp
per 16-row slab, the default; ``keys``, warps splitting the keys of a 16-row tile), each optionally
followed by ``/`` and a copy layout (DecodeCopy: ``sectors`` or ``lines``; none: the policy's
choice per cell, policy_decode.default_copy) and optionally ``/`` and a paged cache's page lookup
(DecodePages: ``chunks``, the default where it applies, or ``rows``): one cutefa column each (``cutefa`` for the
first, ``cutefa[<variant>]`` for the others), each run under ``CUTEFA_DECODE_SCHEDULE``,
``CUTEFA_DECODE_COPY`` and ``CUTEFA_DECODE_PAGES`` set to it, and a cutefa / best peer ratio each.

``--graphs`` times every side as serving engines run a decode step: captured once in a CUDA graph
and replayed (the host's cost per call then drops out; a side that cannot be captured is n/a), the
replay's output checked against the reference again before it is timed.

Writes DIR/bench_decode.md (the table), DIR/bench_decode.json and DIR/bench_decode.png (with
matplotlib). ``--precompile`` compiles the cutefa variants of the grid in parallel first.
"""

import argparse
import contextlib
import inspect
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_run import Captured

from cutefa.api import kvcache

HEAD_DIM = 128
DTYPE = torch.bfloat16
GRIDS = {
    "quick": {"batches": [1, 64], "caches": [8192], "heads": ["32/8"], "tokens": [1], "layouts": ["dense", "16"]},
    "default": {
        "batches": [1, 8, 64, 256], "caches": [1024, 8192, 32768, 131072], "heads": ["32/8"], "tokens": [1],
        "layouts": ["dense", "16", "64"],
    },
    "full": {
        "batches": [1, 8, 64, 256], "caches": [1024, 8192, 32768, 131072], "heads": ["32/8", "64/8", "32/1"],
        "tokens": [1, 4, 16], "layouts": ["dense", "16", "64"],
    },
}  # fmt: skip
REL_L2_LIMIT = 2e-2  # bf16 output against the float32 reference


# ---------------------------------------------------------------------------------------------
# Timing and the copy bandwidth


def make_timer(warmup_ms: float = 25, rep_ms: float = 100):
    """(name, median milliseconds of a callable), L2 flushed between calls."""
    try:
        from triton.testing import do_bench

        return "triton.testing.do_bench", lambda fn: float(
            do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        )
    except ImportError:
        pass
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")

    def time_ms(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(50):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times)

    return "CUDA events (L2 flushed)", time_ms


def copy_bandwidth(time_ms) -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------
# A cell's inputs and reference


class Cell:
    def __init__(self, batch, cache, heads, tokens, layout):
        self.batch, self.cache, self.tokens, self.layout = batch, cache, tokens, layout
        self.hq, self.hkv = (int(x) for x in heads.split("/"))
        self.page = None if layout == "dense" else int(layout)

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.cache * self.hkv * HEAD_DIM * 2 * DTYPE.itemsize

    @property
    def name(self) -> str:
        return f"b{self.batch} L{self.cache} h{self.hq}/{self.hkv} q{self.tokens} {self.layout}"

    def build(self, gen):
        """q, (k, v) dense (batch, cache, hkv, d) or a paged pool with its table, cache_seqlens."""
        b, n, hkv = self.batch, self.cache, self.hkv
        self.q = torch.randn(b, self.tokens, self.hq, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        self.seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        if self.page is None:
            shape, self.table = (b, n, hkv, HEAD_DIM), None
        else:
            per_seq = -(-n // self.page)
            shape = (b * per_seq, self.page, hkv, HEAD_DIM)
            order = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(n)).int()
            self.table = order.reshape(b, per_seq).cuda()
        self.k = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)
        self.v = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)

    def dense_of(self, x, b):
        if self.table is None:
            return x[b]
        return x[self.table[b].long()].flatten(0, 1)[: self.cache]

    def reference(self, b):
        """float32 (tokens, hq, d) of sequence b, causal bottom-right with several tokens."""
        k, v = self.dense_of(self.k, b).float(), self.dense_of(self.v, b).float()
        group = self.hq // self.hkv
        q = self.q[b].float()  # (sq, hq, d)
        out = torch.empty(self.tokens, self.hq, HEAD_DIM, device="cuda")
        allowed = torch.arange(self.cache, device="cuda")[None, :] <= (
            torch.arange(self.tokens, device="cuda")[:, None] + self.cache - self.tokens
        )
        for h in range(self.hkv):
            qh = q[:, h * group : (h + 1) * group]  # (sq, group, d)
            s = torch.einsum("sgd,kd->gsk", qh, k[:, h]) / math.sqrt(HEAD_DIM)
            s = s.masked_fill(~allowed, -math.inf)
            out[:, h * group : (h + 1) * group] = torch.einsum("gsk,kd->sgd", torch.softmax(s, -1), v[:, h])
        return out

    def free(self):
        for name in ("q", "k", "v", "table", "seqlens"):
            setattr(self, name, None)


# ---------------------------------------------------------------------------------------------
# Backends: make(cell) -> a no-argument callable returning out (batch, tokens, hq, d), or None (n/a)


def cutefa_backend(cell, num_splits=0):
    causal = cell.tokens > 1
    return lambda: kvcache.flash_attn_with_kvcache(
        cell.q, cell.k, cell.v, cache_seqlens=cell.seqlens, page_table=cell.table, causal=causal,
        num_splits=num_splits,
    )  # fmt: skip


def variant_env(variant: str) -> dict:
    """The environment of a ``--variants`` item: ``schedule``, ``schedule/copy`` or
    ``schedule/copy/pages`` (a part left empty: the default)."""
    parts = variant.split("/")
    if len(parts) > 3:
        raise ValueError(f"--variants item {variant!r}: at most schedule/copy/pages")
    schedule, copy, pages = parts + [""] * (3 - len(parts))
    return {kvcache.SCHEDULE_ENV: schedule, kvcache.COPY_ENV: copy, kvcache.PAGES_ENV: pages}


def variant_choice(variant: str):
    """(DecodeSchedule, DecodeCopy or None, DecodePages) of a ``--variants`` item, read as the API
    reads its environment (a ValueError naming the known values)."""
    with environment(variant_env(variant)):
        return kvcache.decode_schedule(), kvcache.decode_copy(), kvcache.decode_pages()


class CutefaVariant:
    """cutefa under one decode schedule and copy layout: ``env`` is set while the cell is checked
    and timed."""

    def __init__(self, variant: str):
        self.variant = variant
        self.env = variant_env(variant)

    def __call__(self, cell):
        return cutefa_backend(cell)


class ForcedSplits:
    """cutefa with ``num_splits`` forced (the policy's variant, the split count the caller's)."""

    env = None

    def __init__(self, splits: int):
        if splits < 1:
            raise ValueError(f"--splits {splits}: a split count is at least 1")
        self.splits = splits

    def __call__(self, cell):
        return cutefa_backend(cell, self.splits)


def columns(variants: list[str], splits: list[int]) -> dict:
    """The sides in table order: a cutefa column per ``--variants`` item (``cutefa`` the first,
    ``cutefa[<variant>]`` the others; none given: ``cutefa`` under the caller's environment), one per
    forced split count (``cutefa[splits=N]``), the peers."""
    ours_sides = {("cutefa" if i == 0 else f"cutefa[{v}]"): CutefaVariant(v) for i, v in enumerate(variants)}
    ours_sides = ours_sides or {"cutefa": cutefa_backend}
    forced = {f"cutefa[splits={n}]": ForcedSplits(n) for n in splits}
    return ours_sides | forced | PEERS


@contextlib.contextmanager
def environment(env):
    """``env`` (a dict, or None) set in os.environ for the block, the previous values restored."""
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ours(name: str) -> bool:
    return name.startswith("cutefa")


def _accepts(fn, name):
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def fa4_backend(cell):
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None
    causal = cell.tokens > 1
    fn = flash_attn_func if cell.table is None else flash_attn_varlen_func
    kwargs = {"causal": causal}
    if _accepts(fn, "num_splits"):
        kwargs["num_splits"] = 0  # its own split heuristic
    if cell.table is not None:
        kwargs.update(seqused_k=cell.seqlens, page_table=cell.table)

    def run():
        out = fn(cell.q, cell.k, cell.v, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return run


def sdpa_backend(which):
    def make(cell):
        if cell.table is not None:
            return None
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[which]
        q, k, v = (x.transpose(1, 2) for x in (cell.q, cell.k, cell.v))
        mask = None
        if cell.tokens > 1:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(cell.tokens, cell.cache)

        def run():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, enable_gqa=True
                )
            return out.transpose(1, 2)

        return run

    return make


def flashinfer_backend(cell):
    if cell.table is None or cell.tokens != 1:
        return None
    try:
        import flashinfer
    except ImportError:
        return None
    b, per_seq = cell.table.shape
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=cell.hq > cell.hkv
    )
    indptr = torch.arange(0, (b + 1) * per_seq, per_seq, dtype=torch.int32, device="cuda")
    last = torch.full((b,), cell.cache - (per_seq - 1) * cell.page, dtype=torch.int32, device="cuda")
    wrapper.plan(
        indptr, cell.table.flatten(), last, cell.hq, cell.hkv, HEAD_DIM, cell.page, q_data_type=DTYPE,
        kv_data_type=DTYPE,
    )  # fmt: skip
    q = cell.q[:, 0]
    return lambda: wrapper.run(q, (cell.k, cell.v))[:, None]


BACKENDS = {
    "cutefa": cutefa_backend,  # --variants replaces it with a column per schedule
    "fa4": fa4_backend,
    "cudnn": sdpa_backend("cudnn"),
    "sdpa-flash": sdpa_backend("flash"),
    "flashinfer": flashinfer_backend,
}
PEERS = {n: m for n, m in BACKENDS.items() if not ours(n)}


def rel_l2(x, ref):
    return (
        torch.linalg.vector_norm(x.double() - ref.double()) / torch.linalg.vector_norm(ref.double())
    ).item()


def run_cell(cell, time_ms, gen, graphs: bool = False):
    """{backend: (status, ms)} for one cell: built, checked against the reference, then timed
    (``graphs``: captured in a CUDA graph first, the replay's output checked too)."""
    cell.build(gen)
    refs = {b: cell.reference(b) for b in sorted({0, cell.batch - 1})}
    results = {}
    for name, make in BACKENDS.items():
        try:
            scope = environment(getattr(make, "env", None))
            scope.__enter__()
            fn = make(cell)
            if fn is None:
                results[name] = ("n/a", None)
                continue
            out = fn()
            torch.cuda.synchronize()
            errors = [rel_l2(out[b], ref) for b, ref in refs.items()]
            if not all(e <= REL_L2_LIMIT for e in errors):
                results[name] = (f"FAIL {max(errors):.1e}", None)
                continue
            if graphs:
                fn = Captured(lambda fn=fn: fn)
                out = fn()
                torch.cuda.synchronize()
                errors = [rel_l2(out[b], ref) for b, ref in refs.items()]
                if not all(e <= REL_L2_LIMIT for e in errors):
                    results[name] = (f"FAIL (graph replay) {max(errors):.1e}", None)
                    continue
            results[name] = ("ok", time_ms(fn))
        except Exception as exc:  # noqa: BLE001 -- a backend that cannot run the cell is reported, not fatal
            results[name] = (
                f"n/a: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}",
                None,
            )
        finally:
            torch.cuda.synchronize()
            scope.__exit__(None, None, None)
    cell.free()
    torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------------------------
# Report


def table(rows, copy_bw) -> str:
    names = list(BACKENDS)
    mine = [n for n in names if ours(n)]
    head = (
        "| cell | K/V MiB | "
        + " | ".join(f"{n} us (TB/s)" for n in names)
        + "".join(f" | {n} / best peer | {n} / copy" for n in mine)
        + " |"
    )
    lines = [head, "|" + "---|" * (len(names) + 2 + 2 * len(mine))]
    for row in rows:
        cells = []
        for n in names:
            status, ms = row["results"][n]
            cells.append(
                f"{ms * 1e3:.1f} ({row['kv_bytes'] / (ms * 1e-3) / 1e12:.2f})" if ms else status.split(":")[0]
            )
        peers = [ms for n, (s, ms) in row["results"].items() if not ours(n) and ms]
        for n in mine:
            ms = row["results"][n][1]
            cells.append(f"{min(peers) / ms:.2f}x" if ms and peers else "-")
            cells.append(f"{row['kv_bytes'] / (ms * 1e-3) / copy_bw:.0%}" if ms else "-")
        lines.append(f"| {row['cell']} | {row['kv_bytes'] / 2**20:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, copy_bw, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(BACKENDS)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.6), 5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ys = [row["kv_bytes"] / (ms * 1e-3) / 1e12 if (ms := row["results"][n][1]) else 0 for row in rows]
        ax.bar([x + i * width for x in range(len(rows))], ys, width, label=n)
    ax.axhline(copy_bw / 1e12, color="k", linestyle="--", label="copy (read + write)")
    ax.set_xticks([x + 0.4 for x in range(len(rows))], [r["cell"] for r in rows], rotation=75, fontsize=7)
    ax.set_ylabel("K/V bytes read / time (TB/s)")
    ax.set_title(f"decode, bf16 hd{HEAD_DIM} ({torch.cuda.get_device_name()})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def cells_of(args) -> list[Cell]:
    grid = dict(GRIDS[args.grid])
    for key in ("batches", "caches", "heads", "tokens", "layouts"):
        value = getattr(args, key)
        if value:
            grid[key] = [v if key in ("heads", "layouts") else int(v) for v in value.split(",")]
    cells = [
        Cell(b, n, h, t, lay)
        for h in grid["heads"] for t in grid["tokens"] for lay in grid["layouts"]
        for b in grid["batches"] for n in grid["caches"]
    ]  # fmt: skip
    return cells


def precompile(cells, jobs: int, variants=("rows",)) -> None:
    from cutefa import dispatch
    from cutefa.compile import compile_variants
    from cutefa.model import policy_decode
    from cutefa.model.options import Mask

    choices = [variant_choice(v) for v in variants]
    specs = {
        policy_decode.decode_spec(
            "bf16", HEAD_DIM, c.tokens * (c.hq // c.hkv), mask=Mask.CAUSAL if c.tokens > 1 else Mask.NONE,
            paged=c.page is not None, schedule=schedule, copy=copy, kv_bytes=c.kv_bytes, pages=pages,
            page_size=c.page,
        )
        for c in cells for schedule, copy, pages in choices
    }  # fmt: skip
    results = compile_variants(sorted(specs), target=dispatch.current_target(), jobs=jobs, progress=True)
    for r in results:
        if not r.ok:
            print(f"compile failed: {r.spec.name}: {r.error}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="default")
    for key in ("batches", "caches", "heads", "tokens", "layouts"):
        parser.add_argument(f"--{key}", help="comma-separated, overrides the grid's")
    parser.add_argument("--mem-gib", type=float, default=24.0, help="skip cells whose K/V exceed this")
    parser.add_argument("--out", default=".", help="folder for bench_decode.{md,json,png}")
    parser.add_argument("--precompile", action="store_true", help="compile the grid's cutefa variants first")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument(
        "--variants",
        default="",
        help="comma-separated decode schedules (rows, keys), each with an optional /copy layout "
        "(sectors, lines) and /page lookup (rows, chunks): a cutefa column each",
    )
    parser.add_argument(
        "--graphs", action="store_true", help="time each side captured in a CUDA graph (replays: no host cost)"
    )
    parser.add_argument(
        "--splits", default="", help="comma-separated split counts: a cutefa column each with num_splits forced"
    )
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for variant in variants:
        variant_choice(variant)  # a ValueError naming the known schedules, copy layouts and page lookups
    splits = [int(n) for n in args.splits.split(",") if n.strip()]
    if variants or splits:
        sides = columns(variants, splits)
        BACKENDS.clear()
        BACKENDS.update(sides)
    cells = cells_of(args)
    skipped = [c for c in cells if c.kv_bytes > args.mem_gib * 2**30]
    cells = [c for c in cells if c not in skipped]
    if args.precompile:
        precompile(cells, args.jobs, variants or ["rows"])
    timer, time_ms = make_timer()
    copy_bw = copy_bandwidth(time_ms)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for cell in cells:
        results = run_cell(cell, time_ms, gen, args.graphs)
        rows.append({"cell": cell.name, "kv_bytes": cell.kv_bytes, "results": results})
        print(
            cell.name,
            {n: (s if ms is None else f"{ms * 1e3:.1f}us") for n, (s, ms) in results.items()},
            flush=True,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = (
        f"# Decode bandwidth, {torch.cuda.get_device_name()} (torch {torch.__version__}, timer {timer}"
        + (", every side replayed from a CUDA graph" if args.graphs else "")
        + ")\n\n"
        f"Device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write). Cells show microseconds and "
        "K/V TB/s; FAIL: output off the float32 reference; n/a: the backend cannot run the cell.\n\n"
        + table(rows, copy_bw)
        + (
            f"\n\nSkipped (K/V over {args.mem_gib} GiB): " + ", ".join(c.name for c in skipped)
            if skipped
            else ""
        )
        + "\n"
    )
    (out / "bench_decode.md").write_text(text)
    (out / "bench_decode.json").write_text(json.dumps({"copy_bw": copy_bw, "rows": rows}, indent=1))
    drew = plot(rows, copy_bw, out / "bench_decode.png")
    print(text)
    print(
        f"wrote {out / 'bench_decode.md'}"
        + (f" and {out / 'bench_decode.png'}" if drew else " (no matplotlib: no PNG)")
    )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
