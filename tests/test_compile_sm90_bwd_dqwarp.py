"""The sm90 backward's dQ-writer warp (dq_warp, name token _dqw) on this CPU.

With dq_bulk, each consumer warpgroup stages its fp32 dQ piece in shared memory; with dq_warp it
then only arrives on its "dQ full" named barrier, and warp 1 of the producer warpgroup issues the
bulk reduce-add (SASS ``UBLKRED``), waits until the copy has read the buffer (deterministic: until
it is complete) and arrives on the consumer's "dQ empty" barrier, which the consumer syncs on before
it writes the buffer again. Checked here: the flag's name, rule and shared memory (the dq_bulk
twin's: one staging buffer); the committed variants (bf16 hd64/hd128 on the tuned table's tiles,
with and without the overlap schedule at hd128); and the SASS of one variant per tile: the WGMMAs,
their waits and the consumers' registers are the twin's, every UBLKRED is in the producer
warpgroup's code (under its 24-register setmaxnreg) and none in the consumers', and the named
barriers are the ones the design says.

Correctness on hardware: tests/gpu/test_bwd_sm90.py (every committed variant) and
tests/gpu/test_bwd_dqbulk_gpu.py (the dq_warp section).
"""

from __future__ import annotations

import re

import pytest

from cutefa import codegen, sass, space
from cutefa.spec import VariantSpec, parse_name

DQW = [s for s in space.default_variants("sm90", "bwd") if s.dq_warp and not s.row_prefetch]
# hd128 64x128 (a column split of dQ) causal with the overlap schedule; hd64 128x128 (a row split)
# non-causal with the default schedule.
CHECKED = [s for s in DQW if (s.head_dim, s.causal, s.overlap) in ((128, True, True), (64, False, False))]

# named barrier ids (templates/bwd_sm90.py.j2): consumer c's "dQ full" 4 + c, "dQ empty" 6 + c;
# dq_bulk's per-consumer staging barriers 2 and 3; 0xa0 = 160 threads (a warpgroup and a warp)
FULL, EMPTY, BULK = (4, 5), (6, 7), (2, 3)


def _twin(spec: VariantSpec) -> VariantSpec:
    return spec.replace(dq_warp=False)


def test_flag_name_rule_and_budget():
    spec = VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, overlap=True, dq_bulk=True, dq_warp=True)
    assert spec.name == "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_ov_dqbulk_dqw"
    assert parse_name(spec.name) == spec
    assert space.why_invalid(spec) is None
    # the same single staging buffer as the dq_bulk twin: no extra shared memory, same registers
    for s in DQW:
        assert space.sm90_bwd_smem_bytes(s) == space.sm90_bwd_smem_bytes(_twin(s)) <= space.SM90_SMEM_LIMIT
        assert space.sm90_bwd_registers(s) == space.sm90_bwd_registers(_twin(s))
        assert space.sm90_bwd_dq_accum_shape(s, 2, 1, 1000, 3) == space.sm90_bwd_dq_accum_shape(_twin(s), 2, 1, 1000, 3)
        assert codegen.template_name(s) == "bwd_sm90.py.j2"
    assert "dq_bulk" in space.why_invalid(spec.replace(dq_bulk=False))
    assert "sm90 backward" in space.why_invalid(VariantSpec("sm80", "bwd", "bf16", 128, 64, 128, 1, 8, dq_warp=True))
    # the head-dim split, the swapped-dK/dV partition and the transposed-dQ tile are not built
    for other in (
        VariantSpec("sm90", "bwd", "bf16", 192, 64, 64, 2, 12, dq_bulk=True, dq_warp=True),
        VariantSpec("sm90", "bwd", "bf16", 192, 64, 96, 2, 12, dq_bulk=True, dq_warp=True),
        VariantSpec("sm90", "bwd", "bf16", 128, 80, 128, 2, 12, dq_bulk=True, dq_warp=True),
    ):
        assert "dq_warp" in space.why_invalid(other), other.name
        assert space.why_invalid(other.replace(dq_warp=False)) is None, other.name


def test_variants_committed():
    """bf16 only, on the tuned table's tiles: hd64 128x128 (dq_bulk), hd128 64x128 with and without
    the overlap schedule; causal and not; each beside its committed dq_bulk twin."""
    assert {s.dtype for s in DQW} == {"bf16"}
    assert sorted((s.head_dim, s.tile_m, s.overlap, s.causal) for s in DQW) == sorted(
        [(64, 128, False, c) for c in (False, True)] + [(128, 64, ov, c) for ov in (False, True) for c in (False, True)]
    )
    committed = set(space.default_variants("sm90", "bwd"))
    for spec in DQW:
        assert spec.name.endswith("_dqbulk_dqw") and spec.dq_bulk
        assert _twin(spec) in committed


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    specs = CHECKED + [_twin(s) for s in CHECKED]
    return sass.dump_cubins(specs, "sm_90a", tmp_path_factory.mktemp("bwd_dqwarp_sm_90a"))


