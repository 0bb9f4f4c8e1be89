"""The sm90 backward's read-ahead of LSE2 and D (row_prefetch, name token _rpf) on this CPU.

Each query block's LSE2 (for P^T = exp2(S^T scale - LSE2)) and D (for dS^T = P^T (dP^T - D)) sit in
shared memory, staged one block ahead. Without the flag a thread reads its query columns' values
right after the WGMMA wait that precedes their use, so the loads' latency follows the wait; with
it the values are read into registers before the wait. Checked here: the flag's name and rule, the
committed variants (beside their _dqw twins), and the SASS: no spill, the twin's WGMMAs and
waits, the consumers within 240 registers, and 64-bit shared loads issued between the S^T/dP^T
WGMMAs and the first wait of the query loop.

Correctness on hardware: tests/gpu/test_bwd_sm90.py (every committed variant against the float32
reference) and tests/gpu/test_bwd_dqbulk_gpu.py (bitwise equal to the twin, deterministic mode).
"""

from __future__ import annotations

import re

import pytest

from cutefa import codegen, sass, space
from cutefa.spec import VariantSpec, parse_name

RPF = [s for s in space.default_variants("sm90", "bwd") if s.row_prefetch]
# one per tile: hd128 64x128 causal with the overlap schedule, hd64 128x128 non-causal
CHECKED = [s for s in RPF if (s.head_dim, s.causal, s.overlap) in ((128, True, True), (64, False, False))]


def _twin(spec: VariantSpec) -> VariantSpec:
    return spec.replace(row_prefetch=False)


def test_flag_name_and_rule():
    spec = VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, dq_bulk=True, dq_warp=True, row_prefetch=True)
    assert spec.name == "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_dqbulk_dqw_rpf"
    assert parse_name(spec.name) == spec
    assert space.why_invalid(spec) is None
    assert space.why_invalid(spec.replace(dq_warp=False, dq_bulk=False)) is None  # independent of the dQ path
    assert codegen.template_name(spec) == "bwd_sm90.py.j2"
    assert "sm90 backward" in space.why_invalid(VariantSpec("sm80", "bwd", "bf16", 128, 64, 128, 1, 8, row_prefetch=True))
    assert "sm90 backward" in space.why_invalid(VariantSpec("sm90", "fwd", "bf16", 128, 128, 128, 2, 12, row_prefetch=True))
    for other in (
        VariantSpec("sm90", "bwd", "bf16", 192, 64, 64, 2, 12, row_prefetch=True),
        VariantSpec("sm90", "bwd", "bf16", 192, 64, 96, 2, 12, row_prefetch=True),
        VariantSpec("sm90", "bwd", "bf16", 128, 80, 128, 2, 12, dq_bulk=True, row_prefetch=True),
    ):
        assert "row_prefetch" in space.why_invalid(other), other.name
        assert space.why_invalid(other.replace(row_prefetch=False)) is None, other.name


def test_variants_committed():
    assert {s.dtype for s in RPF} == {"bf16"}
    assert sorted((s.head_dim, s.tile_m, s.overlap, s.causal) for s in RPF) == sorted(
        [(64, 128, False, c) for c in (False, True)] + [(128, 64, ov, c) for ov in (False, True) for c in (False, True)]
    )
    committed = set(space.default_variants("sm90", "bwd"))
    for spec in RPF:
        assert spec.dq_warp and _twin(spec) in committed
        assert space.sm90_bwd_smem_bytes(spec) == space.sm90_bwd_smem_bytes(_twin(spec))


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    specs = CHECKED + [_twin(s) for s in CHECKED]
    return sass.dump_cubins(specs, "sm_90a", tmp_path_factory.mktemp("bwd_rowprefetch_sm_90a"))


def _first_wait_window(text: str) -> list[str]:
    """The consumer instructions between the last HGMMA before the query loop's first
    ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` and that wait."""
    lines = [line for line in text.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    wait = next(i for i, line in enumerate(lines) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line)
    last_mma = max(i for i in range(wait) if "HGMMA" in lines[i])
    return lines[last_mma + 1 : wait]


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_loads_before_the_wait(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    twin = sass.analyze(cubins[_twin(spec).name])
    text = sass.kernel_text(sass.disassemble(cubins[spec.name]), "kernel")
    twin_text = sass.kernel_text(sass.disassemble(cubins[_twin(spec).name]), "kernel")
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.counts["HGMMA"] == twin.counts["HGMMA"], (report.summary(), twin.summary())
    assert len(re.findall(r"WARPGROUP\.DEPBAR", text)) == len(re.findall(r"WARPGROUP\.DEPBAR", twin_text))
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == [24, 240], regions
    assert all(used < budget for budget, used in regions), regions
    # a thread's query columns come in pairs: one 64-bit load per pair of LSE2 values, issued
    # while S^T and dP^T run; the twin issues none there
    columns = spec.tile_m // 8  # S^T is m64nN with N = tile_m queries: N / 8 column pairs a thread
    window = _first_wait_window(text)
    loads = [line for line in window if re.search(r"\bLDS\.64\b", line)]
    assert len(loads) == columns, (len(loads), window)
    assert not [line for line in _first_wait_window(twin_text) if re.search(r"\bLDS", line)]
