"""The derivative of a traced score_mod with respect to its score, symbolically.

The backward needs d score_mod / d score per element (the chain rule turns dS of the modified score
into dS of the raw score). :func:`d_score` differentiates the expression graph by the usual rules;
what has no derivative in the score (a captured tensor read whose index depends on the score, which
the tracer already refuses since indices are ints) cannot occur. Comparisons and ``where`` are
piecewise: their derivative is the branch taken (as autograd's).
"""

from __future__ import annotations

from cutefa.mods import expr
from cutefa.mods.expr import Sym

ZERO = 0.0
ONE = 1.0


def _is(node: Sym, value: float) -> bool:
    return node.op == "const" and node.kind == "f" and node.value == value


def _add(a: Sym, b: Sym) -> Sym:
    if _is(a, ZERO):
        return b
    if _is(b, ZERO):
        return a
    return expr.arith("add", a, b)


def _sub(a: Sym, b: Sym) -> Sym:
    if _is(b, ZERO):
        return a
    if _is(a, ZERO):
        return expr.unary("neg", b)
    return expr.arith("sub", a, b)


def _mul(a: Sym, b: Sym) -> Sym:
    if _is(a, ZERO) or _is(b, ZERO):
        return expr.const(ZERO)
    if _is(a, ONE):
        return b
    if _is(b, ONE):
        return a
    return expr.arith("mul", a, b)


def _div(a: Sym, b: Sym) -> Sym:
    if _is(a, ZERO):
        return expr.const(ZERO)
    return expr.arith("div", a, b)


def depends_on_score(node: Sym, memo: dict[tuple, bool] | None = None) -> bool:
    memo = {} if memo is None else memo
    if node.key not in memo:
        if node.op == "arg":
            memo[node.key] = node.value == "score"
        else:
            memo[node.key] = any(depends_on_score(a, memo) for a in node.args)
    return memo[node.key]


def d_score(root: Sym) -> Sym:
    """d ``root`` / d score as an expression (a float), simplified where a factor is 0 or 1."""
    deps: dict[tuple, bool] = {}
    memo: dict[tuple, Sym] = {}
    zero = expr.const(ZERO)

    def d(node: Sym) -> Sym:
        if not depends_on_score(node, deps) or node.kind != "f":
            return zero
        if node.key in memo:
            return memo[node.key]
        op, a = node.op, node.args
        if op == "arg":
            out = expr.const(ONE)
        elif op == "add":
            out = _add(d(a[0]), d(a[1]))
        elif op == "sub":
            out = _sub(d(a[0]), d(a[1]))
        elif op == "mul":
            out = _add(_mul(d(a[0]), a[1]), _mul(a[0], d(a[1])))
        elif op == "div":
            # (u / v)' = u' / v - u v' / v^2
            out = _sub(_div(d(a[0]), a[1]), _div(_mul(a[0], d(a[1])), _mul(a[1], a[1])))
        elif op == "neg":
            out = _sub(zero, d(a[0]))
        elif op == "abs":
            inner = d(a[0])
            out = zero if _is(inner, ZERO) else expr.where(a[0] < 0.0, expr.unary("neg", inner), inner)
        elif op == "exp":
            out = _mul(node, d(a[0]))
        elif op == "tanh":
            out = _mul(_sub(expr.const(ONE), _mul(node, node)), d(a[0]))
        elif op in ("min", "max"):
            first = a[0] <= a[1] if op == "min" else a[0] >= a[1]
            out = expr.where(first, d(a[0]), d(a[1]))
        elif op == "where":
            da, db = d(a[1]), d(a[2])
            out = da if da.key == db.key else expr.where(a[0], da, db)
        else:  # float() of an int, a load: no score inside (ints never depend on the score)
            out = zero
        memo[node.key] = out
        return out

    return d(root)
