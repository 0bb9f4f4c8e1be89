"""The symbolic values a user's mod is traced with: a small expression graph with Python operators.

A mod (``score_mod(score, b, h, q_idx, kv_idx)``, ``mask_mod(b, h, q_idx, kv_idx)``) is called once
with :class:`Sym` values instead of numbers; every operation on them records a node instead of
computing. Three kinds of value: ``"f"`` (float32: the score, float reads, quotients), ``"i"``
(int32: the indices, int reads) and ``"b"`` (bool: comparisons). Operations that have no meaning in
a kernel (Python ``if`` on a value, ``float(x)``, ``math.exp(x)``) raise :class:`ModTraceError`
naming the line of the user's code.

Supported: ``+ - * /`` and unary ``-``, ``**`` with a small non-negative int exponent, comparisons,
``& | ~`` on bools, ``abs``, and (on :class:`Sym` as methods, through ``torch.*`` or
:mod:`cutefa.mods.ops`) ``where``, ``exp``, ``tanh``, ``minimum``, ``maximum``, ``clamp``; reads of a
torch tensor indexed in every dimension by int expressions (``bias[h, q_idx - kv_idx]``).
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("f", "i", "b")
_HERE = os.path.dirname(os.path.abspath(__file__))
_MAX_POW = 4


class ModTraceError(TypeError):
    """A mod that cannot be traced into a kernel: the message names the file and line."""


def user_location(frames: list[tuple[str, int, str]] | None = None) -> str:
    """``file:line`` of the innermost frame outside cutefa.mods and torch (the user's mod): from
    ``frames`` (filename, line, name; innermost last), else the current stack."""
    if frames is None:
        frames = []
        f = sys._getframe(1)
        while f is not None:
            frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        frames.reverse()
    for filename, line, _ in reversed(frames):
        path = os.path.abspath(filename)
        if path.startswith(_HERE) or f"{os.sep}torch{os.sep}" in path:
            continue
        return f"{filename}:{line}"
    return "<unknown location>"


def fail(message: str) -> ModTraceError:
    """A :class:`ModTraceError` for ``message`` at the user's line."""
    return ModTraceError(f"{user_location()}: {message}")


class Sym:
    """One node: ``op`` with ``args`` (nodes), of ``kind``; ``value`` for leaves (an argument's
    name, a constant, a captured tensor's number)."""

    __slots__ = ("_key", "args", "kind", "op", "value")

    def __init__(self, op: str, kind: str, args: tuple[Sym, ...] = (), value: Any = None) -> None:
        self.op, self.kind, self.args, self.value = op, kind, args, value
        self._key: tuple | None = None

    @property
    def key(self) -> tuple:
        """A structural key: equal keys compute the same value (common subexpressions)."""
        if self._key is None:
            self._key = (self.op, self.kind, self.value, tuple(a.key for a in self.args))
        return self._key

    def __repr__(self) -> str:
        if self.op == "arg":
            return str(self.value)
        if self.op == "const":
            return repr(self.value)
        return f"{self.op}({', '.join(map(repr, self.args))})"

    # -- refusals: values a kernel computes cannot steer Python
    def __bool__(self) -> bool:
        raise fail(
            "Python control flow (if/while/and/or/not, or a chained comparison) on a traced value; "
            "use torch.where(cond, a, b), & | ~ instead"
        )

    def __float__(self) -> float:
        raise fail("float()/math.* on a traced value; use torch.exp/torch.tanh/torch.abs or cutefa.mods.ops")

    def __int__(self) -> int:
        raise fail("int() on a traced value")

    def __index__(self) -> int:
        raise fail("a traced value used as a Python index (e.g. of a list); index torch tensors only")

    def __iter__(self):
        raise fail("iterating a traced value")

    def __hash__(self) -> int:
        return id(self)

    # -- arithmetic
    def __add__(self, o: Any) -> Sym:
        return arith("add", self, o)

    def __radd__(self, o: Any) -> Sym:
        return arith("add", o, self)

    def __sub__(self, o: Any) -> Sym:
        return arith("sub", self, o)

    def __rsub__(self, o: Any) -> Sym:
        return arith("sub", o, self)

    def __mul__(self, o: Any) -> Sym:
        return arith("mul", self, o)

    def __rmul__(self, o: Any) -> Sym:
        return arith("mul", o, self)

    def __truediv__(self, o: Any) -> Sym:
        return arith("div", self, o)

    def __rtruediv__(self, o: Any) -> Sym:
        return arith("div", o, self)

    def __neg__(self) -> Sym:
        return unary("neg", self)

    def __pos__(self) -> Sym:
        return self

    def __abs__(self) -> Sym:
        return unary("abs", self)

    def __pow__(self, o: Any) -> Sym:
        if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o <= _MAX_POW:
            raise fail(f"x ** {o!r}: only small non-negative int exponents (0..{_MAX_POW}) are supported")
        out: Sym = const(1.0 if self.kind == "f" else 1)
        for _ in range(o):
            out = arith("mul", out, self) if out.op != "const" else self
        return out

    def __floordiv__(self, o: Any) -> Sym:
        raise fail("// is not supported in a mod (its rounding differs between Python and the GPU)")

    __rfloordiv__ = __floordiv__

    def __mod__(self, o: Any) -> Sym:
        raise fail("% is not supported in a mod")

    __rmod__ = __mod__

    # -- comparisons
    def __lt__(self, o: Any) -> Sym:
        return compare("lt", self, o)

    def __le__(self, o: Any) -> Sym:
        return compare("le", self, o)

    def __gt__(self, o: Any) -> Sym:
        return compare("gt", self, o)

    def __ge__(self, o: Any) -> Sym:
        return compare("ge", self, o)

    def __eq__(self, o: object) -> Sym:  # type: ignore[override]
        return compare("eq", self, o)

    def __ne__(self, o: object) -> Sym:  # type: ignore[override]
        return compare("ne", self, o)

    # -- logic (bools only)
    def __and__(self, o: Any) -> Sym:
        return logic("and", self, o)

    def __rand__(self, o: Any) -> Sym:
        return logic("and", o, self)

    def __or__(self, o: Any) -> Sym:
        return logic("or", self, o)

    def __ror__(self, o: Any) -> Sym:
        return logic("or", o, self)

    def __invert__(self) -> Sym:
        if self.kind != "b":
            raise fail("~ on a non-bool traced value (bitwise int operations are not supported)")
        return Sym("not", "b", (self,))

    # -- methods, as on torch tensors
    def exp(self) -> Sym:
        return unary("exp", self)

    def tanh(self) -> Sym:
        return unary("tanh", self)

    def abs(self) -> Sym:
        return unary("abs", self)

    def float(self) -> Sym:
        return to_float(self)

    def clamp(self, min: Any = None, max: Any = None) -> Sym:
        return clamp(self, min, max)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return torch_function(func, args, kwargs or {})


def const(value: Any) -> Sym:
    """A constant of ``value``'s kind (bool, int or float)."""
    if isinstance(value, bool):
        return Sym("const", "b", value=value)
    if isinstance(value, int):
        if not -(2**31) <= value < 2**31:
            raise fail(f"the int constant {value} does not fit int32")
        return Sym("const", "i", value=value)
    if isinstance(value, float):
        return Sym("const", "f", value=value)
    if isinstance(value, torch.Tensor):
        raise fail(
            f"a torch tensor of shape {tuple(value.shape)} used as a whole in a mod; read its elements by "
            "indexing it with b, h, q_idx, kv_idx expressions"
        )
    raise fail(f"a value of type {type(value).__name__} in a mod (only traced values, int, float and bool)")


def lift(x: Any) -> Sym:
    return x if isinstance(x, Sym) else const(x)


def to_float(x: Sym) -> Sym:
    if x.kind == "f":
        return x
    if x.kind == "b":
        raise fail("a bool used as a number; use torch.where(cond, 1.0, 0.0)")
    if x.op == "const":
        return const(float(x.value))
    return Sym("float", "f", (x,))


def _numbers(op: str, a: Any, b: Any) -> tuple[Sym, Sym, str]:
    a, b = lift(a), lift(b)
    if "b" in (a.kind, b.kind):
        raise fail(f"a bool in arithmetic ({op}); use torch.where(cond, a, b)")
    if op == "div" or "f" in (a.kind, b.kind):
        return to_float(a), to_float(b), "f"
    return a, b, "i"


def arith(op: str, a: Any, b: Any) -> Sym:
    a, b, kind = _numbers(op, a, b)
    return Sym(op, kind, (a, b))


def minmax(op: str, a: Any, b: Any) -> Sym:
    a, b, kind = _numbers(op, a, b)
    return Sym(op, kind, (a, b))


def compare(op: str, a: Any, b: Any) -> Sym:
    a, b = lift(a), lift(b)
    if "b" in (a.kind, b.kind):
        if a.kind != b.kind or op not in ("eq", "ne"):
            raise fail(f"comparison {op} of a bool with a number")
        return Sym(op, "b", (a, b))
    a, b, _ = _numbers(op, a, b)
    return Sym(op, "b", (a, b))


def logic(op: str, a: Any, b: Any) -> Sym:
    a, b = lift(a), lift(b)
    if a.kind != "b" or b.kind != "b":
        raise fail(
            f"{'&' if op == 'and' else '|'} of a non-bool traced value (bitwise int operations are not supported)"
        )
    return Sym(op, "b", (a, b))


def unary(op: str, a: Any) -> Sym:
    a = lift(a)
    if a.kind == "b":
        raise fail(f"{op} of a bool")
    if op in ("exp", "tanh"):
        return Sym(op, "f", (to_float(a),))
    return Sym(op, a.kind, (a,))


def where(cond: Any, a: Any, b: Any) -> Sym:
    cond = lift(cond)
    if cond.kind != "b":
        raise fail("where(cond, a, b): cond must be a comparison (a bool)")
    a, b = lift(a), lift(b)
    if a.kind == "b" and b.kind == "b":
        return Sym("where", "b", (cond, a, b))
    a, b, kind = _numbers("where", a, b)
    return Sym("where", kind, (cond, a, b))


def clamp(x: Any, lo: Any = None, hi: Any = None) -> Sym:
    out = lift(x)
    if lo is not None:
        out = minmax("max", out, lo)
    if hi is not None:
        out = minmax("min", out, hi)
    return out


def walk(roots: list[Sym]) -> list[Sym]:
    """The nodes reachable from ``roots`` (one per structural key), arguments before users."""
    seen: dict[tuple, Sym] = {}
    order: list[Sym] = []

    def visit(node: Sym) -> None:
        if node.key in seen:
            return
        for a in node.args:
            visit(a)
        seen[node.key] = node
        order.append(node)

    for r in roots:
        visit(r)
    return order


# ---------------------------------------------------------------------------------------------
# torch functions on traced values, and reads of captured tensors

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


@dataclass
class Capture:
    """The tensors a trace read, in the order of their first read (their kernel argument order)."""

    tensors: list[torch.Tensor] = field(default_factory=list)

    def index_of(self, t: torch.Tensor) -> int:
        for i, seen in enumerate(self.tensors):
            if seen is t:
                return i
        self.tensors.append(t)
        return len(self.tensors) - 1


CAPTURE: contextvars.ContextVar[Capture | None] = contextvars.ContextVar("cutefa_mod_capture", default=None)


def tensor_kind(dtype: torch.dtype) -> str:
    """How the kernel reads a captured tensor of ``dtype``: ``"f"`` float32, ``"i"`` int32 (bools as 0/1)."""
    if dtype in _FLOAT_DTYPES:
        return "f"
    if dtype in _INT_DTYPES or dtype == torch.bool:
        return "i"
    raise fail(f"a captured tensor of dtype {dtype}: mods read float or int/bool tensors")


def _load(t: torch.Tensor, index: Any) -> Sym:
    capture = CAPTURE.get()
    if capture is None:
        raise fail("a tensor indexed by a traced value outside a trace")
    index = index if isinstance(index, tuple) else (index,)
    if len(index) != t.dim():
        raise fail(
            f"a captured tensor of shape {tuple(t.shape)} indexed by {len(index)} value(s): index every "
            "dimension (each by an int expression of b, h, q_idx, kv_idx)"
        )
    parts = []
    for i in index:
        if isinstance(i, bool) or not isinstance(i, (int, Sym)):
            raise fail(f"a captured tensor indexed by {type(i).__name__}: use int expressions (no slices)")
        i = lift(i)
        if i.kind != "i":
            raise fail("a captured tensor indexed by a float or bool value; indices are int expressions")
        parts.append(i)
    kind = tensor_kind(t.dtype)
    node = Sym("load", kind, tuple(parts), value=capture.index_of(t))
    return compare("ne", node, 0) if t.dtype == torch.bool else node


def _refuse_tensor(args: tuple) -> None:
    for a in args:
        if isinstance(a, torch.Tensor):
            raise fail(
                f"a torch tensor of shape {tuple(a.shape)} used as a whole in a mod; read its elements by "
                "indexing it with b, h, q_idx, kv_idx expressions"
            )


_HANDLERS: dict[Any, Callable[..., Sym]] = {
    torch.where: lambda c, a, b: where(c, a, b),
    torch.exp: lambda a: unary("exp", a),
    torch.tanh: lambda a: unary("tanh", a),
    torch.abs: lambda a: unary("abs", a),
    torch.minimum: lambda a, b: minmax("min", a, b),
    torch.maximum: lambda a, b: minmax("max", a, b),
    torch.clamp: lambda a, min=None, max=None: clamp(a, min, max),
    torch.logical_and: lambda a, b: logic("and", a, b),
    torch.logical_or: lambda a, b: logic("or", a, b),
    torch.logical_not: lambda a: ~lift(a),
}


def torch_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """What a torch function does with symbolic arguments (:meth:`Sym.__torch_function__`)."""
    if func is torch.Tensor.__getitem__:
        return _load(args[0], args[1])
    handler = _HANDLERS.get(func)
    name = getattr(func, "__name__", repr(func))
    if handler is None:
        raise fail(f"torch.{name} is not supported in a mod (supported: where, exp, tanh, abs, minimum, "
                   "maximum, clamp, logical_and/or/not, tensor reads)")  # fmt: skip
    _refuse_tensor(args)
    _refuse_tensor(tuple(kwargs.values()))
    return handler(*args, **kwargs)
