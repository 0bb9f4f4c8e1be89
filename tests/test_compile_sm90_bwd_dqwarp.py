"""The sm90 backward's dQ-writer warp (DqPath.BULK_WARP, name tokens _dqbulk_dqw) on this CPU.

On the bulk path (DqPath.BULK) each consumer warpgroup stages its fp32 dQ piece in shared memory;
with the writer warp it then only arrives on its "dQ full" named barrier, and warp 1 of the producer
warpgroup issues the
bulk reduce-add (SASS ``UBLKRED``), waits until the copy has read the buffer (deterministic: until
it is complete) and arrives on the consumer's "dQ empty" barrier, which the consumer syncs on before
it writes the buffer again. Checked here: the name, rule and shared memory (the DqPath.BULK
twin's: one staging buffer); the committed variants (bf16 hd64/hd128 on the tuned table's tiles,
with and without the overlap schedule at hd128); and the SASS of one variant per tile: the WGMMAs,
their waits and the consumers' registers are the twin's, every UBLKRED is in the producer
warpgroup's code (under its 24-register setmaxnreg) and none in the consumers', and the named
barriers are the ones the design says.

Also the read-ahead of LSE2 and D on the same tiles (row_prefetch, name token _rpf): each query
block's LSE2 (for P^T = exp2(S^T scale - LSE2)) and D (for dS^T = P^T (dP^T - D)) sit in shared
memory; without the option a thread reads its query columns' values right after the WGMMA wait that
precedes their use, with it into registers ahead of it (LSE2 before the S^T/dP^T WGMMAs are issued,
D before the wait for dP^T). Checked: name, rule, the committed variants beside their _dqw twins,
and the SASS (the twin's WGMMAs, waits and budgets, and 64-bit shared loads ahead of the query
loop's first WGMMA).

Correctness on hardware: tests/gpu/test_bwd_sm90.py (every committed variant) and
tests/gpu/test_bwd_dqbulk_gpu.py (the writer warp and row_prefetch sections).
"""

from __future__ import annotations

import re

import pytest
from cpu_support import all_variants, assert_not_an_option

from cutefa import codegen, sass
from cutefa.model.budgets import bwd_dq_accum_shape
from cutefa.model.budgets_sm90 import (
    SM90_SMEM_LIMIT,
    sm90_bwd_dq_pieces,
    sm90_bwd_registers,
    sm90_bwd_smem_bytes,
)
from cutefa.model.options import DqPath
from cutefa.model.rules import why_invalid
from cutefa.model.spec import VariantSpec, parse_name

DQW = [
    s
    for s in all_variants("sm90", "bwd")
    if s.options.dq_path is DqPath.BULK_WARP and not s.options.row_prefetch
]
# hd128 64x128 (a column split of dQ) causal with the overlap schedule; hd64 128x128 (a row split)
# non-causal with the default schedule: (head dim, causal, overlap).
TILES = ((128, True, True), (64, False, False))
CHECKED = [s for s in DQW if s.dtype == "bf16" and (s.head_dim, s.causal, s.options.overlap) in TILES]

# named barrier ids (templates/bwd_sm90.py.j2): consumer c's "dQ full" 4 + c, "dQ empty" 6 + c;
# the bulk path's per-consumer staging barriers 2 and 3; 0xa0 = 160 threads (a warpgroup and a warp)
FULL, EMPTY, BULK = (4, 5), (6, 7), (2, 3)


def _twin(spec: VariantSpec, **change: object) -> VariantSpec:
    """``spec`` with ``change`` (by default the bulk path without the writer warp, DqPath.BULK): the
    variant it is measured and checked against."""
    return spec.replace(**(change or {"dq_path": DqPath.BULK}))