def _roles(text: str) -> tuple[str, str]:
    """The main kernel's producer code (from its setmaxnreg down to 24) and consumer code (from
    its setmaxnreg up to 240)."""
    lines = text.splitlines()
    marks = [i for i, line in enumerate(lines) if "USETMAXREG" in line]
    assert len(marks) == 2, f"{len(marks)} USETMAXREG"
    assert "DEALLOC" in lines[marks[0]] and "ALLOC" in lines[marks[1]]
    return "\n".join(lines[marks[0] : marks[1]]), "\n".join(lines[marks[1] :])


def _bars(text: str, kind: str) -> list[tuple[int, int]]:
    """(barrier id, thread count) of each named-barrier instruction of ``kind`` (SYNC or ARV)."""
    pattern = r"\bBAR\.SYNC(?:\.DEFER_BLOCKING)?\s+(0x[0-9a-f]+|\d+),\s*(0x[0-9a-f]+|\d+)" if kind == "SYNC" else (
        r"\bBAR\.ARV\s+(0x[0-9a-f]+|\d+),\s*(0x[0-9a-f]+|\d+)"
    )
    return sorted((int(a, 0), int(b, 0)) for a, b in re.findall(pattern, text))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_writer_warp(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    twin = sass.analyze(cubins[_twin(spec).name])
    text = sass.kernel_text(sass.disassemble(cubins[spec.name]), "kernel")
    twin_text = sass.kernel_text(sass.disassemble(cubins[_twin(spec).name]), "kernel")
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    # the WGMMAs and their waits are the twin's (nothing serialized)
    assert report.counts["HGMMA"] == twin.counts["HGMMA"], (report.summary(), twin.summary())
    waits = len(re.findall(r"WARPGROUP\.DEPBAR", text))
    assert waits == len(re.findall(r"WARPGROUP\.DEPBAR", twin_text)) and waits <= 8, waits
    # the roles: the producer under 24 registers, the consumers under 240 with the twin's peak
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == [24, 240], regions
    for budget, used in regions:
        assert used < budget, f"{spec.name}: R{used} under setmaxnreg {budget}"
    assert regions[1] == sass.setmaxnreg_regions(twin_text)[1], (regions, sass.setmaxnreg_regions(twin_text))
    producer, consumers = _roles(text)
    # every bulk reduce-add is the writer warp's: one per consumer's piece, fp32 add
    assert sass.opcode_forms(producer).get("UBLKRED.G.S.ADD.F32.RN", 0) == 2, sass.opcode_forms(producer)
    assert "UBLKRED" not in consumers
    assert "UBLKRED" in _roles(twin_text)[1]  # the twin's consumers issue them
    # the writer: syncs on each "dQ full" once per block; arrives on each "dQ empty" once before
    # its loop and once per block; 160 threads each
    assert _bars(producer, "SYNC") == [(b, 160) for b in FULL]
    assert _bars(producer, "ARV") == sorted([(b, 160) for b in EMPTY] * 2)
    # the consumers (one code path per consumer): arrive on their "dQ full"; sync on their "dQ
    # empty" before staging and once after the loop; dq_bulk's staging barriers are gone
    assert _bars(consumers, "ARV") == [(b, 160) for b in FULL]
    syncs = _bars(consumers, "SYNC")
    assert [s for s in syncs if s[0] in EMPTY] == sorted([(b, 160) for b in EMPTY] * 2), syncs
    assert not [s for s in syncs if s[0] in BULK], syncs
    assert [s for s in _bars(_roles(twin_text)[1], "SYNC") if s[0] in BULK] == [(b, 128) for b in BULK]
    # the consumers still stage their piece with 16-byte stores (cols / 8 per thread and consumer)
    stores = len(re.findall(r"\bSTS\.128\b", consumers))
    assert stores >= sum(cols // 8 for _, _, cols in space.sm90_bwd_dq_pieces(spec)), stores
    # the consumers carry no bulk-group wait: the writer's (read, and completion when deterministic)
    assert not re.search(r"\bDEPBAR\.LE\s+SB0", consumers)
    assert re.search(r"\bDEPBAR\.LE\s+SB0,\s*0x1", producer) and re.search(r"\bDEPBAR\.LE\s+SB0,\s*0x0", producer)
