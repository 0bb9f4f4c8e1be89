"""The CuTe DSL source of a traced mod: one ``@cute.jit`` function a kernel template inserts.

``mod_scores(s_mn, c_mn, row_base, col_base, seqlen_q, seqlen_k, softmax_scale, b, h, clamp_keys,
use_mask, mod_t0, ...)`` turns a (rows, cols) view of an fp32 accumulator fragment holding raw q.k
into natural-log scores: ``score = q.k * softmax_scale``, then the score_mod, then (``use_mask``) the
mask_mod (-inf where it is false). ``c_mn`` holds the tile-local (row, col) coordinate of each element
(a row's depends on the row index only, a column's on the column index only); ``row_base`` /
``col_base`` the sequence coordinates of the tile origin. Query rows past ``seqlen_q`` (never stored)
are evaluated at row ``seqlen_q - 1`` and, with ``clamp_keys``, keys past ``seqlen_k`` (masked by the
caller) at key ``seqlen_k - 1``, so that a captured tensor is never read out of its bounds.

Each node is computed where its inputs change: nodes of b and h once, nodes of the query index once
per row (kept in Python lists: the loops unroll at trace time; a thread holds few rows), nodes of the
key index once per column (the outer loop: a thread holds many columns, whose values would take a
register each if kept), the rest per element.
"""

from __future__ import annotations

import math

from cutefa.mods.expr import Sym, walk

FUNCTION = "mod_scores"
_ORDER = {"g": 0, "c": 1, "r": 2, "e": 3}
_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
           "eq": "==", "ne": "!="}  # fmt: skip
_CALL = {"min": "cutlass.min", "max": "cutlass.max", "and": "cutlass.and_", "or": "cutlass.or_"}


def tensor_params(count: int) -> list[str]:
    """The names of the captured tensors' parameters (and kernel arguments)."""
    return [f"mod_t{i}" for i in range(count)]


def _level(node: Sym, levels: dict[tuple, str]) -> str:
    if node.op == "arg":
        return {"score": "e", "q_idx": "r", "kv_idx": "c"}.get(node.value, "g")
    found = {levels[a.key] for a in node.args}
    if "e" in found or {"r", "c"} <= found:
        return "e"
    return "r" if "r" in found else "c" if "c" in found else "g"


def reads_per_score(*roots: Sym | None) -> bool:
    """Whether the expressions read a captured tensor at an index that depends on both the query
    and the key index (or the score): one load per score, which a kernel holds in flight."""
    levels: dict[tuple, str] = {}
    for node in walk([r for r in roots if r is not None]):
        levels[node.key] = _level(node, levels)
        if node.op == "load" and levels[node.key] == "e":
            return True
    return False


def _const(node: Sym) -> str:
    if node.kind == "b":
        return f"cutlass.Boolean({node.value})"
    if node.kind == "i":
        return f"Int32({node.value})"
    if math.isnan(node.value):
        raise ValueError("a NaN constant in a mod")
    if math.isinf(node.value):
        return "Float32.inf" if node.value > 0 else "(-Float32.inf)"
    return f"Float32({node.value!r})"


class _Names:
    def __init__(self) -> None:
        self.levels: dict[tuple, str] = {}
        self.names: dict[tuple, str] = {}

    def ref(self, node: Sym) -> str:
        if node.op == "const":
            return _const(node)
        if node.op == "arg":
            return node.value
        name = self.names[node.key]
        return f"{name}[r]" if self.levels[node.key] == "r" else name


def _expression(node: Sym, n: _Names) -> str:
    a = [n.ref(x) for x in node.args]
    op = node.op
    if op == "div" and node.args[1].op == "const" and node.args[1].value not in (0.0,):
        return f"({a[0]} * Float32({1.0 / node.args[1].value!r}))"  # a multiply, not a division
    if op in _BINARY:
        return f"({a[0]} {_BINARY[op]} {a[1]})"
    if op in _CALL:
        return f"{_CALL[op]}({a[0]}, {a[1]})"
    if op == "float":
        return f"Float32({a[0]})"
    if op == "neg":
        return f"(-{a[0]})"
    if op == "not":
        return f"cutlass.not_({a[0]})"
    if op == "abs":
        return (
            f"cute.math.absf({a[0]})" if node.kind == "f" else f"cutlass.select_({a[0]} < 0, -{a[0]}, {a[0]})"
        )
    if op == "exp":
        return f"cute.math.exp({a[0]}, fastmath=True)"
    if op == "tanh":
        return f"tanh_approx({a[0]})"
    if op == "where":
        cast = {"f": "Float32", "i": "Int32", "b": "cutlass.Boolean"}[node.kind]
        return f"{cast}(cutlass.select_({a[0]}, {a[1]}, {a[2]}))"
    if op == "load":
        cast = "Float32" if node.kind == "f" else "Int32"
        return f"{cast}(mod_t{node.value}[{', '.join(a)}])"
    raise ValueError(f"no kernel form for the mod operation {op!r}")