def test_flag_name_rule_and_budget():
    spec = VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, overlap=True, dq_path=DqPath.BULK_WARP)
    assert spec.name == "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_ov_dqbulk_dqw"
    assert parse_name(spec.name) == spec
    assert why_invalid(spec) is None
    # the same single staging buffer as the DqPath.BULK twin: no extra shared memory, same registers
    for s in DQW:
        assert sm90_bwd_smem_bytes(s) == sm90_bwd_smem_bytes(_twin(s)) <= SM90_SMEM_LIMIT
        assert sm90_bwd_registers(s) == sm90_bwd_registers(_twin(s))
        assert bwd_dq_accum_shape(s, 2, 1, 1000, 3) == bwd_dq_accum_shape(_twin(s), 2, 1, 1000, 3)
        assert codegen.template_name(s) == "bwd_sm90.py.j2"
    assert why_invalid(_twin(spec, dq_path=DqPath.RED)) is None
    assert_not_an_option("sm80", "bwd", "bf16", dq_path=DqPath.BULK_WARP)
    # the head-dim split, the swapped-dK/dV partition and the transposed-dQ tile are not built
    for other in (
        VariantSpec("sm90", "bwd", "bf16", 192, 64, 64, 2, 12, dq_path=DqPath.BULK_WARP),
        VariantSpec("sm90", "bwd", "bf16", 192, 64, 96, 2, 12, dq_path=DqPath.BULK_WARP),
        VariantSpec("sm90", "bwd", "bf16", 128, 80, 128, 2, 12, dq_path=DqPath.BULK_WARP),
    ):
        assert "dq_path=BULK_WARP" in why_invalid(other), other.name
        assert why_invalid(_twin(other)) is None, other.name


def test_variants_committed():
    """bf16 and fp16 (tools/alternatives.py SM90_FP16_BWD_ALTERNATIVES), on the tuned table's tiles:
    hd64 128x128 and
    hd128 64x128, with and without the overlap schedule; causal and not; each beside its committed
    DqPath.BULK twin."""
    assert {s.dtype for s in DQW} == {"bf16", "fp16"}
    for dtype in ("bf16", "fp16"):
        found = [(s.head_dim, s.tile_m, s.options.overlap, s.causal) for s in DQW if s.dtype == dtype]
        assert sorted(found) == sorted(
            [(64, 128, ov, c) for ov in (False, True) for c in (False, True)]
            + [(128, 64, ov, c) for ov in (False, True) for c in (False, True)]
        )
    variants = set(all_variants("sm90", "bwd"))
    for spec in DQW:
        assert spec.name.endswith("_dqbulk_dqw")
        assert _twin(spec) in variants


RPF = [s for s in all_variants("sm90", "bwd") if s.options.row_prefetch]
RPF_CHECKED = [s for s in RPF if s.dtype == "bf16" and (s.head_dim, s.causal, s.options.overlap) in TILES]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    specs = CHECKED + [_twin(s) for s in CHECKED] + RPF_CHECKED  # (an _rpf variant's twin is in CHECKED)
    return sass.dump_cubins(specs, "sm_90a", tmp_path_factory.mktemp("bwd_dqwarp_sm_90a"))


