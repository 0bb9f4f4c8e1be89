"""MLA decode benchmark: cutefa's MLA decode (cutefa.api.mla) beside its peers, as effective bandwidth.

Each cell is one decode step of DeepSeek's absorbed MLA: ``batch`` sequences of ``cache`` keys in
one paged latent cache (num_pages, 64, 1, 576) bf16, pages in scrambled order, ``hq`` query heads
of head dim 576, one query token, output head dim 512. Effective bandwidth = bytes of the latent
cache read (batch * cache * 576 * 2) / time, printed beside the GPU's device-to-device copy
bandwidth measured in the same run.

Sides: cutefa (the default kernel) and cutefa-wgmma (the opt-in WGMMA variant,
cutefa.model.policy_mla_wgmma). Peers, where importable (else "n/a (why)"): FlashMLA
(``flash_mla_with_kvcache``), FlashInfer's ``BatchMLAPagedAttentionWrapper`` (latent and rope
parts as two caches, copied apart before timing), FA3's
``flash_attn_interface.flash_attn_with_kvcache`` (``qv``: rope part as q/k, latent as v) and FA4
(``flash_attn.cute``: the same split where its signature takes ``qv``). Every output is checked
against a float32 reference (first and last sequence) before it is timed; a failure is FAIL and
not timed.

Usage (on the GPU machine)::

    python tools/bench_mla.py --out DIR                # batch 64 x 8k, 1 x 32k, 16 x 16k; hq 16/64/128
    python tools/bench_mla.py --cells 64x8192 --heads 128
"""

import argparse
import inspect
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_decode import copy_bandwidth, make_timer, rel_l2

from cutefa.api import mla
from cutefa.model import policy_mla_wgmma

PAGE = 64
DTYPE = torch.bfloat16
CELLS = ["64x8192", "1x32768", "16x16384"]
HEADS = [16, 64, 128]
SCALE = 1 / math.sqrt(192)
REL_L2_LIMIT = 2e-2


