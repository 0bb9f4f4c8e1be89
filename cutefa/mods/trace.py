"""Trace a user's ``score_mod`` / ``mask_mod`` into an expression graph (:mod:`cutefa.mods.expr`).

The function runs once on symbolic arguments. A torch tensor it indexes with them (``bias[h,
q_idx - kv_idx + L - 1]``, ``doc_ids[b, kv_idx]``) is *captured*: it becomes a kernel argument,
read at run time (its values may change between calls without a recompile); torch's
``__torch_function__`` protocol routes such reads and ``torch.where``/``torch.exp``/... on
symbolic values here. A function that cannot be traced raises
:class:`~cutefa.mods.expr.ModTraceError` naming the line of its code.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch

from cutefa.mods import expr
from cutefa.mods.expr import CAPTURE, Capture, ModTraceError, Sym

SCORE_ARGS = (("score", "f"), ("b", "i"), ("h", "i"), ("q_idx", "i"), ("kv_idx", "i"))
MASK_ARGS = SCORE_ARGS[1:]


def _user_error(exc: BaseException) -> ModTraceError:
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    return ModTraceError(f"{expr.user_location(frames)}: {type(exc).__name__}: {exc} (while tracing the mod)")


def _run(fn: Callable[..., Any], arg_specs: tuple[tuple[str, str], ...]) -> tuple[Any, list[torch.Tensor]]:
    if not callable(fn):
        raise TypeError(f"a mod must be a function, got {type(fn).__name__}")
    capture = Capture()
    token = CAPTURE.set(capture)
    try:
        result = fn(*(Sym("arg", kind, value=name) for name, kind in arg_specs))
    except ModTraceError:
        raise
    except Exception as exc:
        raise _user_error(exc) from exc
    finally:
        CAPTURE.reset(token)
    if isinstance(result, torch.Tensor):
        raise ModTraceError(
            f"{_where(fn)}: the mod returned a torch tensor, not a value computed from its arguments"
        )
    return result, capture.tensors


def _where(fn: Callable[..., Any]) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(fn)


def trace_score(fn: Callable[..., Any]) -> tuple[Sym, list[torch.Tensor]]:
    """``score_mod(score, b, h, q_idx, kv_idx)`` as a float expression and the tensors it reads."""
    result, tensors = _run(fn, SCORE_ARGS)
    try:
        node = expr.lift(result)
    except ModTraceError:
        raise ModTraceError(
            f"{_where(fn)}: score_mod returned {type(result).__name__}, not a number"
        ) from None
    if node.kind == "b":
        raise ModTraceError(f"{_where(fn)}: score_mod returned a bool; a mask is a mask_mod")
    return expr.to_float(node), tensors


def trace_mask(fn: Callable[..., Any]) -> tuple[Sym, list[torch.Tensor]]:
    """``mask_mod(b, h, q_idx, kv_idx)`` as a bool expression and the tensors it reads."""
    result, tensors = _run(fn, MASK_ARGS)
    if isinstance(result, bool) or (isinstance(result, Sym) and result.kind == "b"):
        return expr.lift(result), tensors
    raise ModTraceError(
        f"{_where(fn)}: mask_mod must return a bool (a comparison), got {type(result).__name__}"
    )
