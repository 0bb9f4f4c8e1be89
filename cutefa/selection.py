"""Which kernels a pack holds: a selection over the committed variants, or what one model needs.

``cutefa compile --pack DIR`` builds the variants dispatch can run on the target (the committed
set), narrowed by a :class:`Selection`: kernel family, direction, dtype, head dim, mask kind,
feature axes and a name glob. A selection that names a feature or mask kind no kernel implements
yet is an error that says so, never an empty pack.

``--for-model CONFIG`` reads a Hugging Face ``config.json`` (:func:`read_model_config`; a nested
``text_config`` wins over the top level) and selects what that model's attention needs on the
target (:func:`model_plan`): per direction, the newest family that has a kernel for its head dim
and dtype, and there the variants dispatch can pick (every entry of a tuned table for the target,
measured on any GPU) plus the family's default (what dispatch runs where no table has an entry).
Only the causal kernels are selected unless ``--mask`` says otherwise: a decoder's training and
prefill run causal, and so do its decode steps (one query row, aligned to the last key, sees the
whole cache); encoders and cross-attention need ``--mask none``. Both directions are selected
unless ``--direction fwd`` (inference only). The model's calls with features are selected too:
packed batches (the varlen call padded batches reach), its sliding window, logit softcap and
ALiBi, on the family's default (what dispatch runs for them). Needs no kernel covers yet (a head
dim without kernels, a V head dim that no kernel pairs with the Q/K one, a feature no template implements) each
get a note; the pack is built from what exists. ``final_logit_softcapping`` caps the LM head's logits,
not attention scores: it needs nothing here.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cutefa import tuned_tables
from cutefa.model.committed import default_variants
from cutefa.model.defaults import default_spec
from cutefa.model.feature_sets import feature_variants
from cutefa.model.options import Mask
from cutefa.model.rules import fitting_variant, why_invalid, why_not_on
from cutefa.model.spec import (
    ACCEPTED_HEAD_DIMS,
    ARCHS,
    DIRECTIONS,
    DTYPES,
    PACKED,
    TORCH_DTYPE_NAMES,
    Features,
    VariantSpec,
    accepted_head_dim,
    families_for_target,
    parse_name,
    why_not_head_dims,
)

# --feature names: the Features fields, by field name or by name token (paged_kv or paged).
FEATURES: dict[str, str] = {
    **{f.name: f.name for f in dataclasses.fields(Features)},
    **{f.metadata["token"]: f.name for f in dataclasses.fields(Features)},
}
MASKS: dict[str, Mask] = {mask.name.lower(): mask for mask in Mask}


class SelectionError(ValueError):
    """A selection that names something unknown, or that selects nothing."""


@dataclass(frozen=True)
class Selection:
    """What to keep of a set of variants; None (or empty) on an axis keeps every value."""

    families: tuple[str, ...] | None = None
    directions: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    masks: tuple[Mask, ...] | None = None
    features: tuple[str, ...] = ()  # Features field names every selected variant must have
    kernels: str | None = None  # a glob over variant names; the cutefa_ prefix is optional

    def __post_init__(self) -> None:
        for argument, values, accepted in (
            ("--family", self.families, ARCHS), ("--direction", self.directions, DIRECTIONS),
            ("--dtype", self.dtypes, DTYPES), ("--head-dim", self.head_dims, None),
            ("--mask", self.masks, tuple(Mask)), ("--feature", self.features, tuple(FEATURES.values())),
        ):  # fmt: skip
            for value in values or ():
                if accepted is not None and value not in accepted:
                    raise SelectionError(f"{argument} {value!r} is not one of {accepted}")
                if accepted is None and (not isinstance(value, int) or value <= 0):
                    raise SelectionError(f"{argument} {value!r} is not a positive head dim")

    def keeps(self, spec: VariantSpec) -> bool:
        """Whether ``spec`` passes every axis of the selection."""
        return (
            (not self.families or spec.arch in self.families)
            and (not self.directions or spec.direction in self.directions)
            and (not self.dtypes or spec.dtype in self.dtypes)
            and (not self.head_dims or spec.head_dim in self.head_dims)
            and (not self.masks or spec.mask in self.masks)
            and all(getattr(spec.features, name) for name in self.features)
            and (self.kernels is None or name_matches(spec.name, self.kernels))
        )

    def describe(self) -> str:
        """The selection as the command-line flags that make it."""
        axes = (
            ("--family", self.families), ("--direction", self.directions), ("--dtype", self.dtypes),
            ("--head-dim", self.head_dims), ("--mask", [m.name.lower() for m in self.masks or ()]),
            ("--feature", self.features),
        )  # fmt: skip
        parts = [f"{argument} {','.join(str(v) for v in values)}" for argument, values in axes if values]
        return " ".join(parts + ([f"--kernels {self.kernels}"] if self.kernels else [])) or "everything"


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` of a variant name, with the ``cutefa_`` prefix optional in ``pattern``."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"cutefa_{pattern}")


def unimplemented(selection: Selection, universe: Iterable[VariantSpec]) -> list[str]:
    """The features and mask kinds ``selection`` asks for that no variant of ``universe`` has, as
    "no kernel implements ... yet" sentences."""
    universe = list(universe)
    missing = [
        f"no kernel implements {name} yet"
        for name in selection.features
        if not any(getattr(spec.features, name) for spec in universe)
    ]
    missing += [
        f"no kernel implements the {mask.name.lower()} mask yet"
        for mask in selection.masks or ()
        if not any(spec.mask is mask for spec in universe)
    ]
    return missing


def select(specs: Sequence[VariantSpec], selection: Selection) -> list[VariantSpec]:
    """The variants of ``specs`` that ``selection`` keeps. Raises :class:`SelectionError` when it
    asks for a feature or mask kind that none of ``specs`` implements, or keeps none of them."""
    missing = unimplemented(selection, specs)
    if missing:
        raise SelectionError("; ".join(missing))
    chosen = [spec for spec in specs if selection.keeps(spec)]
    if not chosen:
        raise SelectionError(f"{selection.describe()} matches none of the {len(specs)} variants considered")
    return chosen


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


@dataclass(frozen=True)
class ModelAttention:
    """The attention facts of one model, as its ``config.json`` gives them."""

    source: str  # the file read, or the model type
    head_dim: int  # of q and k
    head_dim_v: int  # of v and the output
    heads: int
    kv_heads: int
    dtype: str | None  # cutefa's token for torch_dtype; None when the model's dtype has no kernels
    torch_dtype: str | None
    sliding_window: int | None  # None when no layer's window is shorter than the context
    softcap: float | None  # attn_logit_softcapping
    alibi: bool

    def describe(self) -> str:
        head = f"head_dim {self.head_dim}" + (
            f" (v {self.head_dim_v})" if self.head_dim_v != self.head_dim else ""
        )
        extras = [
            f"sliding_window {self.sliding_window}" if self.sliding_window else "",
            f"attention softcap {self.softcap}" if self.softcap else "",
            "ALiBi" if self.alibi else "",
        ]
        return ", ".join(
            [f"{self.source}: {head}", f"{self.heads} heads", f"{self.kv_heads} kv heads",
             f"torch_dtype {self.torch_dtype}", *filter(None, extras)]
        )  # fmt: skip


def _first(config: dict, *keys: str) -> object:
    return next((config[key] for key in keys if config.get(key) is not None), None)


def _positive(value: object, what: str, path: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SelectionError(f"--for-model {path}: {what} is {value!r}, not a positive integer")
    return value


def read_model_config(path: Path | str) -> ModelAttention:
    """Read a Hugging Face ``config.json``: head dim (``head_dim``, else ``hidden_size //
    num_attention_heads``; MLA's ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``),
    heads, kv heads (``num_key_value_heads``, default: the heads), ``torch_dtype`` (or ``dtype``),
    ``sliding_window`` (unless ``use_sliding_window`` is false, ``layer_types`` has no sliding
    layer or the window covers ``max_position_embeddings``), ``attn_logit_softcapping`` and ALiBi.
    A nested ``text_config`` (multimodal models) is read first. Raises :class:`SelectionError`
    naming the file and the field that is missing or wrong."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise SelectionError(f"--for-model {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SelectionError(f"--for-model {path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SelectionError(f"--for-model {path}: not a config.json object")
    text = raw.get("text_config")
    config = {**raw, **text} if isinstance(text, dict) else raw
    heads = _positive(
        _first(config, "num_attention_heads", "n_head", "num_heads"), "num_attention_heads", path
    )
    kv_heads = _positive(_first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv") or heads,
                         "num_key_value_heads", path)  # fmt: skip
    if heads % kv_heads:
        raise SelectionError(f"--for-model {path}: {heads} heads do not divide into {kv_heads} kv heads")
    if config.get("qk_nope_head_dim") is not None and config.get("qk_rope_head_dim") is not None:
        head_dim = _positive(
            config["qk_nope_head_dim"] + config["qk_rope_head_dim"], "qk_nope + qk_rope", path
        )
    elif config.get("head_dim") is not None:
        head_dim = _positive(config["head_dim"], "head_dim", path)
    else:
        hidden = _positive(_first(config, "hidden_size", "n_embd", "d_model"), "hidden_size", path)
        if hidden % heads:
            raise SelectionError(
                f"--for-model {path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, "
                "and there is no head_dim"
            )
        head_dim = hidden // heads
    head_dim_v = _positive(config.get("v_head_dim") or head_dim, "v_head_dim", path)
    torch_dtype = _first(config, "torch_dtype", "dtype")
    torch_dtype = str(torch_dtype).removeprefix("torch.") if torch_dtype is not None else None
    attn = config.get("attn_config") if isinstance(config.get("attn_config"), dict) else {}
    softcap = config.get("attn_logit_softcapping")
    return ModelAttention(
        source=str(path),
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        heads=heads,
        kv_heads=kv_heads,
        dtype=TORCH_DTYPE_NAMES.get(torch_dtype or ""),
        torch_dtype=torch_dtype,
        sliding_window=_binding_window(config),
        softcap=float(softcap) if softcap else None,
        alibi=bool(config.get("alibi") or attn.get("alibi") or config.get("model_type") == "bloom"),
    )


def _binding_window(config: dict) -> int | None:
    """The sliding window some layer attends within, or None where none is shorter than the context."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if config.get("use_sliding_window") is False:
        return None
    layers = config.get("layer_types")
    if isinstance(layers, list) and not any("sliding" in str(kind) for kind in layers):
        return None
    context = config.get("max_position_embeddings")
    if isinstance(context, int) and window >= context:
        return None
    return window


# ---------------------------------------------------------------------------------------------
# What a model needs on a target


@dataclass(frozen=True)
class ModelPlan:
    """The kernels selected for a model, and a note for each need no kernel covers yet."""

    model: ModelAttention
    specs: tuple[VariantSpec, ...]
    notes: tuple[str, ...]


def committed_for(target: str, families: Iterable[str] | None = None) -> list[VariantSpec]:
    """The committed variants of the families that run on ``target`` (or of ``families``), and their
    shipped feature variants (:func:`cutefa.model.feature_sets.feature_variants`), whose shared
    memory the target's GPUs hold."""
    names = families_for_target(target) if families is None else list(families)
    specs = [spec for family in names for spec in default_variants(family)]
    specs += [spec for family in names for d in DIRECTIONS for spec in feature_variants(family, d)]
    return [spec for spec in specs if why_not_on(spec, target) is None]


def _usable(spec: VariantSpec | None, target: str) -> bool:
    return (
        spec is not None and spec.runs_on(target) and (why_invalid(spec) or why_not_on(spec, target)) is None
    )


def _table_variants(
    family: str, direction: str, target: str, dtype: str, head_dim: int, causal: bool
) -> list[VariantSpec]:
    """Every variant a tuned table for ``target`` names for the problem (any GPU, any length)."""
    found = []
    for table in tuned_tables.tuned_tables():
        if (table.arch, table.direction, table.target) != (family, direction, target):
            continue
        for entry in table.entries:
            if (entry.dtype, entry.head_dim, entry.causal) == (dtype, head_dim, causal):
                try:
                    found.append(parse_name(entry.variant))
                except ValueError:  # dispatch refuses it too (and explain says why)
                    continue
    return found


def _default_variant(
    family: str, direction: str, target: str, dtype: str, head_dim: int, causal: bool,
    head_dim_v: int | None = None,
) -> VariantSpec | None:  # fmt: skip
    """The family's default for the problem (what dispatch runs where no tuned table has an entry;
    v of ``head_dim_v``, None: ``head_dim``), moved to the largest committed tile the target holds
    where the default does not fit."""
    spec = default_spec(family, direction, dtype, head_dim, causal=causal, head_dim_v=head_dim_v)
    return None if spec is None else fitting_variant(spec, target) or spec


def problem_variants(
    target: str, families: Sequence[str], direction: str, dtype: str, head_dim: int, causal: bool,
    head_dim_v: int | None = None,
) -> list[VariantSpec]:  # fmt: skip
    """The variants dispatch can run for a problem on ``target``: in the first of ``families``
    (newest first) that has any, its tuned-table entries and its default, each valid and held by
    the target's GPUs. v of ``head_dim_v`` apart from q/k's: the default alone (no tuned table
    measures such a pair; the first family whose default takes it, as dispatch picks it)."""
    separate_v = head_dim_v is not None and head_dim_v != head_dim
    for family in families:
        table = [] if separate_v else _table_variants(family, direction, target, dtype, head_dim, causal)
        found = [*table, _default_variant(family, direction, target, dtype, head_dim, causal, head_dim_v)]
        usable = list(dict.fromkeys(spec for spec in found if _usable(spec, target)))
        if usable:
            return usable
    return []


def model_plan(model: ModelAttention, target: str, selection: Selection = Selection()) -> ModelPlan:
    """The variants ``model`` needs on ``target``: for each direction, dtype and mask kind of the
    selection (defaults: both directions, the model's dtype, causal), :func:`problem_variants` over
    the selection's families (default: every family that runs there); then the selection's other
    axes (head dim, features, name glob) filter them. Raises :class:`SelectionError` when nothing is
    selectable; the notes say which of the model's needs no kernel covers yet."""
    families = [f for f in families_for_target(target) if not selection.families or f in selection.families]
    universe = committed_for(target, families)
    notes = _gaps(model, universe)
    dtypes = selection.dtypes or ((model.dtype,) if model.dtype else ("bf16",))
    if not selection.dtypes and model.dtype is None:
        notes.append(
            f"torch_dtype {model.torch_dtype}: cutefa's kernels take {', '.join(TORCH_DTYPE_NAMES)}; "
            "selecting bf16 (give --dtype to choose)"
        )
    masks = selection.masks or (Mask.CAUSAL,)
    missing = unimplemented(dataclasses.replace(selection, masks=masks, kernels=None), universe)
    if missing:
        raise SelectionError("; ".join(missing))
    found: dict[VariantSpec, None] = {}
    lacking = []
    for direction in selection.directions or DIRECTIONS:
        for dtype in dtypes:
            for mask in masks:
                got = problem_variants(
                    target, families, direction, dtype, model.head_dim, mask is Mask.CAUSAL, model.head_dim_v
                )
                found.update(dict.fromkeys(got))
                if not got:
                    lacking.append(f"{direction} {dtype} {mask.name.lower()}")
    found.update(dict.fromkeys(_model_feature_variants(model, target, families, selection, dtypes, masks)))
    if lacking and accepted_head_dim(model.head_dim):
        notes.append(
            f"no kernel on {target} ({'/'.join(families)}) for head_dim {model.head_dim}: {', '.join(lacking)}"
        )
    found = {spec: None for spec in found if spec.head_dim_v == model.head_dim_v}  # MLA: none yet
    specs = [spec for spec in found if selection.keeps(spec)]
    if not specs:
        why = (
            "; ".join(notes)
            if not found
            else f"{selection.describe()} keeps none of its {len(found)} kernels"
        )
        raise SelectionError(f"nothing to build for {model.source} on {target}: {why}")
    return ModelPlan(model, tuple(sorted(specs)), tuple(notes))


def _model_feature_variants(
    model: ModelAttention, target: str, families: Sequence[str], selection: Selection, dtypes: Sequence[str],
    masks: Sequence[Mask],
) -> list[VariantSpec]:  # fmt: skip
    """What dispatch runs for the model's calls with features: packed (padded) batches, its sliding
    window, softcap and ALiBi; per direction, the first family (newest first) whose default takes them."""
    extra = Features(softcap=bool(model.softcap), alibi=model.alibi)
    wanted = [(m, dataclasses.replace(extra, varlen=True)) for m in masks]
    if extra.any:
        wanted += [(m, extra) for m in masks]
    if model.sliding_window:
        wanted += [(Mask.LOCAL, extra), (Mask.LOCAL, dataclasses.replace(extra, varlen=True))]
    found = []
    separate_v = model.head_dim_v != model.head_dim  # (no tuned table measures such a pair)
    for direction in selection.directions or DIRECTIONS:
        for dtype in dtypes:
            for mask, features in wanted:
                for family in families:
                    causal = mask is Mask.CAUSAL
                    spec = _default_variant(
                        family, direction, target, dtype, model.head_dim, causal, model.head_dim_v
                    )
                    if spec is None:
                        continue
                    spec = spec.replace(mask=mask, features=features)
                    if _usable(spec, target):
                        found.append(spec)
                        if features == PACKED and mask is not Mask.LOCAL:
                            found += _packed_forms(spec, family, direction, target, dtype, model.head_dim, separate_v)
                        break
    return found


def _packed_forms(
    default: VariantSpec, family: str, direction: str, target: str, dtype: str, head_dim: int, separate_v: bool
) -> list[VariantSpec]:  # fmt: skip
    """What dispatch runs for a packed batch with nothing else besides ``default`` (the family
    default with the varlen axis): its LPT form for an uneven batch
    (:func:`cutefa.model.policy_sm90.varlen_uneven`), and the packed forms (even and uneven batch)
    of the problem's tuned-table variants (:func:`cutefa.model.policy_sm90.fwd_varlen_from_dense`;
    none where v has a head dim of its own: no table measures such a pair)."""
    from cutefa.model.policy_sm90 import fwd_varlen_forms, varlen_uneven

    found = [varlen_uneven(default)]
    causal = default.mask is Mask.CAUSAL
    tables = [] if separate_v else _table_variants(family, direction, target, dtype, head_dim, causal)
    found += [spec for dense in tables for spec in fwd_varlen_forms(dense)]
    return [spec for spec in found if _usable(spec, target) and spec != default]


def _gaps(model: ModelAttention, universe: Sequence[VariantSpec]) -> list[str]:
    """A note for each need of ``model`` that no variant of ``universe`` covers."""
    notes = []
    if not accepted_head_dim(model.head_dim):
        notes.append(f"head_dim {model.head_dim}: no kernel covers it (cutefa takes {ACCEPTED_HEAD_DIMS})")
    pair = why_not_head_dims(model.head_dim, model.head_dim_v) if accepted_head_dim(model.head_dim) else None
    if model.head_dim_v != model.head_dim and pair is not None:
        which = f"v head dim {model.head_dim_v} != q/k head dim {model.head_dim}"
        notes.append(f"{which}: no kernel implements it ({pair})")
    if model.sliding_window and not any(s.mask is Mask.LOCAL for s in universe):
        notes.append(
            f"sliding_window {model.sliding_window}: no kernel implements the local (sliding-window) mask "
            "yet; the pack holds full-attention kernels, which attend past the window on longer sequences"
        )
    if model.softcap and not any(s.features.softcap for s in universe):
        notes.append(f"attn_logit_softcapping {model.softcap}: no kernel implements softcap yet")
    if model.alibi and not any(s.features.alibi for s in universe):
        notes.append("ALiBi: no kernel implements alibi yet")
    return notes
