"""Problem shape -> kernel variant, with the reasons behind the choice.

For a compile target, every kernel family that runs there is tried, newest first. Within a family
a tuned table measured on a real GPU (``cutefa/tuned/<arch>_<gpu>.json``, schema in
``cutefa/tuned/README.md``, read by :mod:`cutefa.tuned_tables`) is consulted first, then the
family's default kernel (:func:`cutefa.model.defaults.default_config`). Each candidate must pass
:func:`cutefa.model.rules.why_invalid` and fit the target's GPUs (:func:`cutefa.model.rules.why_not_on`:
its family runs there, its shared memory fits their per-block limit); rejected candidates keep
their reason so :func:`explain_problem` can say why they lost.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from cutefa.model.defaults import SEPARATE_V_BWD_FAMILIES, default_spec, separate_v_config
from cutefa.model.options import Mask
from cutefa.model.rules import fitting_variant, padded_tile_note, why_invalid, why_no_kernel, why_not_on
from cutefa.model.spec import (
    ARCHS,
    PACKED,
    TARGETS,
    TORCH_DTYPE_NAMES,
    Features,
    VariantSpec,
    families_for_target,
    parse_name,
    target_for_capability,
)
from cutefa.tuned_tables import forget_tables, seqlen_bucket, tables_for

log = logging.getLogger("cutefa")

NO_FEATURES = Features()  # a dense problem's feature axes

MIN_CC = 80


@dataclass(frozen=True)
class Problem:
    """The shape facts dispatch looks at."""

    target: str
    dtype: str
    head_dim: int
    causal: bool
    seqlen_q: int
    seqlen_k: int
    batch: int
    heads_q: int
    heads_kv: int
    gpu_name: str | None = None
    # fp8: v was centered before quantization (cutefa.center_v; the mean goes back on the output in
    # the kernel's epilogue or after it), so the tensor cores sum no mean share of O and a table's
    # v_centered entries apply.
    v_centered: bool = False
    # A sliding window (Mask.LOCAL; ``causal`` then says whether it is capped at the diagonal) and
    # the feature axes of the call. A varlen problem's seqlens are its max_seqlen_q/k and its batch
    # the number of sequences.
    local: bool = False
    features: Features = NO_FEATURES
    # v's (and the output's) head dim: None gives head_dim; another one is a pair of
    # cutefa.model.spec.HEAD_DIM_V_PAIRS, served by the families' default variants with it.
    head_dim_v: int | None = None
    # A varlen problem's packed query rows (q.shape[0]); None: not known (every sequence full).
    # Few rows for batch x max_seqlen_q make an uneven batch (policy_sm90.uneven_batch).
    total_q: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def separate_v(self) -> bool:
        """Whether v has a head dim of its own."""
        return self.head_dim_v != self.head_dim

    @property
    def uneven(self) -> bool:
        """A packed batch of a few long sequences among short ones (:func:`policy_sm90.uneven_batch`)."""
        return self.features.varlen and _uneven(self.batch, self.seqlen_q, self.total_q)

    @property
    def mask(self) -> Mask:
        if self.local:
            return Mask.LOCAL
        return Mask.CAUSAL if self.causal else Mask.NONE

    def with_features(self, spec: VariantSpec) -> VariantSpec:
        """``spec`` (a dense variant of this problem's table or default) with its mask and features."""
        if not self.local and not self.features.any:
            return spec
        return spec.replace(mask=self.mask, features=self.features)

    @property
    def bucket(self) -> int | None:
        """seqlen_k rounded up to a power of two, or None above
        :data:`cutefa.tuned_tables.MAX_SEQLEN_BUCKET` (the tuned tables' granularity)."""
        return seqlen_bucket(self.seqlen_k)

    def describe(self) -> str:
        where = f"{self.target} ({self.gpu_name})" if self.gpu_name else self.target
        extras = ([" sliding window"] if self.local else []) + [f" {t}" for t in self.features.tokens]
        if self.features.varlen:
            rows = "" if self.total_q is None else f"{self.total_q} query rows, "
            shapes = (
                f"varlen: {self.batch} sequences, {rows}max_seqlen_q={self.seqlen_q} max_seqlen_k={self.seqlen_k}, "
                f"heads {self.heads_q}/{self.heads_kv}, head_dim {self.head_dim}"
                + (f" (v {self.head_dim_v})" if self.separate_v else "")
            )
            extras = [e for e in extras if e != " varlen"]
        else:
            shapes = (
                f"q=({self.batch}, {self.seqlen_q}, {self.heads_q}, {self.head_dim}) "
                f"k=({self.batch}, {self.seqlen_k}, {self.heads_kv}, {self.head_dim})"
                + (
                    f" v=({self.batch}, {self.seqlen_k}, {self.heads_kv}, {self.head_dim_v})"
                    * self.separate_v
                )
            )
        return (
            f"{shapes} {self.dtype} causal={self.causal}{''.join(extras)}"
            f"{' v centered' if self.v_centered else ''} on {where}"
        )


def _uneven(batch: int, max_seqlen_q: int, total_q: int | None) -> bool:
    """:func:`cutefa.model.policy_sm90.uneven_batch`, imported on a packed call's first use (a dense
    start-up loads no family policy)."""
    from cutefa.model.policy_sm90 import uneven_batch

    return uneven_batch(batch, max_seqlen_q, total_q)


@dataclass(frozen=True)
class Choice:
    """The variant to run, the target it is compiled for, why, and which candidates lost and why."""

    spec: VariantSpec
    target: str
    reason: str
    rejected: list[tuple[str, str]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Targets and devices


_DEVICES: dict[int, tuple[str, str]] = {}


def device_target(device: Any = None) -> tuple[str, str]:
    """(compile target, GPU name) of a CUDA device (default: the current one), memoized per device."""
    import torch

    index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
    if index is None:
        index = torch.cuda.current_device()
    found = _DEVICES.get(index)  # (a clear_caches from another thread may empty the memo at any time)
    if found is None:
        major, minor = torch.cuda.get_device_capability(index)
        found = _DEVICES[index] = (target_for_capability(major, minor), torch.cuda.get_device_name(index))
    return found


def current_target(device: Any = None) -> str:
    """The compile target of a CUDA device (default: the current one), e.g. 'sm_90a' on an H100."""
    return device_target(device)[0]


def check_target(target: str, gpu_name: str | None = None) -> None:
    """Raise ``NotImplementedError`` naming the GPU and what is supported when cutefa has no kernel
    there (``target`` is what :func:`cutefa.model.spec.target_for_capability` names any GPU: 'sm_<cc>'
    where cutefa has no build), ``ValueError`` when ``target`` is no compile target at all."""
    if target in TARGETS:
        return
    where = f"{gpu_name} ({target})" if gpu_name else target
    cc = re.fullmatch(r"sm_(\d+)[a-z]?", target)
    if cc is None:
        raise ValueError(f"target={target!r} is not a compile target like 'sm_90a'; known: {TARGETS}")
    if int(cc[1]) < MIN_CC:
        need = f"cutefa needs compute capability {MIN_CC // 10}.{MIN_CC % 10}+"
    else:
        need = "cutefa has no build for it"
    raise NotImplementedError(f"no cutefa kernel for {where}: {need} (supported compile targets: {TARGETS})")


# ---------------------------------------------------------------------------------------------
# Forgetting


# Held while a choice is memoized and while the memo is forgotten.
_LOCK = threading.Lock()
_CLEARS = 0  # how many times clear_caches ran: a choice made across a clear is not memoized


def clear_caches() -> None:
    """Forget memoized choices, device facts and loaded tables (after editing
    :data:`cutefa.identity.TUNED_DIR`; :func:`cutefa.tuned_tables.forget_tables`), and the call
    plans built on those choices. Safe while other threads dispatch: a reading of the tables under
    way finishes before they are forgotten, and a choice made before the clear is not memoized
    after it."""
    global _CLEARS
    # The tables first, then the count: a choose that read the count after this clear's bump
    # searches tables read after the clear; one that read it before either memoizes before the
    # bump (and the memo is emptied with it) or finds the count moved and memoizes nothing.
    forget_tables()
    with _LOCK:
        _CLEARS += 1
        _CHOICES.clear()
    _DEVICES.clear()
    plans = sys.modules.get("cutefa.api.plans")  # loaded only once torch is: no import here
    if plans is not None:
        plans.clear_plans()


# ---------------------------------------------------------------------------------------------
# Choosing


def _dtype_token(dtype: Any) -> str:
    """'fp16'/'bf16'/'e4m3' from a spec token or a torch dtype."""
    token = TORCH_DTYPE_NAMES.get(str(dtype).removeprefix("torch."), str(dtype))
    if token not in TORCH_DTYPE_NAMES.values():
        raise ValueError(f"dtype={dtype!r} is not one of {tuple(TORCH_DTYPE_NAMES.values())}")
    return token


def _v_centered(v_centered: object, dtype: Any) -> bool:
    """``v_centered``, checked: a bool, true only for e4m3 problems."""
    if not isinstance(v_centered, bool):
        raise TypeError(f"v_centered must be a bool; got {v_centered!r}")
    if v_centered and _dtype_token(dtype) != "e4m3":
        raise ValueError(f"v_centered applies to e4m3 (fp8) problems only; got dtype {dtype}")
    return v_centered


def _table_candidate(
    family: str, problem: Problem, direction: str = "fwd"
) -> tuple[str, VariantSpec | None, str] | None:
    """(label, spec or None, how it was picked or why it is unusable) from the tuned table, if any."""
    for table in tables_for(family, problem, direction):
        entry = table.lookup(problem)
        if entry is not None:
            break
    else:
        return None
    where = f"tuned table {table.path.name} (measured on {table.measured_on})"
    try:
        spec = parse_name(entry.variant)
    except ValueError as exc:
        return entry.variant, None, f"{where}: {exc}"
    wanted = (family, direction, problem.dtype, problem.head_dim, problem.causal)
    if (spec.arch, spec.direction, spec.dtype, spec.head_dim, spec.causal) != wanted:
        return spec.name, None, f"{where}: entry {entry.describe()} names a variant for another problem"
    if table.gpu.lower() not in (problem.gpu_name or "").lower():
        where += f", a {table.gpu}; no table for this GPU"
    return spec.name, spec, f"{where}: entry {entry.describe()}"


def tuned_backward(
    family: str,
    *,
    target: str,
    dtype: Any,
    head_dim: int,
    causal: bool,
    seqlen_k: int,
    gpu_name: str | None = None,
) -> tuple[VariantSpec | None, str] | None:
    """The backward variant of ``family`` that a tuned backward table (``direction: bwd``) names for
    this problem: (spec, how it was picked) or (None, why its entry is unusable); None without an entry."""
    problem = Problem(target, _dtype_token(dtype), head_dim, causal, seqlen_k, seqlen_k, 1, 1, 1, gpu_name)
    found = _table_candidate(family, problem, "bwd")
    return None if found is None else found[1:]


def _heuristic_candidate(family: str, problem: Problem) -> tuple[str, VariantSpec | None, str]:
    head_dim_v = problem.head_dim_v if problem.separate_v else None
    spec = default_spec(
        family, "fwd", problem.dtype, problem.head_dim, causal=problem.causal, head_dim_v=head_dim_v
    )
    if spec is None:
        why = f"no tuned entry and no default {problem.dtype} kernel for {family} head_dim={problem.head_dim}"
        return family, None, why
    source = f"default_config({family!r}, 'fwd', {problem.dtype!r}, {problem.head_dim})"
    if head_dim_v is not None and separate_v_config(
        family, "fwd", problem.dtype, problem.head_dim, head_dim_v
    ):
        source = f"separate_v_config({family!r}, 'fwd', {problem.dtype!r}, {problem.head_dim}, {head_dim_v})"
    rule = (
        f"heuristic: {source} = {spec.tile_m}x{spec.tile_n} tile, {spec.stages} stage(s), {spec.warps} warps"
    )
    if head_dim_v is not None:
        rule += f", with head_dim_v={head_dim_v}"
    fitting = fitting_variant(spec, problem.target)
    if fitting is not None and fitting != spec:
        rule += (
            f", over the shared memory of {problem.target} GPUs ({why_not_on(spec, problem.target)}); the "
            f"largest committed tile that fits: {fitting.tile_m}x{fitting.tile_n}, {fitting.stages} stage(s), "
            f"{fitting.warps} warps"
        )
        spec = fitting
    return spec.name, spec, rule


def _candidates(family: str, problem: Problem) -> Iterator[tuple[str, VariantSpec | None, str]]:
    """A family's candidates in preference order: (label, spec or None, reason). A problem with a
    window or features takes the family's default variant with them (the tuned tables are measured
    on dense problems; a pack's feature variants are the defaults' (:mod:`cutefa.model.feature_sets`)),
    and so does a problem whose v has a head dim of its own (the tables hold none)."""
    probe = VariantSpec(
        family, "fwd", problem.dtype, problem.head_dim, 128, 64, 1, 4, mask=problem.mask, features=problem.features,
        head_dim_v=problem.head_dim_v,
    )  # fmt: skip
    missing = why_no_kernel(probe)
    if missing:
        yield family, None, missing
        return
    if not problem.local and problem.features == PACKED and not problem.separate_v:
        yield from _packed_table_candidate(family, problem)
    if problem.local or problem.features.any:
        label, spec, reason = _heuristic_candidate(family, problem)
        if spec is not None:
            asked = ["local window"] * problem.local + problem.features.tokens
            spec = problem.with_features(spec)
            reason = f"{reason}; with {' + '.join(asked)}"
            if problem.uneven:
                from cutefa.model.policy_sm90 import varlen_uneven

                lpt = varlen_uneven(spec)
                if lpt != spec:
                    spec = lpt
                    reason += f"; {_lpt_note(problem)}"
            label = spec.name
        yield label, spec, reason
        return
    from_table = None if problem.separate_v else _table_candidate(family, problem)
    if from_table:
        yield from_table
    yield _heuristic_candidate(family, problem)


def _packed_table_candidate(family: str, problem: Problem) -> Iterator[tuple[str, VariantSpec | None, str]]:
    """A packed batch's (varlen alone) candidate from the tuned table of its dense problem (max
    lengths as its lengths): the table's variant carried over by
    :func:`cutefa.model.policy_sm90.fwd_varlen_from_dense` (the LPT scheduler for an uneven batch).
    Nothing where the family has no such form or the table no usable entry: the family default with
    the varlen axis follows."""
    dense = replace(problem, features=NO_FEATURES, total_q=None)
    found = _table_candidate(family, dense)
    if found is None or found[1] is None:
        return
    from cutefa.model.policy_sm90 import fwd_varlen_from_dense

    spec = fwd_varlen_from_dense(found[1], problem.uneven)
    if spec is None:
        return
    how = _lpt_note(problem) if problem.uneven else "the plain grid"
    yield spec.name, spec, f"{found[2]}; its packed form (varlen, {how})"


def _lpt_note(problem: Problem) -> str:
    """Why an uneven packed batch runs the LPT scheduler."""
    from cutefa.model.policy_sm90 import UNEVEN_FILL

    return (
        f"the LPT scheduler: an uneven packed batch ({problem.total_q} query rows of {problem.batch} x "
        f"{problem.seqlen_q}, at most {UNEVEN_FILL:g} full)"
    )


def _search(problem: Problem) -> tuple[Choice | None, list[tuple[str, str]]]:
    """The first valid candidate over the families newest first, and every rejection before it."""
    check_target(problem.target, problem.gpu_name)
    runs = families_for_target(problem.target)
    rejected = [(f, f"family {f} does not run on {problem.target}") for f in reversed(ARCHS) if f not in runs]
    for family in runs:
        for label, spec, reason in _candidates(family, problem):
            why_not = reason if spec is None else why_invalid(spec) or why_not_on(spec, problem.target)
            if why_not is None:
                return Choice(spec, problem.target, reason, list(rejected)), rejected
            rejected.append((label, why_not))
    return None, rejected


_CHOICES: dict[tuple[Any, ...], Choice] = {}


def choose(
    *,
    target: str,
    dtype: Any,
    head_dim: int,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    heads_q: int,
    heads_kv: int,
    gpu_name: str | None = None,
    v_centered: bool = False,
    local: bool = False,
    features: Features = NO_FEATURES,
    head_dim_v: int | None = None,
    total_q: int | None = None,
) -> Choice:
    """Pick the variant for a problem; memoized per (target, GPU, dtype, head_dim, causal, seqlen_k
    bucket, v_centered, local, features, head_dim_v).

    ``dtype`` is a spec token ('bf16') or a torch dtype; ``gpu_name`` picks among tuned tables and
    names the GPU in errors; ``v_centered`` (fp8) says v was centered before quantization
    (:attr:`Problem.v_centered`); ``local`` a sliding window, ``features`` the call's feature axes
    (:class:`Problem`), ``head_dim_v`` v's head dim (None: ``head_dim``), ``total_q`` a varlen
    call's packed query rows (whether its batch is uneven is part of the memo's key). Raises
    ``NotImplementedError`` when no family has a kernel.
    """
    if v_centered is not False:
        _v_centered(v_centered, dtype)
    key = (target, gpu_name, dtype, head_dim, causal, seqlen_bucket(seqlen_k), v_centered, local, features)
    if head_dim_v is not None and head_dim_v != head_dim:
        key += (head_dim_v,)
    if features.varlen and _uneven(batch, seqlen_q, total_q):
        key += ("uneven",)
    choice = _CHOICES.get(key)
    if choice is None:
        since = _CLEARS
        p = Problem(target, _dtype_token(dtype), head_dim, causal, seqlen_q, seqlen_k, batch, heads_q, heads_kv,
                    gpu_name, v_centered, local, features, head_dim_v, total_q)  # fmt: skip
        choice, rejected = _search(p)
        if choice is None:
            lost = "; ".join(f"{label}: {why}" for label, why in rejected)
            raise NotImplementedError(f"no cutefa kernel for {p.describe()}: {lost}")
        with _LOCK:
            if since == _CLEARS:
                _CHOICES[key] = choice
    return choice


def explain_problem(
    *,
    target: str,
    dtype: Any,
    head_dim: int,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    heads_q: int,
    heads_kv: int,
    gpu_name: str | None = None,
    v_centered: bool = False,
    local: bool = False,
    features: Features = NO_FEATURES,
    score_mod: Any = None,
    mask_mod: Any = None,
    block_mask: Any = None,
    head_dim_v: int | None = None,
    total_q: int | None = None,
) -> str:
    """Human-readable account of :func:`choose` for a problem: the pick, why, and every rejection.
    With ``score_mod``/``mask_mod``/``block_mask`` (a call with user mods): the traced mods and the
    kernels they are fused into (:func:`cutefa.mods.explain.explain_mods`)."""
    p = Problem(target, _dtype_token(dtype), head_dim, causal, seqlen_q, seqlen_k, batch, heads_q, heads_kv,
                gpu_name, _v_centered(v_centered, dtype), local, features, head_dim_v, total_q)  # fmt: skip
    lines = [f"cutefa forward: {p.describe()}"]
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        from cutefa.mods.explain import explain_mods  # traces the mods: only a call with mods gets here

        return "\n".join(lines + explain_mods(p, score_mod, mask_mod, block_mask))
    try:
        choice, rejected = _search(p)
    except NotImplementedError as exc:
        return "\n".join([*lines, f"no kernel: {exc}"])
    if choice is None:
        lines.append("no kernel: every candidate was rejected")
    else:
        lines.append(f"chosen: {choice.spec.name} (family {choice.spec.arch}, compiled for {choice.target})")
        lines.append(f"  why: {choice.reason}")
        padded = padded_tile_note(choice.spec)
        if padded:
            lines.append(f"  {padded}")
    if p.separate_v:
        lines.append(_separate_v_backward(p))
    if rejected:
        lines.append("rejected:")
        lines += [f"  {label}: {why}" for label, why in rejected]
    return "\n".join(lines)


def _separate_v_backward(p: Problem) -> str:
    """:func:`explain_problem`'s line on the gradients of a problem whose v has a head dim of its
    own: the default backward of the first family on the target that takes the pair and the call's
    features (:data:`~cutefa.model.defaults.SEPARATE_V_BWD_FAMILIES`: the sm90 one on Hopper, the
    sm80 one elsewhere and for the calls the sm90 template does not take), or why there is none."""
    families = families_for_target(p.target)
    others = [f for f in families if f not in SEPARATE_V_BWD_FAMILIES]
    passed = [f"the {'/'.join(others)} backward takes one head dim for q, k and v"] if others else []
    for family in (f for f in families if f in SEPARATE_V_BWD_FAMILIES):
        spec = default_spec(family, "bwd", p.dtype, p.head_dim, causal=p.causal, head_dim_v=p.head_dim_v)
        if spec is None:
            passed.append(f"{family}: no backward for head_dim={p.head_dim}")
            continue
        spec = p.with_features(fitting_variant(spec, p.target) or spec)
        if spec.features.sinks:  # (the backward needs no kernel of its own for sinks)
            spec = spec.replace(features=replace(spec.features, sinks=False))
        why = why_invalid(spec) or why_not_on(spec, p.target)
        if why is None:
            return f"  backward: {spec.name} (family {'; '.join([family, *passed])})"
        passed.append(f"{spec.name}: {why}")
    if not passed:
        passed.append(f"no backward for head_dim={p.head_dim} with head_dim_v={p.head_dim_v}")
    return f"  backward: none ({'; '.join(passed)})"


# ---------------------------------------------------------------------------------------------
# Logging which kernel ran


_LOG_RUNS = False


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (it may be replaced after set-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_HANDLER: logging.Handler | None = None


def set_logging(enabled: bool) -> None:
    """Log one INFO line to stderr per kernel run (also enabled by ``CUTEFA_LOG=1`` at import)."""
    global _LOG_RUNS, _HANDLER
    _LOG_RUNS = enabled
    if enabled:
        log.setLevel(logging.INFO)
        if _HANDLER is None:
            _HANDLER = _StderrHandler()
            log.addHandler(_HANDLER)


def log_run(
    choice: Choice, q_shape: tuple[int, ...], k_shape: tuple[int, ...], causal: bool, extra: str = ""
) -> None:
    """Record one kernel run (a no-op unless logging is enabled); ``extra`` says more about the call
    (a varlen call's sequences, a window)."""
    if _LOG_RUNS:
        log.info(
            "cutefa: ran %s on %s for q=%s k=%s causal=%s%s",
            choice.spec.name, choice.target, tuple(q_shape), tuple(k_shape), causal, extra and f" {extra}",
        )  # fmt: skip


set_logging(os.environ.get("CUTEFA_LOG", "").strip() not in ("", "0"))
