"""A traced pair of mods: what the kernel computes, what it reads, and the key that names it.

The key is the sha256 of the traced expressions' structure (their operations and constants, from
which :mod:`cutefa.mods.kernel_source` writes the kernel code) and of each captured tensor's kernel
dtype and rank.
Not its values, and not its sizes: the kernel reads them at run time, so a mod whose table or
document ids change (in value or length) keeps its kernel. Two functions that trace to the same
expression share one kernel.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cutefa.mods import derivative, expr, kernel_source, trace
from cutefa.mods.expr import ModTraceError, Sym

KEY_CHARS = 12  # of the key in a variant's name


@dataclass(frozen=True, eq=False)
class TracedMods:
    """``score`` (float expression of score, b, h, q_idx, kv_idx) and ``mask`` (bool expression of
    b, h, q_idx, kv_idx), either None when not given; ``tensors``: the captured tensors in their
    kernel argument order."""

    score: Sym | None
    mask: Sym | None
    tensors: tuple[torch.Tensor, ...]

    @functools.cached_property
    def kinds(self) -> tuple[tuple[str, int], ...]:
        """(kernel dtype 'f' float32 | 'i' int32, rank) of each captured tensor."""
        return tuple((expr.tensor_kind(t.dtype), t.dim()) for t in self.tensors)

    @functools.cached_property
    def source(self) -> str:
        """The kernel function (:func:`cutefa.mods.kernel_source.function_source`)."""
        return kernel_source.function_source(self.score, self.mask, len(self.tensors))

    @functools.cached_property
    def key(self) -> str:
        """sha256 of the expressions' structure (operations, constants, which tensor each read is)
        and the captured tensors' kinds: what the kernel source is made from, without making it."""
        structure = (
            None if self.score is None else self.score.key,
            None if self.mask is None else self.mask.key,
            self.kinds,
        )
        return hashlib.sha256(repr(structure).encode()).hexdigest()

    @property
    def short_key(self) -> str:
        return self.key[:KEY_CHARS]

    @functools.cached_property
    def needs_grad(self) -> bool:
        """Whether d score_mod / d score is not 1 everywhere (the backward then scales P by it)."""
        d = self.d_score()
        return not (d.op == "const" and d.value == 1.0)

    @functools.cached_property
    def grad_source(self) -> str:
        """The backward's kernel function: :attr:`source` that also writes d score_mod / d score
        (its ``d_mn``), when :attr:`needs_grad`."""
        d = self.d_score() if self.needs_grad else None
        return kernel_source.function_source(self.score, self.mask, len(self.tensors), d)

    def d_score(self) -> Sym:
        """d score_mod / d score (1 without a score_mod)."""
        if self.score is None:
            return Sym("const", "f", value=1.0)
        return derivative.d_score(self.score)

    def reads_per_score(self) -> bool:
        """Whether a captured tensor is read once per score (an index of both q_idx and kv_idx):
        the register pressure that bounds a mod kernel's key blocks (:mod:`cutefa.mods.base`)."""
        return kernel_source.reads_per_score(self.score, self.mask)

    def describe(self) -> str:
        parts = []
        if self.score is not None:
            parts.append(f"score_mod {self.score!r}")
        if self.mask is not None:
            parts.append(f"mask_mod {self.mask!r}")
        return f"mods {self.short_key}: " + "; ".join(parts) + f" ({len(self.tensors)} captured tensor(s))"

    def kernel_tensors(self) -> list[torch.Tensor]:
        """The captured tensors as the kernel reads them: float32 or int32, contiguous."""
        out = []
        for t, (kind, _) in zip(self.tensors, self.kinds):
            t = t.float() if kind == "f" else t.int()
            out.append(t.contiguous())
        return out


def trace_mods(score_mod: Callable[..., Any] | None, mask_mod: Callable[..., Any] | None) -> TracedMods:
    """Trace ``score_mod`` and ``mask_mod`` (either may be None, not both) into one
    :class:`TracedMods`: their captured tensors merged (one argument per distinct tensor object)."""
    if score_mod is None and mask_mod is None:
        raise ValueError("trace_mods: give a score_mod, a mask_mod or both")
    score, mask, tensors = None, None, []
    if score_mod is not None:
        score, tensors = trace.trace_score(score_mod)
    if mask_mod is not None:
        mask, mask_tensors = trace.trace_mask(mask_mod)
        mask = _renumber(mask, mask_tensors, tensors)
    return TracedMods(score, mask, tuple(tensors))


def _renumber(root: Sym, own: list[torch.Tensor], merged: list[torch.Tensor]) -> Sym:
    """``root`` with its loads numbered in ``merged`` (``own`` appended where new)."""
    index = {}
    for i, t in enumerate(own):
        found = next((j for j, m in enumerate(merged) if m is t), None)
        if found is None:
            merged.append(t)
            found = len(merged) - 1
        index[i] = found
    memo: dict[int, Sym] = {}

    def copy(node: Sym) -> Sym:
        if id(node) not in memo:
            args = tuple(copy(a) for a in node.args)
            value = index[node.value] if node.op == "load" else node.value
            memo[id(node)] = Sym(node.op, node.kind, args, value)
        return memo[id(node)]

    return copy(root)


__all__ = ["KEY_CHARS", "ModTraceError", "TracedMods", "trace_mods"]
