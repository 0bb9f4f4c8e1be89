"""Context parallelism through PyTorch's own engine on two GPUs, cutefa as SDPA's flash provider:
``context_parallel`` over a 2-rank mesh, causal (load-balanced head-tail shards) and not, forward
and backward, against the unsharded cutefa call on the same inputs.

Run with ``torchrun --nproc-per-node 2 tests/gpu/cp_two_gpu.py [--seqlens 32768 131072]
[--gqa enable_gqa|repeat] [--provider cutefa|pytorch]``; prints one line per case and ``cp: all
passed`` (exit 0), else the failures (exit 1). tests/gpu/test_cp_two_gpu.py runs it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

import cutefa
from cutefa import dispatch
from cutefa import torch_sdpa as ts


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.double()
    return (
        torch.linalg.vector_norm(x.double() - ref64) / torch.linalg.vector_norm(ref64).clamp_min(1e-30)
    ).item()


class Lines(logging.Handler):
    """The provider's log lines: which calls cutefa served and which went to PyTorch's kernel."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.served = 0
        self.refused: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("cutefa sdpa:"):
            if "served by cutefa" in text:
                self.served += 1
            else:
                self.refused.append(text)


def unsharded(q, k, v, dout, causal):
    """(out, dq, dk, dv) of cutefa's own call on the whole sequence (bhsd in and out)."""
    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out = cutefa.flash_attn_func(qs, ks, vs, causal=causal)
    out.backward(dout.transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), qs.grad, ks.grad, vs.grad)]


def sharded(mesh, q, k, v, dout, causal, gqa):
    """(out, dq, dk, dv) of SDPA under context_parallel, unsharded back to sequence order."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _cp_options,
        context_parallel,
        context_parallel_unshard,
    )

    group = q.shape[1] // k.shape[1]
    _cp_options.enable_load_balance = causal  # PyTorch balances causal masks only
    buffers = [t.detach().clone() for t in (q, k, v, dout)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
        cq, ck, cv, cdout = buffers
        for t in (cq, ck, cv):
            t.requires_grad_(True)
        kk, vv = (ck, cv) if gqa == "enable_gqa" else (t.repeat_interleave(group, 1) for t in (ck, cv))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(cq, kk, vv, is_causal=causal, enable_gqa=gqa == "enable_gqa")
        out.backward(cdout)
        grads = [out.detach(), cq.grad, ck.grad, cv.grad]
        for t in (cq, ck, cv):
            t.requires_grad_(False)
        return context_parallel_unshard(mesh, grads, [2, 2, 2, 2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--gqa", choices=["enable_gqa", "repeat"], default="enable_gqa")
    parser.add_argument("--provider", choices=["cutefa", "pytorch"], default="cutefa")
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    lines = Lines()
    logging.getLogger("cutefa").addHandler(lines)
    logging.getLogger("cutefa").setLevel(logging.INFO)
    failures = []
    for seqlen in args.seqlens:
        for causal in (True, False):
            gen = torch.Generator(device="cuda").manual_seed(seqlen + causal)  # the same inputs on every rank
            heads = (args.heads[0], args.heads[1], args.heads[1], args.heads[0])
            q, k, v, dout = (
                torch.randn(1, seqlen, h, args.head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
                .transpose(1, 2) for h in heads
            )  # fmt: skip
            want = unsharded(q, k, v, dout, causal)
            if args.provider == "cutefa":
                ts.activate()
                dispatch.set_logging(True)
            try:
                lines.served, lines.refused = 0, []
                got = sharded(mesh, q, k, v, dout, causal, args.gqa)
            finally:
                dispatch.set_logging(False)
                ts.deactivate()
            errors = {name: rel_l2(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
            ok = all(e <= (1e-2 if n == "out" else 2e-2) for n, e in errors.items())
            if args.provider == "cutefa" and (lines.served == 0 or lines.refused):
                ok = False
                errors["refused"] = lines.refused[:2] or "no call served by cutefa"
            case = (
                f"seqlen={seqlen} causal={causal} heads={args.heads} gqa={args.gqa} provider={args.provider}"
            )
            if rank == 0:
                print(f"cp {'ok  ' if ok else 'FAIL'} {case} served={lines.served} {errors}", flush=True)
            if not ok:
                failures.append(case)
            del q, k, v, dout, want, got
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("cp: all passed" if not failures else f"cp: {len(failures)} failed: {failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
