"""The jinja context (cutefa.templating): each family's switches and no other family's, templates that
read those switches (never an option flag through the spec) and hold no arithmetic, and generated
modules that define no constant nothing reads."""

from __future__ import annotations

import ast
import json
import re

import jinja2
import pytest

from cutefa import codegen, templating
from cutefa.model.options import DqLayout, DqPath, Mask, Quant, Schedule, Scheduler, VTranspose
from cutefa.model.spec import Features, VariantSpec, parse_name

# The switches each family's templates see (every family also has causal, from the mask).
SWITCHES = {
    "Sm80FwdOptions": {"causal"},
    "Sm80BwdOptions": {"causal", "dq_quad", "dq_tile", "dq_pipe"},
    "Sm90FwdOptions": {
        "causal", "overlap", "pingpong", "persistent", "lpt_grid", "hfirst_grid", "early_rescale", "pair_cvt",
        "lazy_rescale", "exp_emu",
    },
    "Sm90Fp8FwdOptions": {
        "causal", "overlap", "pingpong", "persistent", "block_quant", "hoist_vt", "wide_vt", "lazy_rescale",
        "sum_mma", "two_level", "v_mean", "exp_emu",
    },
    "Sm90BwdOptions": {"causal", "overlap", "dq_bulk", "dq_warp", "dq_stage", "row_prefetch"},
    "Sm100FwdOptions": {"causal", "cta_pair", "exp_emu"},
    "Sm100BwdOptions": {"causal"},
}  # fmt: skip
ALL_SWITCHES = set().union(*SWITCHES.values())
# Every family's context has the mask and feature-axis switches.
FEATURE_SWITCHES = {"local", "varlen", "paged_kv", "split_kv", "softcap", "alibi", "sinks"}
# The boolean flags of the old one-record spec (and exp_emu, causal): templates read switches instead.
OLD_FLAGS = (
    "overlap", "pingpong", "persistent", "early_rescale", "pair_cvt", "cta_pair", "block_quant", "dq_bulk",
    "dq_warp", "row_prefetch", "dq_stage", "lpt_grid", "dq_quad", "hoist_vt", "wide_vt", "lazy_rescale",
    "dq_tile", "dq_pipe", "sum_mma", "two_level", "v_mean", "exp_emu", "causal",
)  # fmt: skip
TEMPLATES = sorted(codegen.TEMPLATES_DIR.glob("*.j2"))
COMMITTED = [
    parse_name(entry["name"])
    for entry in json.loads((codegen.GENERATED_DIR / codegen.MANIFEST_NAME).read_text(encoding="utf-8"))
]
# Module constants read from outside the module: by cutefa.compile, and by the tests that check
# register splits (tests/test_register_pool.py) and the sm100 e4m3 P shift (tests/gpu/test_fp8_sm100.py).
READ_ELSEWHERE = {
    "SPEC_NAME", "PTXAS_OPTIONS", "THREADS", "PRODUCER_REGS", "CONSUMER_REGS", "REG_SOFTMAX", "REG_CORRECTION",
    "REG_OTHER", "WARP_CORRECTION", "P_SHIFT_LOG2", "RESCALE_THRESHOLD",
}  # fmt: skip


def _context(spec: VariantSpec) -> dict:
    return templating.template_context(spec, codegen.template_name(spec))


def test_the_committed_set_covers_every_family():
    assert {type(s.options).__name__ for s in COMMITTED} == set(SWITCHES)


def test_every_committed_context_has_exactly_its_family_switches():
    for spec in COMMITTED:
        context = _context(spec)
        assert set(context) & ALL_SWITCHES == SWITCHES[type(spec.options).__name__], spec.name
        assert context["spec"] is spec and context["name"] == spec.name
        assert context["causal"] == spec.causal


