"""What the CPU test files share: seeded random inputs, a plain attention reference, tracing a
flash_attn_func call under torch.compile on fake CUDA tensors, and loading a script of tools/ as a
module."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

import cutefa


def rand(*shape, seed=0):
    """A float32 tensor of standard normal values, the same for the same shape and seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(q, k, v, causal, scale, dtype=torch.float32):
    """Plain attention in ``dtype`` with grouped heads and bottom-right causal masking:
    (out (b, sq, hq, d), lse (b, hq, sq)). A row that attends no key gets out 0 and lse -inf."""
    group = q.shape[2] // k.shape[2]
    k, v = k.to(dtype).repeat_interleave(group, 2), v.to(dtype).repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
        s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def trace_attention_block(q, k, v, q_descale=None, k_descale=None, v_descale=None):
    """Compile ``out * 2, lse.exp()`` of a causal flash_attn_func call with torch.compile
    (fullgraph=True) and run it on q, k, v and the descales (fake CUDA tensors: no GPU needed).
    Dynamo must trace exactly one graph. Returns (out, lse) and the targets that graph calls."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=capture)
    def attention_block(q, k, v, qd, kd, vd):
        out, lse = cutefa.flash_attn_func(
            q, k, v, causal=True, return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd
        )
        return out * 2, lse.exp()

    torch._dynamo.reset()
    result = attention_block(q, k, v, q_descale, k_descale, v_descale)
    (graph,) = graphs
    return result, [n.target for n in graph.graph.nodes if n.op == "call_function"]


def load_tool(name: str):
    """The script tools/<name>.py as a module, loaded once under its own key in sys.modules."""
    key = f"cutefa_tools_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