def _against_twin(cubins, spec: VariantSpec, twin: VariantSpec) -> tuple[str, str]:
    """What an option on these tiles keeps of its twin's SASS: no spill, the same WGMMAs and WGMMA
    waits (nothing serialized), the producer under 24 and the consumers under 240 registers.
    Returns the main kernel's text of both."""
    report, twin_report = sass.analyze(cubins[spec.name]), sass.analyze(cubins[twin.name])
    text = sass.kernel_text(sass.disassemble(cubins[spec.name]), "kernel")
    twin_text = sass.kernel_text(sass.disassemble(cubins[twin.name]), "kernel")
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.counts["HGMMA"] == twin_report.counts["HGMMA"], (report.summary(), twin_report.summary())
    waits = len(re.findall(r"WARPGROUP\.DEPBAR", text))
    assert waits == len(re.findall(r"WARPGROUP\.DEPBAR", twin_text)) and waits <= 8, waits
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == [24, 240], regions
    for budget, used in regions:
        assert used < budget, f"{spec.name}: R{used} under setmaxnreg {budget}"
    return text, twin_text


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
    text, twin_text = _against_twin(cubins, spec, _twin(spec))
    # the consumers' budget and register peak are the twin's (to within ptxas's allocation noise:
    # the causal launch order's remap before the roles split moves peaks by a register or two)
    regions, twin_regions = sass.setmaxnreg_regions(text), sass.setmaxnreg_regions(twin_text)
    assert regions[1][0] == twin_regions[1][0] and abs(regions[1][1] - twin_regions[1][1]) <= 4, (regions, twin_regions)
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
    # empty" before staging and once after the loop; the bulk path's staging barriers are gone
    assert _bars(consumers, "ARV") == [(b, 160) for b in FULL]
    syncs = _bars(consumers, "SYNC")
    assert [s for s in syncs if s[0] in EMPTY] == sorted([(b, 160) for b in EMPTY] * 2), syncs
    assert not [s for s in syncs if s[0] in BULK], syncs
    assert [s for s in _bars(_roles(twin_text)[1], "SYNC") if s[0] in BULK] == [(b, 128) for b in BULK]
    # the consumers still stage their piece with 16-byte stores (cols / 8 per thread and consumer)
    stores = len(re.findall(r"\bSTS\.128\b", consumers))
    assert stores >= sum(cols // 8 for _, _, cols in sm90_bwd_dq_pieces(spec)), stores
    # the consumers carry no bulk-group wait: the writer's (read, and completion when deterministic)
    assert not re.search(r"\bDEPBAR\.LE\s+SB0", consumers)
    assert re.search(r"\bDEPBAR\.LE\s+SB0,\s*0x1", producer) and re.search(r"\bDEPBAR\.LE\s+SB0,\s*0x0", producer)


# --- row_prefetch (_rpf) on the same tiles -----------------------------------------------------


def test_rpf_flag_name_and_rule():
    spec = VariantSpec(
        "sm90", "bwd", "bf16", 128, 64, 128, 2, 12, dq_path=DqPath.BULK_WARP, row_prefetch=True
    )
    assert spec.name == "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_dqbulk_dqw_rpf"
    assert parse_name(spec.name) == spec
    assert why_invalid(spec) is None
    assert why_invalid(spec.replace(dq_path=DqPath.RED)) is None  # independent of the dQ path
    assert codegen.template_name(spec) == "bwd_sm90.py.j2"
    assert_not_an_option("sm80", "bwd", "bf16", row_prefetch=True)
    assert_not_an_option("sm90", "fwd", "bf16", row_prefetch=True)
    for other in (
        VariantSpec("sm90", "bwd", "bf16", 192, 64, 64, 2, 12, row_prefetch=True),
        VariantSpec("sm90", "bwd", "bf16", 192, 64, 96, 2, 12, row_prefetch=True),
        VariantSpec("sm90", "bwd", "bf16", 128, 80, 128, 2, 12, dq_path=DqPath.BULK, row_prefetch=True),
    ):
        assert "row_prefetch" in why_invalid(other), other.name
        assert why_invalid(_twin(other, row_prefetch=False)) is None, other.name


def test_rpf_variants_committed():
    """bf16 and fp16 (tools/alternatives.py SM90_FP16_BWD_ALTERNATIVES), on the dQ-writer warp's tiles,
    with and
    without the overlap schedule."""
    assert {s.dtype for s in RPF} == {"bf16", "fp16"}
    for dtype in ("bf16", "fp16"):
        found = [(s.head_dim, s.tile_m, s.options.overlap, s.causal) for s in RPF if s.dtype == dtype]
        assert sorted(found) == sorted(
            [(64, 128, ov, c) for ov in (False, True) for c in (False, True)]
            + [(128, 64, ov, c) for ov in (False, True) for c in (False, True)]
        )
    variants = set(all_variants("sm90", "bwd"))
    for spec in RPF:
        assert spec.options.dq_path is DqPath.BULK_WARP and _twin(spec, row_prefetch=False) in variants
        assert sm90_bwd_smem_bytes(spec) == sm90_bwd_smem_bytes(_twin(spec, row_prefetch=False))


def _before_first_gemm(text: str, count: int = 48) -> list[str]:
    """The ``count`` instructions before the query loop's first HGMMA (the S^T issue), where the
    loop top waits for the Q/dO stage."""
    lines = [line for line in text.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    first_mma = next(i for i, line in enumerate(lines) if "HGMMA" in line)
    return lines[max(first_mma - count, 0) : first_mma]


@pytest.mark.compile
@pytest.mark.parametrize("spec", RPF_CHECKED, ids=lambda s: s.name)
def test_sass_rpf_loads_before_the_wait(cubins, spec):
    text, twin_text = _against_twin(cubins, spec, _twin(spec, row_prefetch=False))
    # a thread's query columns come in pairs: one 64-bit load per pair of LSE2 values, issued
    # before the S^T/dP^T WGMMAs (whose operand reads would otherwise queue ahead of them); the
    # twin reads LSE2 only after the wait for S^T
    columns = spec.tile_m // 8  # S^T is m64nN with N = tile_m queries: N / 8 column pairs a thread
    window = _before_first_gemm(text)
    loads = [line for line in window if re.search(r"\bLDS\.64\b", line)]
    assert len(loads) == columns, (len(loads), window)
    assert not [line for line in _before_first_gemm(twin_text) if re.search(r"\bLDS", line)]