def _statements(nodes: list[Sym], n: _Names, level: str, indent: str) -> list[str]:
    lines = []
    for node in nodes:
        if node.op in ("const", "arg") or n.levels[node.key] != level:
            continue
        text = _expression(node, n)
        name = n.names[node.key]
        lines.append(f"{indent}{name}.append({text})" if level == "r" else f"{indent}{name} = {text}")
    return lines


def function_source(
    score: Sym | None, mask: Sym | None, tensors: int, d_score: Sym | None = None, name: str = FUNCTION
) -> str:
    """The module-level source of the mod function (see the module docs); ``tensors``: how many
    captured tensors it takes. With ``d_score`` (d score_mod / d score) the function also takes
    ``d_mn`` (keyword, optional: a (rows, cols) fp32 view like ``s_mn``) and writes the derivative
    at each element's scaled score there (the backward)."""
    n = _Names()
    roots = [r for r in (score, mask, d_score) if r is not None]
    nodes = walk(roots)
    for node in nodes:
        n.levels[node.key] = _level(node, n.levels)
        n.names[node.key] = f"{n.levels[node.key]}{len(n.names)}"
    score_keys = {x.key for x in walk([score])} if score is not None else set()
    mask_keys = {x.key for x in walk([mask])} if mask is not None else set()
    d_keys = {x.key for x in walk([d_score])} if d_score is not None else set()
    mask_only = mask_keys - score_keys - d_keys
    # the derivative's own per-element nodes run only when d_mn is given
    d_only = {k for k in d_keys - score_keys - mask_keys if n.levels[k] == "e"}
    shared = [x for x in nodes if x.key not in mask_only and x.key not in d_only]
    masked = [x for x in nodes if x.key in mask_only]
    derived = [x for x in nodes if x.key in d_only]
    params = "".join(f", {p}: cute.Tensor" for p in tensor_params(tensors))
    d_param = ", d_mn: cute.Tensor = None" if d_score is not None else ""
    out = [
        "@cute.jit",
        f"def {name}(",
        "    s_mn: cute.Tensor, c_mn: cute.Tensor, row_base: Int32, col_base: Int32, seqlen_q: Int32,",
        "    seqlen_k: Int32, softmax_scale: Float32, b: Int32, h: Int32, clamp_keys: cutlass.Constexpr,",
        f"    use_mask: cutlass.Constexpr{params}{d_param},",
        "):",
        '    """The user\'s score_mod and mask_mod on a fragment of raw q.k (cutefa.mods.kernel_source)."""',
    ]
    out += _statements(shared, n, "g", "    ")
    out.append("    if cutlass.const_expr(use_mask):")
    out += _statements(masked, n, "g", "        ") or ["        pass"]
    row_lists = [n.names[x.key] for x in nodes if n.levels[x.key] == "r" and x.op not in ("const", "arg")]
    for lst in ["qs", *row_lists]:
        out.append(f"    {lst} = []")
    out += [
        "    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):",
        "        q_idx = cutlass.min(row_base + c_mn[r, 0][0], seqlen_q - 1)",
        "        qs.append(q_idx)",
    ]
    out += _statements(shared, n, "r", "        ")
    out.append("        if cutlass.const_expr(use_mask):")
    out += _statements(masked, n, "r", "            ") or ["            pass"]
    out += [
        "    for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):",
        "        kv_idx = col_base + c_mn[0, c][1]",
        "        if cutlass.const_expr(clamp_keys):",
        "            kv_idx = cutlass.min(kv_idx, seqlen_k - 1)",
    ]
    out += _statements(shared, n, "c", "        ")
    out.append("        if cutlass.const_expr(use_mask):")
    out += _statements(masked, n, "c", "            ") or ["            pass"]
    out += [
        "        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):",
        "            q_idx = qs[r]",
        "            score = s_mn[r, c] * softmax_scale",
    ]
    out += _statements(shared, n, "e", "            ")
    out.append(f"            result = {n.ref(score) if score is not None else 'score'}")
    if mask is not None and not (mask.op == "const" and mask.value is True):
        out.append("            if cutlass.const_expr(use_mask):")
        out += _statements(masked, n, "e", "                ")
        out.append(f"                result = Float32(cutlass.select_({n.ref(mask)}, result, -Float32.inf))")
    out.append("            s_mn[r, c] = result")
    if d_score is not None:
        out.append("            if cutlass.const_expr(d_mn is not None):")
        out += _statements(derived, n, "e", "                ")
        out.append(f"                d_mn[r, c] = {n.ref(d_score)}")
    return "\n".join(out) + "\n"


P_GRAD_FUNCTION = "mod_p_grad"
P_GRAD_SOURCE = """@cute.jit
def mod_p_grad(p: cute.Tensor, d: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
    \"\"\"A new register tensor like ``p`` (fp32 probabilities of an accumulator fragment) of ``dtype``
    holding P * d (``d``: d score_mod / d score of the same fragment): dS = P d (dP - D) then comes
    out of the dense backward's dS = P (dP - D) with this in place of P.\"\"\"
    out = cute.make_fragment_like(p, dtype)
    out.store((p.load() * d.load()).to(dtype))
    return out
"""
