"""The sm90 forward's causal mask as a flag (branch_mask, name token _bmask): a committed causal
two-consumer forward compiled with the older branch-per-score mask next to its select-mask twin.
Both compile for sm_90a with no spill and the same WGMMAs; the _bmask kernel's masked blocks are the
branch form (the DSL lowers each dynamic ``if`` into a region yielding the whole fragment: far more
selects, no bit masks to predicates), and its unmasked loop holds as many instructions as the twin's
(the two differ in how ptxas orders it, which is what the flag is for)."""

from __future__ import annotations

import re

import pytest

from cutefa import sass, space
from cutefa.spec import parse_name

pytestmark = pytest.mark.compile

BMASK = parse_name("cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_causal_ov_pp_bmask")
SELECT = BMASK.replace(branch_mask=False)

_FUNCTION = re.compile(r"^\s+Function : (\S+)")
_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins([BMASK, SELECT], "sm_90a", tmp_path_factory.mktemp("sm_90a_bmask"))


def _main_kernel(cubin) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of the function with the most HGMMA instructions."""
    functions: dict[str, list[tuple[int, str, str]]] = {}
    current = None
    for line in sass.disassemble(cubin).splitlines():
        if m := _FUNCTION.match(line):
            current = functions.setdefault(m.group(1), [])
        elif (m := _INSN.match(line)) and current is not None:
            current.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return max(functions.values(), key=lambda insns: sum(op.startswith("HGMMA") for _, op, _ in insns))


def _hgmma_loops(insns: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """Bodies of the innermost back-branch loops holding HGMMAs, in address order (the forward's
    masked loop, then its unmasked loop)."""
    spans = []
    for addr, op, rest in insns:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            if any(op.startswith("HGMMA") and start <= a <= addr for a, op, _ in insns):
                spans.append((start, addr))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [[i for i in insns if lo <= i[0] <= hi] for lo, hi in sorted(inner)]


def _selects(report: sass.SassReport) -> int:
    return sum(report.forms_of("FSEL").values()) + sum(report.forms_of("SEL").values())


def test_admitted_and_committed():
    committed = set(space.default_variants("sm90", "fwd"))
    assert BMASK in committed and SELECT in committed
    assert space.why_invalid(BMASK) is None
    assert "causal=False" in space.why_invalid(BMASK.replace(causal=False))


@pytest.mark.parametrize("spec", [BMASK, SELECT], ids=lambda s: s.name)
def test_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    assert report.missing("sm90") == [], report.summary()
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.counts["USETMAXREG"] >= 2 and report.counts["MUFU.EX2"] > 0, report.summary()
    consumer = [r for r in sass.setmaxnreg_regions(sass.disassemble(cubins[spec.name])) if r[0] == 240]
    assert consumer and all(highest < 240 for _, highest in consumer), consumer
    # S = Q K^T (8 WGMMAs) and O += P V (8) in the masked and the unmasked loop, plus the overlap
    # schedule's prologue S and epilogue P V
    per_block = spec.head_dim // 16 + spec.tile_n // 16
    assert report.counts["HGMMA"] == 3 * per_block, report.summary()
    assert report.counts["BAR.SYNC"] > 2, report.summary()  # ping-pong hand-over


def test_branch_mask_form(cubins):
    branch = sass.analyze(cubins[BMASK.name])
    select = sass.analyze(cubins[SELECT.name])
    # the select form: one select per masked score from bit masks moved to predicates (R2P); the
    # branch form: no bit masks, and a region per score that re-selects the fragment
    assert sum(select.forms_of("R2P").values()) > 0
    assert sum(branch.forms_of("R2P").values()) == 0
    assert _selects(branch) > 8 * _selects(select), (_selects(branch), _selects(select))
    loops = {s.name: _hgmma_loops(_main_kernel(cubins[s.name])) for s in (BMASK, SELECT)}
    for name, found in loops.items():
        assert len(found) == 2, f"{name}: {[len(b) for b in found]} (masked and unmasked loops expected)"
        for body in found:
            assert sum(op.startswith("HGMMA") for _, op, _ in body) == 2 * (128 // 16), name
    (masked_b, unmasked_b), (masked_s, unmasked_s) = loops[BMASK.name], loops[SELECT.name]
    assert len(masked_b) > 2 * len(masked_s)  # the branch form's diagonal blocks are dearer
    # the unmasked loops: the same work, within a few instructions (the order is ptxas's)
    assert abs(len(unmasked_b) - len(unmasked_s)) <= 4, (len(unmasked_b), len(unmasked_s))
