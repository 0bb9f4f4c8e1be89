"""The feature variants a pack ships: each family's default variants with the masks and feature
axes that model families use.

Dispatch runs a call with a window or features on the family's default variant with them
(:func:`cutefa.dispatch._candidates`; the tuned tables are measured on dense problems), and a
packed batch with nothing else on the packed form of its dense problem's tuned-table variant where
the family has one (:func:`cutefa.model.policy_sm90.fwd_varlen_from_dense`), so these are derived,
not committed: they are rendered on demand (generated/ holds the dense set) and a pack
takes them by selection (``cutefa compile --feature varlen``, ``--for-model``). Any other
combination compiles on first use like any variant outside a pack.
"""

from __future__ import annotations

import dataclasses

from cutefa.model.defaults import default_config
from cutefa.model.options import Mask
from cutefa.model.policy_sm90 import fwd_varlen_forms, varlen_uneven
from cutefa.model.rules import why_invalid
from cutefa.model.spec import DTYPES, HEAD_DIMS, Features, VariantSpec, parse_name

_NONE = Features()

# (mask, features) pairs: packed batches; sliding windows (Mistral, Phi-3); softcap with and
# without a window (Gemma 2); sinks with and without a window (gpt-oss); ALiBi (BLOOM, MPT); each
# also packed (padded batches reach the kernels through the varlen call).
_MODEL_SETS: tuple[tuple[tuple[Mask, ...], Features], ...] = (
    ((Mask.NONE, Mask.CAUSAL), _NONE),
    ((Mask.LOCAL,), _NONE),
    ((Mask.CAUSAL, Mask.LOCAL), Features(softcap=True)),
    ((Mask.CAUSAL, Mask.LOCAL), Features(sinks=True)),
    ((Mask.NONE, Mask.CAUSAL), Features(alibi=True)),
)


def feature_sets(direction: str) -> tuple[tuple[Mask, Features], ...]:
    """The (mask, features) pairs shipped for ``direction``, dense itself excluded. A backward needs
    no sinks axis (the lse carries them), so its sets drop it (and those that become dense)."""
    pairs: list[tuple[Mask, Features]] = []
    for masks, features in _MODEL_SETS:
        for packed in (features, dataclasses.replace(features, varlen=True)):
            if direction == "bwd":
                packed = dataclasses.replace(packed, sinks=False)
            for mask in masks:
                pair = (mask, packed)
                if (mask is Mask.LOCAL or packed.any) and pair not in pairs:
                    pairs.append(pair)
    return tuple(pairs)


def feature_variants(arch: str, direction: str) -> list[VariantSpec]:
    """The shipped feature variants of ``arch``'s ``direction``: its defaults (every dtype and head
    dim) with each of :func:`feature_sets`, where the family's template implements them, and the
    packed forms an uneven batch runs instead (:func:`cutefa.model.policy_sm90.varlen_uneven`)."""
    specs = set()
    for dtype in DTYPES:
        for hd in HEAD_DIMS:
            config = default_config(arch, direction, dtype, hd)
            if config is None:
                continue
            for mask, features in feature_sets(direction):
                spec = config.spec(arch, direction, dtype, hd, mask=mask).replace(features=features)
                if why_invalid(spec) is None:
                    specs.add(spec)
                    uneven = varlen_uneven(spec)  # what an uneven packed batch runs instead
                    if why_invalid(uneven) is None:
                        specs.add(uneven)
    specs.update(packed_table_variants(arch, direction))
    return sorted(specs)


def packed_table_variants(arch: str, direction: str) -> list[VariantSpec]:
    """The packed forms (even and uneven batch) of every variant a committed tuned table of
    ``arch``'s ``direction`` names, where the family has them: what dispatch runs for a packed
    batch whose dense problem has a table entry."""
    from cutefa.tuned_tables import tuned_tables  # (the tables are read on first use)

    found = set()
    for table in tuned_tables():
        if (table.arch, table.direction) != (arch, direction):
            continue
        for entry in table.entries:
            try:
                dense = parse_name(entry.variant)
            except ValueError:  # dispatch refuses it too (and explain says why)
                continue
            found.update(spec for spec in fwd_varlen_forms(dense) if why_invalid(spec) is None)
    return sorted(found)
