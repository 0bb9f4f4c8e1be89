"""TRANSITION ONLY: the boolean spec flags of the old model, read from and written to the option
records. Removed once no caller uses the old flag names.
"""

from __future__ import annotations

from cutefa.model.options import (
    DqLayout,
    DqPath,
    OAccum,
    Options,
    Quant,
    RowSum,
    Schedule,
    Scheduler,
    VTranspose,
    options_class,
)

LEGACY_FLAGS = (
    "overlap", "pingpong", "persistent", "early_rescale", "pair_cvt", "cta_pair", "block_quant", "dq_bulk",
    "dq_warp", "row_prefetch", "dq_stage", "lpt_grid", "dq_quad", "hoist_vt", "wide_vt", "lazy_rescale",
    "dq_tile", "dq_pipe", "sum_mma", "two_level", "v_mean",
)  # fmt: skip


def read_flag(options: Options, flag: str) -> bool:
    """The old boolean ``flag`` of a spec whose options are ``options``."""
    schedule = getattr(options, "schedule", Schedule.SERIAL)
    scheduler = getattr(options, "scheduler", Scheduler.GRID)
    dq_path = getattr(options, "dq_path", DqPath.RED)
    layout = getattr(options, "dq_layout", DqLayout.ROWS)
    vt = getattr(options, "v_transpose", VTranspose.INDEXED)
    derived = {
        "overlap": schedule.overlap or getattr(options, "overlap", False),
        "pingpong": schedule.pingpong,
        "persistent": scheduler is Scheduler.PERSISTENT,
        "lpt_grid": scheduler is Scheduler.LPT,
        "block_quant": getattr(options, "quant", Quant.TENSOR) is Quant.BLOCK,
        "dq_bulk": dq_path is not DqPath.RED,
        "dq_warp": dq_path is DqPath.BULK_WARP,
        "dq_stage": dq_path is DqPath.BULK_STAGED,
        "dq_quad": layout is DqLayout.QUAD,
        "dq_tile": layout is DqLayout.TILE,
        "hoist_vt": vt is not VTranspose.INDEXED,
        "wide_vt": vt is VTranspose.WIDE,
        "sum_mma": getattr(options, "row_sum", RowSum.FADD) is RowSum.MMA,
        "two_level": getattr(options, "o_accum", OAccum.ONE_LEVEL) is OAccum.TWO_LEVEL,
    }
    if flag in derived:
        return derived[flag]
    return bool(getattr(options, flag, False))


def option_fields(arch: str, direction: str, dtype: str, flags: dict[str, object]) -> dict[str, object]:
    """Option-record fields equal to the old ``flags`` (plus ``exp_emu``) of an (arch, direction,
    dtype). Raises ValueError for a flag the family's record cannot hold."""
    cls = options_class(arch, direction, dtype)
    fields: dict[str, object] = {}
    on = {k for k, v in flags.items() if v and k != "exp_emu"}
    if flags.get("exp_emu"):
        fields["exp_emu"] = flags["exp_emu"]
    names = set(cls.__dataclass_fields__)
    if "schedule" in names:
        fields["schedule"] = {
            (False, False): Schedule.SERIAL, (True, False): Schedule.OVERLAP,
            (False, True): Schedule.PINGPONG, (True, True): Schedule.OVERLAP_PINGPONG,
        }[("overlap" in on, "pingpong" in on)]  # fmt: skip
        on -= {"overlap", "pingpong"}
    if "scheduler" in names:
        if {"persistent", "lpt_grid"} <= on:
            raise ValueError("lpt_grid with persistent: the persistent scheduler walks the tiles longest-first already")
        fields["scheduler"] = (
            Scheduler.PERSISTENT if "persistent" in on else Scheduler.LPT if "lpt_grid" in on else Scheduler.GRID
        )
        on -= {"persistent", "lpt_grid"}
    if "quant" in names and "block_quant" in on:
        fields["quant"] = Quant.BLOCK
        on.discard("block_quant")
    if "v_transpose" in names:
        if "wide_vt" in on and "hoist_vt" not in on:
            raise ValueError("wide_vt requires hoist_vt")
        fields["v_transpose"] = (
            VTranspose.WIDE if "wide_vt" in on else VTranspose.HOISTED if "hoist_vt" in on else VTranspose.INDEXED
        )
        on -= {"hoist_vt", "wide_vt"}
    if "row_sum" in names and "sum_mma" in on:
        fields["row_sum"] = RowSum.MMA
        on.discard("sum_mma")
    if "o_accum" in names and "two_level" in on:
        fields["o_accum"] = OAccum.TWO_LEVEL
        on.discard("two_level")
    if "dq_path" in names:
        bulk = "dq_bulk" in on
        if ("dq_warp" in on or "dq_stage" in on) and not bulk:
            raise ValueError("dq_warp / dq_stage need dq_bulk")
        if {"dq_warp", "dq_stage"} <= on:
            raise ValueError("dq_stage with dq_warp: the swapped backward has no dQ-writer warp")
        fields["dq_path"] = (
            DqPath.BULK_WARP if "dq_warp" in on else DqPath.BULK_STAGED if "dq_stage" in on
            else DqPath.BULK if bulk else DqPath.RED
        )  # fmt: skip
        on -= {"dq_bulk", "dq_warp", "dq_stage"}
    if "dq_layout" in names:
        if {"dq_quad", "dq_tile"} <= on:
            raise ValueError("dq_tile with dq_quad: the two are different layouts of the same dQ accumulator")
        fields["dq_layout"] = DqLayout.QUAD if "dq_quad" in on else DqLayout.TILE if "dq_tile" in on else DqLayout.ROWS
        on -= {"dq_quad", "dq_tile"}
    for flag in sorted(on):
        if flag not in names:
            raise ValueError(f"{flag} is not an option of the {arch} {direction} {dtype} family ({cls.__name__})")
        fields[flag] = True
    return fields