def test_switches_follow_the_option_record():
    sm90 = VariantSpec(
        "sm90",
        "fwd",
        "bf16",
        128,
        128,
        128,
        2,
        12,
        schedule=Schedule.OVERLAP_PINGPONG,
        scheduler=Scheduler.LPT,
    )
    assert templating.switches(sm90) == {
        "causal": False, "local": False, "varlen": False, "paged_kv": False, "split_kv": False,
        "softcap": False, "alibi": False, "sinks": False, "overlap": True, "pingpong": True,
        "persistent": False, "lpt_grid": True, "hfirst_grid": False, "early_rescale": False, "pair_cvt": False,
        "lazy_rescale": False, "exp_emu": 0,
    }  # fmt: skip
    windowed = sm90.replace(mask=Mask.LOCAL, features=Features(varlen=True, sinks=True))
    on = {k for k, v in templating.switches(windowed).items() if v is True}
    assert on >= {"local", "varlen", "sinks"} and not on & {"causal", "softcap", "alibi", "paged_kv", "split_kv"}
    persistent = templating.switches(sm90.replace(schedule=Schedule.PINGPONG, scheduler=Scheduler.PERSISTENT))
    assert (persistent["overlap"], persistent["pingpong"], persistent["persistent"], persistent["lpt_grid"]) == (
        False, True, True, False,
    )  # fmt: skip
    fp8 = VariantSpec(
        "sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, v_transpose=VTranspose.WIDE, quant=Quant.BLOCK
    )
    assert {k for k, v in templating.switches(fp8).items() if v} == {"hoist_vt", "wide_vt", "block_quant"}
    assert templating.switches(fp8.replace(v_transpose=VTranspose.HOISTED))["wide_vt"] is False
    bwd = VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, causal=True, dq_path=DqPath.BULK_WARP)
    assert {k for k, v in templating.switches(bwd).items() if v} == {"causal", "dq_bulk", "dq_warp"}
    sm80 = VariantSpec("sm80", "bwd", "bf16", 128, 64, 64, 1, 8, dq_layout=DqLayout.TILE, dq_pipe=True)
    assert {k: v for k, v in templating.switches(sm80).items() if k not in FEATURE_SWITCHES} == {
        "causal": False, "dq_quad": False, "dq_tile": True, "dq_pipe": True,
    }  # fmt: skip


def test_a_template_cannot_read_another_familys_switch(tmp_path):
    (tmp_path / "fwd_sm90.py.j2").write_text("X = {{ dq_bulk }}\n")
    spec = VariantSpec("sm90", "fwd", "bf16", 128, 128, 128, 2, 12, schedule=Schedule.OVERLAP_PINGPONG)
    with pytest.raises(jinja2.UndefinedError, match="dq_bulk"):
        codegen.render_source(spec, templates_dir=tmp_path)
    (tmp_path / "fwd_sm90.py.j2").write_text("X = {{ pingpong }}\n")
    assert codegen.render_source(spec, templates_dir=tmp_path).endswith("X = True\n")


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_templates_read_no_option_flag_through_the_spec(path):
    flags = "|".join(OLD_FLAGS)
    used = re.findall(rf"\bspec\.({flags})\b", path.read_text(encoding="utf-8"))
    assert used == [], f"{path.name} reads {sorted(set(used))} through spec: read the switches"


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_templates_hold_no_arithmetic(path):
    """Numbers and choices come from cutefa.templating; a tag only tests, indexes, loops and formats."""
    text = path.read_text(encoding="utf-8")
    offenders = []
    for tag in re.findall(r"\{\{.*?\}\}|\{%.*?%\}", text, flags=re.DOTALL):
        body = re.sub(r"^\{[{%]-?|-?[}%]\}$", "", tag)
        body = re.sub(r'"[^"]*"|\'[^\']*\'', '""', body)  # string literals are formatting
        if re.search(r"[-+*/%]", body):
            offenders.append(tag)
    assert offenders == [], f"{path.name}: arithmetic in {offenders}"


def test_generated_modules_define_no_unread_constant():
    for spec in COMMITTED:
        tree = ast.parse(codegen.module_path(spec).read_text(encoding="utf-8"))
        loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        defined = {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name) and target.id.isupper()
        }
        assert defined - loaded - READ_ELSEWHERE == set(), spec.name