class Cell:
    def __init__(self, batch: int, cache: int, hq: int):
        self.batch, self.cache, self.hq = batch, cache, hq

    @property
    def label(self) -> str:
        return f"b{self.batch} x {self.cache}, hq {self.hq}"

    @property
    def cache_bytes(self) -> int:
        return self.batch * self.cache * 576 * 2

    def build(self, gen):
        per_seq = -(-self.cache // PAGE)
        pages = self.batch * per_seq
        self.q = torch.randn((self.batch, 1, self.hq, 576), generator=gen, device="cuda").to(DTYPE)
        self.kv = torch.randn((pages, PAGE, 1, 576), generator=gen, device="cuda").to(DTYPE)
        self.table = (
            torch.randperm(pages, generator=gen, device="cuda").reshape(self.batch, per_seq).to(torch.int32)
        )
        self.seqlens = torch.full((self.batch,), self.cache, dtype=torch.int32, device="cuda")

    def reference(self, b: int):
        keys = torch.arange(self.cache, device="cuda")
        rows = self.kv[self.table[b, keys // PAGE].long(), keys % PAGE, 0].float()
        s = torch.einsum("hd,nd->hn", self.q[b, 0].float(), rows) * SCALE
        return torch.einsum("hn,nd->hd", torch.softmax(s, -1), rows[:, :512])

    def free(self):
        del self.q, self.kv, self.table, self.seqlens


def cutefa_backend(cell):
    return lambda: mla.mla_decode(cell.q, cell.kv, cell.table, cell.seqlens, softmax_scale=SCALE)[0][:, 0]


def cutefa_wgmma_backend(cell):
    """The opt-in WGMMA variant (cutefa.model.policy_mla_wgmma), selected by its spec."""
    spec = policy_mla_wgmma.mla_spec("bf16")
    return lambda: mla.decode(cell.q, cell.kv, cell.table, cell.seqlens, SCALE, False, 0, spec=spec)[0][:, 0]


def flashmla_backend(cell):
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except ImportError as exc:
        return f"n/a (flash_mla not importable: {exc})"
    meta, splits = get_mla_metadata(cell.seqlens, cell.hq, 1)
    return lambda: flash_mla_with_kvcache(
        cell.q, cell.kv, cell.table, cell.seqlens, 512, meta, splits, softmax_scale=SCALE
    )[0][:, 0]


def flashinfer_backend(cell):
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except ImportError as exc:
        return f"n/a (flashinfer.mla not importable: {exc})"
    ckv = cell.kv[:, :, 0, :512].contiguous()
    kpe = cell.kv[:, :, 0, 512:].contiguous()
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = BatchMLAPagedAttentionWrapper(workspace)
    per_seq = cell.table.shape[1]
    qo_indptr = torch.arange(cell.batch + 1, dtype=torch.int32, device="cuda")
    kv_indptr = torch.arange(0, (cell.batch + 1) * per_seq, per_seq, dtype=torch.int32, device="cuda")
    wrapper.plan(
        qo_indptr, kv_indptr, cell.table.flatten(), cell.seqlens, cell.hq, 512, 64, PAGE, False, SCALE, DTYPE, DTYPE
    )  # fmt: skip
    q_nope, q_pe = cell.q[:, 0, :, :512].contiguous(), cell.q[:, 0, :, 512:].contiguous()
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe)


def _qv_backend(fn, cell):
    """FA3/FA4 spelling: q/k the rope part (64), v the latent (512), qv the latent part of q."""
    k_rope = cell.kv[:, :, :, 512:].contiguous()
    v_latent = cell.kv[:, :, :, :512].contiguous()
    q_rope, qv = cell.q[..., 512:].contiguous(), cell.q[..., :512].contiguous()
    return lambda: fn(
        q_rope,
        k_rope,
        v_latent,
        qv=qv,
        page_table=cell.table,
        cache_seqlens=cell.seqlens,
        softmax_scale=SCALE,
    )[:, 0]


def fa3_backend(cell):
    try:
        from flash_attn_interface import flash_attn_with_kvcache
    except ImportError as exc:
        return f"n/a (flash_attn_interface (FA3) not importable: {exc})"
    return _qv_backend(flash_attn_with_kvcache, cell)


def fa4_backend(cell):
    try:
        from flash_attn.cute import interface
    except ImportError as exc:
        return f"n/a (flash_attn.cute (FA4) not importable: {exc})"
    fn = getattr(interface, "flash_attn_with_kvcache", None)
    if fn is None or "qv" not in inspect.signature(fn).parameters:
        return "n/a (FA4's interface takes no qv (MLA) argument)"
    return _qv_backend(fn, cell)


BACKENDS = {
    "cutefa": cutefa_backend,
    "cutefa-wgmma": cutefa_wgmma_backend,
    "flashmla": flashmla_backend,
    "flashinfer": flashinfer_backend,
    "fa3": fa3_backend,
    "fa4": fa4_backend,
}


def run_cell(cell, time_ms, gen):
    cell.build(gen)
    refs = {b: cell.reference(b) for b in sorted({0, cell.batch - 1})}
    results = {}
    for name, make in BACKENDS.items():
        try:
            fn = make(cell)
            if isinstance(fn, str):
                results[name] = (fn, None)
                continue
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            torch.cuda.synchronize()
            errors = [rel_l2(out[b].float(), ref) for b, ref in refs.items()]
            if not all(e <= REL_L2_LIMIT for e in errors):
                results[name] = (f"FAIL {max(errors):.1e}", None)
                continue
            results[name] = ("ok", time_ms(fn))
        except Exception as exc:  # noqa: BLE001 -- a backend that cannot run the cell is reported
            first = str(exc).splitlines()[0][:80] if str(exc) else ""
            results[name] = (f"n/a ({type(exc).__name__}: {first})", None)
        finally:
            torch.cuda.synchronize()
    cell.free()
    torch.cuda.empty_cache()
    return results


def table(rows, copy_bw) -> str:
    names = list(BACKENDS)
    lines = [
        f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s",
        "",
        "| cell | cache MiB | " + " | ".join(f"{n} us (TB/s, % copy)" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for cell, results in rows:
        cols = []
        for n in names:
            status, ms = results[n]
            if ms is None:
                cols.append(status)
            else:
                bw = cell.cache_bytes / (ms * 1e-3)
                cols.append(f"{ms * 1e3:.1f} ({bw / 1e12:.2f}, {100 * bw / copy_bw:.0f}%)")
        lines.append(f"| {cell.label} | {cell.cache_bytes / 2**20:.0f} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=",".join(CELLS), help="BATCHxCACHE,... (default: %(default)s)")
    ap.add_argument("--heads", default=",".join(map(str, HEADS)), help="query heads (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write bench_mla.md and bench_mla.json here")
    args = ap.parse_args(argv)
    timer_name, time_ms = make_timer()
    copy_bw = copy_bandwidth(time_ms)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for spec in args.cells.split(","):
        batch, cache = (int(x) for x in spec.split("x"))
        for hq in (int(h) for h in args.heads.split(",")):
            cell = Cell(batch, cache, hq)
            rows.append((cell, run_cell(cell, time_ms, gen)))
            print(table(rows[-1:], copy_bw).splitlines()[-1], flush=True)
    text = f"timer: {timer_name}; {torch.cuda.get_device_name()}\n\n" + table(rows, copy_bw)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_mla.md").write_text(text + "\n")
        data = [
            {"batch": c.batch, "cache": c.cache, "hq": c.hq, "results": {n: list(r) for n, r in res.items()}}
            for c, res in rows
        ]
        (args.out / "bench_mla.json").write_text(json.dumps({"copy_bw": copy_bw, "rows": data}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
