"""Evaluate a traced expression with torch (tests, references, the derivative's check): the
arguments as broadcastable tensors, the captured tensors read by advanced indexing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cutefa.mods.expr import Sym, walk

_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "min": torch.minimum,
    "max": torch.maximum, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
    "ne": torch.ne, "and": torch.logical_and, "or": torch.logical_or,
}  # fmt: skip
_UNARY = {"neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "tanh": torch.tanh, "not": torch.logical_not}


def evaluate(root: Sym, args: Mapping[str, torch.Tensor], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``root`` for ``args`` (score, b, h, q_idx, kv_idx as broadcastable tensors) in float32/int64/bool."""
    values: dict[tuple, torch.Tensor] = {}
    for node in walk([root]):
        a = [values[x.key] for x in node.args]
        if node.op == "arg":
            v = torch.as_tensor(args[node.value])
        elif node.op == "const":
            dtype = {"f": torch.float32, "i": torch.int64, "b": torch.bool}[node.kind]
            v = torch.tensor(node.value, dtype=dtype)
        elif node.op == "load":
            t = tensors[node.value]
            v = t[tuple(i.long() for i in torch.broadcast_tensors(*a))]
            v = v.float() if node.kind == "f" else v.long()
        elif node.op == "float":
            v = a[0].float()
        elif node.op == "where":
            v = torch.where(a[0], a[1], a[2])
        elif node.op in _UNARY:
            v = _UNARY[node.op](a[0])
        else:
            v = _BINARY[node.op](a[0], a[1])
        values[node.key] = v
    return values[root.key]
