"""The committed set: exactly the variants dispatch can run, which ``cutefa generate`` writes to
generated/ and a pack ships.

Dispatch chooses a variant in these ways, and the set holds each one's picks:

- the default of each family, direction, dtype and head dim (:func:`cutefa.model.defaults.default_config`),
  causal and not: the heuristic where no tuned table has an entry;
- the tiles that take its place on GPUs whose shared memory does not hold it
  (:func:`cutefa.model.defaults.small_smem_configs`, found by :func:`cutefa.model.rules.fitting_variant`);
- every variant a committed tuned table names (``cutefa/tuned/*.json``: the forward's and the
  backward's entries, those for centered v included);
- the e4m3 block-quantization forward of each default (:func:`fp8_block_specs`), which the fp8
  call runs for block descales;
- the backward of each (head_dim, head_dim_v) pair of :data:`~cutefa.model.spec.HEAD_DIM_V_PAIRS` in
  the families that take it (:data:`~cutefa.model.defaults.SEPARATE_V_BWD_FAMILIES`, their defaults:
  :func:`separate_v_bwd_specs`), which the backward of such a call runs.

Measured alternatives are not here: they render on demand, and their lists live with the tools
that measure them (tools/alternatives.py). tests/test_committed.py checks that every choice
dispatch makes is in this set.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from cutefa.identity import TUNED_DIR
from cutefa.model.defaults import (
    FP8_FAMILIES,
    SEPARATE_V_BWD_FAMILIES,
    candidate_grid,
    default_config,
    default_spec,
    small_smem_configs,
)
from cutefa.model.options import Mask, Quant, options_class
from cutefa.model.spec import (
    ARCHS,
    COMMITTED_HEAD_DIMS,
    DIRECTIONS,
    DTYPES,
    HEAD_DIM_V_PAIRS,
    HEAD_DIMS,
    VariantSpec,
    parse_name,
)

MASKS = (Mask.NONE, Mask.CAUSAL)

# Families whose e4m3 forward takes block descales (its option record has a quantization granularity).
BLOCK_QUANT_FAMILIES = tuple(
    arch
    for arch in FP8_FAMILIES
    if "quant" in {f.name for f in dataclasses.fields(options_class(arch, "fwd", "e4m3"))}
)


def _check(argument: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"{argument}={value!r} is not one of {accepted}")


def fp8_block_specs(arch: str = "sm90") -> list[VariantSpec]:
    """The committed e4m3 block-quantization forwards of ``arch``: the e4m3 default tile and options
    of each head dim with ``quant=Quant.BLOCK``, causal and not (none where the family has no block
    quantization)."""
    if arch not in BLOCK_QUANT_FAMILIES:
        return []
    specs = []
    for hd in HEAD_DIMS:
        config = default_config(arch, "fwd", "e4m3", hd)
        if config is not None:
            block = dataclasses.replace(config, options=config.options.replace(quant=Quant.BLOCK))
            specs += [block.spec(arch, "fwd", "e4m3", hd, mask=mask) for mask in MASKS]
    return sorted(specs)


def separate_v_bwd_specs(arch: str) -> list[VariantSpec]:
    """The committed backwards of ``arch`` with a V head dim of its own: the default of each pair of
    :data:`~cutefa.model.spec.HEAD_DIM_V_PAIRS` (the tile of its Q/K head dim), each 16-bit dtype,
    causal and not, where ``arch`` takes the pairs (:data:`~cutefa.model.defaults.SEPARATE_V_BWD_FAMILIES`)."""
    if arch not in SEPARATE_V_BWD_FAMILIES:
        return []
    specs = (
        default_spec(arch, "bwd", dtype, hd, causal=mask is Mask.CAUSAL, head_dim_v=hd_v)
        for dtype in DTYPES
        for hd, hd_v in HEAD_DIM_V_PAIRS
        for mask in MASKS
    )
    return sorted(spec for spec in specs if spec is not None)


def tuned_variants(tuned_dir: Path = TUNED_DIR) -> list[VariantSpec]:
    """Every variant the tuned tables in ``tuned_dir`` name (``entries[].variant``). Raises
    ValueError naming the table for a name that does not parse."""
    specs = set()
    for path in sorted(Path(tuned_dir).glob("*.json")):
        for entry in json.loads(path.read_text())["entries"]:
            try:
                specs.add(parse_name(entry["variant"]))
            except ValueError as exc:
                raise ValueError(f"tuned table {path.name}: {exc}") from None
    return sorted(specs)


@functools.cache
def _committed() -> tuple[VariantSpec, ...]:
    specs: set[VariantSpec] = set()
    for arch in ARCHS:
        for direction in DIRECTIONS:
            for dtype in DTYPES:
                for hd in COMMITTED_HEAD_DIMS:
                    default = default_config(arch, direction, dtype, hd)
                    configs = ((default,) if default else ()) + small_smem_configs(arch, direction, dtype, hd)
                    specs |= {c.spec(arch, direction, dtype, hd, mask=m) for c in configs for m in MASKS}
        specs |= set(fp8_block_specs(arch))
        specs |= set(separate_v_bwd_specs(arch))
    specs |= set(tuned_variants())
    return tuple(sorted(specs))


def default_variants(arch: str, direction: str | None = None) -> list[VariantSpec]:
    """The committed variants of ``arch`` (both directions unless one is named), sorted."""
    _check("arch", arch, ARCHS)
    if direction is not None:
        _check("direction", direction, DIRECTIONS)
    return [s for s in _committed() if s.arch == arch and direction in (None, s.direction)]


def candidates(arch: str, direction: str = "fwd") -> list[VariantSpec]:
    """The candidate grid of ``arch``'s ``direction`` kernel (:func:`cutefa.model.defaults.candidate_grid`,
    valid or not) plus the committed variants off it."""
    grid = candidate_grid(arch, direction)
    known = set(grid)
    return grid + [s for s in default_variants(arch, direction) if s not in known]
