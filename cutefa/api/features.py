"""The runtime values of a call's features, and the order in which every kernel takes them.

A spec's compile-time feature axes (:class:`cutefa.model.spec.Features`, and ``Mask.LOCAL``) say
*which* arguments its kernel takes; their values are arguments, never constants of the kernel.
Calling convention, every family and direction: after the kernel's own scalars (forward:
``softmax_scale``; backward: ``softmax_scale``, ``deterministic`` and the family's own), in this
order, those its spec has; a persistent forward's SM count comes last, after them (the loader
appends it: :class:`cutefa.ffi.WithSmCount`), and the stream is the caller's current one:

1. varlen: ``cu_seqlens_q``, ``cu_seqlens_k`` int32 (batch + 1,) prefix sums of the sequences'
   spans in the packed tensors; ``seqused_q``, ``seqused_k`` int32 (batch,) the rows of each span
   that are used (the span's length when the caller gives none); ``max_seqlen_q`` Int32 (the
   forward grid's query tiles); a backward also ``max_seqlen_k`` Int32 (its grid's key blocks). Packed layouts: q, out (total_q, heads_q, head_dim); k, v (total_k,
   heads_kv, head_dim); lse (heads_q, total_q).
2. local mask: ``window_left``, ``window_right`` Int32: query row ``i`` of a sequence attends key
   ``j`` when ``i + sk - sq - window_left <= j <= i + sk - sq + window_right`` (bottom-right
   aligned, ``sq``/``sk`` that sequence's lengths); an unbounded side is :data:`UNBOUNDED`.
3. softcap: ``softcap`` Float32 ``c > 0``: a score is ``c * tanh(softmax_scale * q.k / c)``.
4. alibi: ``alibi_slopes`` float32 (batch, heads_q): ``- slope * |i + sk - sq - j|`` is added to
   the (capped) score.
5. sinks: ``sinks`` float32 (heads_q,): one extra logit per head in each row's softmax
   denominator (natural-log units, like the scores); it takes no value. The lse includes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from cutefa.model.options import Mask
from cutefa.model.spec import Features

# The window bound a kernel receives for an unbounded side: larger than any sequence, small enough
# that ``i + sk - sq + UNBOUNDED + 1`` stays inside int32 for any length below 2**29.
UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class FeatureArgs:
    """What one call asks beyond dense attention: its runtime values, ready for the kernel."""

    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqused_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded; None: no window
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # float32 (batch, heads_q)
    sinks: torch.Tensor | None = None  # float32 (heads_q,)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def features(self) -> Features:
        """The compile-time feature axes a kernel needs for these values."""
        return Features(
            varlen=self.varlen, softcap=self.softcap != 0.0, alibi=self.alibi_slopes is not None,
            sinks=self.sinks is not None,
        )  # fmt: skip

    def mask(self, causal: bool) -> Mask:
        """The mask kind: LOCAL for any window (causal or not), else CAUSAL or NONE."""
        if self.window is not None:
            return Mask.LOCAL
        return Mask.CAUSAL if causal else Mask.NONE

    def window_bounds(self, causal: bool) -> tuple[int, int]:
        """(left, right) as the kernel takes them: -1 becomes :data:`UNBOUNDED`; causal caps right at 0."""
        left, right = self.window if self.window is not None else (-1, -1)
        left = UNBOUNDED if left < 0 else left
        right = UNBOUNDED if right < 0 else right
        return left, min(right, 0) if causal else right

    def kernel_args(self, causal: bool, direction: str = "fwd") -> tuple[Any, ...]:
        """The trailing kernel arguments of a ``direction`` kernel, in the order of the module
        docstring (a backward takes no sinks: its spec has no sinks axis)."""
        args: list[Any] = []
        if self.varlen:
            args += [
                self.cu_seqlens_q,
                self.cu_seqlens_k,
                self.seqused_q,
                self.seqused_k,
                int(self.max_seqlen_q),
            ]
            if direction == "bwd":
                args.append(int(self.max_seqlen_k))
        if self.window is not None:
            args += list(self.window_bounds(causal))
        if self.softcap != 0.0:
            args.append(float(self.softcap))
        if self.alibi_slopes is not None:
            args.append(self.alibi_slopes)
        if self.sinks is not None and direction == "fwd":
            args.append(self.sinks)
        return tuple(args)

    def replace(self, **changes: Any) -> FeatureArgs:
        return dataclasses.replace(self, **changes)


NO_FEATURES = FeatureArgs()
