"""The default sm90 fp8 (e4m3) forward variants (and the measured alternatives of
tools/alternatives.py: a sample, cpu_support.compile_sample, every one with
CUTEFA_FULL_COMPILE_TESTS=1) compile on this CPU for sm_90a, and their SASS shows the design: e4m3
WGMMA (QGMMA, e.g. ``QGMMA.64x128x32.F32.E4M3.E4M3``) for both products, TMA loads (UTMALDG),
setmaxnreg (USETMAXREG), mbarrier pipelines (SYNCS), the on-chip V transpose (32-bit LDS/STS and
PRMT byte permutes), P converted to e4m3 (F2FP.SATFINITE.E4M3); no 16-bit
HGMMA and no local-memory spills. The block-quantization variants (_blockq) keep their twins'
MMAs, exp2 count and conversions and add one 16-byte load of the key tile's scales per step."""

from __future__ import annotations

import re

import pytest
from cpu_support import all_variants, compile_sample, load_tool, skipped_fmuls, step_loop

from cutefa import codegen, sass
from cutefa.kernels.sm90 import fp8, fp8_transpose, fp8_two_level, fp8_wide_transpose
from cutefa.model.budgets_sm90 import sm90_fp8_consumer_regs, sm90_fp8_producer_regs
from cutefa.model.options import OAccum, Quant, RowSum, Schedule, Scheduler, VTranspose

pytestmark = pytest.mark.compile

FP8_ALTERNATIVES = load_tool("alternatives").fp8_alternative_specs("sm90")
FP8_DEFAULTS = [
    s
    for s in all_variants("sm90", "fwd")
    if s.dtype == "e4m3" and s not in FP8_ALTERNATIVES and s.options.quant is Quant.TENSOR
]
# One per head dim, causal and not alternating: every head dim's tile and both mask paths.
CHECKED = [
    next(s for s in FP8_DEFAULTS if s.head_dim == hd and s.causal == bool(i % 2))
    for i, hd in enumerate(sorted({s.head_dim for s in FP8_DEFAULTS}))
]


def _budgets(spec) -> list[int]:
    """The setmaxnreg budgets (producer, consumers) of an fp8 forward: 40 and 232, or 24 and 240
    where the tile needs the registers and the hoisted 32-bit transpose lets the producer give
    them up, 32 and 160 with three consumers (sm90_fp8_producer_regs,
    sm90_fp8_consumer_regs)."""
    return [sm90_fp8_producer_regs(spec), sm90_fp8_consumer_regs(spec)]


# Most R2UR moves of any committed e4m3 kernel (each has 3-42: the persistent ones ~40). Where ptxas
# gives up the uniform datapath (descriptors and pipeline state in regular registers) there are
# 150-290 and hundreds more instructions (sm90_fp8_ptxas_options).
MAX_R2UR = 64


def _assert_uniform_datapath(report, summary):
    r2ur = sum(n for form, n in report.forms.items() if form.split(".")[0] == "R2UR")
    assert r2ur <= MAX_R2UR, f"{summary}: {r2ur} R2UR (uniform datapath given up?)"


def _assert_split_fits(report, spec):
    """The CTA launches with the kernel's register count per thread (168 x 384 with two consumers,
    128 x 512 with three); the setmaxnreg budgets of one producer and the consumer warpgroups must
    add up to no more than that, or the consumers' increase waits forever
    (tests/test_register_pool.py)."""
    producer, consumers = _budgets(spec)
    need = 128 * producer + (spec.threads - 128) * consumers
    assert need <= report.registers * spec.threads, (spec.name, report.registers)


def test_every_head_dim_has_an_fp8_default():
    assert {s.head_dim for s in FP8_DEFAULTS} == {64, 96, 128, 192, 256}
    assert {s.causal for s in FP8_DEFAULTS} == {False, True}
    for s in FP8_DEFAULTS:  # hd128: overlap alone
        expected = Schedule.OVERLAP if s.head_dim == 128 else Schedule.OVERLAP_PINGPONG
        assert s.options.schedule is expected, s.name


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("sm_90a_fp8"))


@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    summary = f"{spec.name}: {report.summary()}"
    _assert_uniform_datapath(report, summary)
    assert report.missing("sm90", "e4m3") == [], summary
    assert report.spills == 0, summary
    assert report.counts["HGMMA"] == 0, summary  # every WGMMA takes e4m3 operands
    assert report.counts["USETMAXREG"] >= 2, summary
    assert report.counts["MUFU.EX2"] > 0, summary
    # S = Q K^T: head_dim/32 QGMMAs per key block, O += P Vt: tile_n/32; one body per loop (masked,
    # unmasked) plus the overlap schedule's prologue S and epilogue P V.
    per_block = spec.head_dim // fp8.MMA_K + spec.tile_n // fp8.MMA_K
    assert report.counts["QGMMA"] == 3 * per_block, summary
    # The transpose: 4 word loads, 8 PRMT and 4 word stores per unit (the loop body once).
    assert report.counts["PRMT"] >= 8, summary
    assert report.counts["LDS"] >= 4 and report.counts["STS"] >= 4, summary
    if spec.options.schedule.pingpong:
        assert report.counts["BAR.SYNC"] > 2, summary  # ping-pong hand-over between the consumers
    # Code after each setmaxnreg stays within its budget: the producer warpgroup (transpose
    # included) within 40 (or 24) registers, the consumers within 232 (or 240; _budgets; code order:
    # producer branch first).
    regions = sass.setmaxnreg_regions(sass.disassemble(cubins[spec.name]))
    assert [budget for budget, _ in regions] == _budgets(spec), regions
    assert all(used < budget for budget, used in regions), regions
    _assert_split_fits(report, spec)


def _run_dsl_probe(script, body: str) -> str:
    """Run ``body`` (the lines of a ``@cute.jit`` function ``probe`` that prints what it checks,
    compiled for sm_90a) as the file ``script`` in a fresh interpreter with this checkout's cutefa
    first on the path (the DSL compiles functions from their source file); its stdout."""
    code = (
        "import os; os.environ['CUTE_DSL_ARCH'] = 'sm_90a'\n"
        "import cutlass, cutlass.cute as cute\n"
        "from cutefa.kernels.sm90 import fp8\n"
        "@cute.jit\n"
        "def probe():\n" + body + "probe()\n"
    )
    import os
    import subprocess
    import sys
    from pathlib import Path

    script.write_text(code)
    root = str(Path(fp8.__file__).resolve().parents[3])  # this checkout's cutefa, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_register_fragment_layouts_match_the_dsl(tmp_path):
    """The layout check in tests/test_fp8_layout.py models the fp8 WGMMA's register layouts; they
    must be the ones the DSL's atom uses."""
    code = (
        "    print('A', fp8.pv_tiled_mma(128).tv_layout_A)\n"
        "    print('C', fp8.qk_tiled_mma(128).tv_layout_C)\n"
    )
    out = _run_dsl_probe(tmp_path / "probe_layouts.py", code)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line[:2] in ("A ", "C "))
    assert lines["A"] == fp8.TV_LAYOUT_A_FP8
    assert lines["C"] == fp8.TV_LAYOUT_C_N128


def test_alternatives_render():
    """The alternatives are not in generated/: each renders on demand (the compile cache's module)."""
    assert FP8_ALTERNATIVES and set(FP8_ALTERNATIVES) <= set(all_variants("sm90", "fwd"))
    for spec in FP8_ALTERNATIVES:
        assert f'SPEC_NAME = "{spec.name}"' in codegen.render_source(spec), spec.name


# (the alternative_cubins fixture, at the end of this module, compiles the alternatives of this
# sample and those the checks of single options below read)
@pytest.mark.parametrize("spec", compile_sample(FP8_ALTERNATIVES), ids=lambda s: s.name)
def test_alternative_sass(alternative_cubins, spec):
    """The e4m3 alternatives (other tiles, stages, schedules, exp_emu): QGMMA only, no
    spill, each setmaxnreg region within its budget, the exp2 split as exp_emu asks."""
    text = sass.disassemble(alternative_cubins[spec.name])
    report = sass.analyze(alternative_cubins[spec.name])
    summary = f"{spec.name}: {report.summary()}"
    _assert_uniform_datapath(report, summary)
    assert report.missing("sm90", "e4m3") == [], summary
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0, summary
    assert report.counts["HGMMA"] == 0, summary
    per_block = spec.head_dim // fp8.MMA_K + spec.tile_n // fp8.MMA_K
    # two loop bodies (masked, unmasked); the overlap schedule adds its prologue S and epilogue P V;
    # RowSum.MMA a P x ones product beside each P V (the loop bodies' and the epilogue's)
    options = spec.options
    sum_mma = options.row_sum is RowSum.MMA
    sums = 3 * spec.tile_n // fp8.MMA_K if sum_mma else 0
    assert report.counts["QGMMA"] == (3 if options.schedule.overlap else 2) * per_block + sums, summary
    assert f"QGMMA.64x{spec.tile_n}x32.F32.E4M3.E4M3" in text, summary
    if options.schedule.pingpong:
        assert report.counts["BAR.SYNC"] > 2, summary
    # MUFU.EX2 per loop body: one per score of a thread's rows (tile_n / 2) less the emulated
    # share, plus one rescale factor per row (2); the same bodies as the QGMMA count.
    bodies = 3 if options.schedule.overlap else 2
    exps = spec.tile_n // 2 * (100 - options.exp_emu) // 100 + 2
    # (RowSum.MMA: the overlap prologue's rescale factors have no use, its row sums come with the
    # next step's P V, so ptxas drops them)
    unused = 2 if sum_mma else 0
    assert report.counts["MUFU.EX2"] >= bodies * exps - unused, summary
    if options.exp_emu:
        assert report.counts["MUFU.EX2"] < bodies * (spec.tile_n // 2 + 2), summary
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == _budgets(spec), regions
    assert all(used < budget for budget, used in regions), regions
    _assert_split_fits(report, spec)


# Block quantization: the twins of two checked defaults (hd128 non-causal, hd192 causal).
BLOCK_CHECKED = [s.replace(quant=Quant.BLOCK) for s in CHECKED if s.head_dim in (128, 192)]


@pytest.fixture(scope="module")
def block_cubins(tmp_path_factory):
    return sass.dump_cubins(BLOCK_CHECKED, "sm_90a", tmp_path_factory.mktemp("sm_90a_fp8_block"))


def test_block_variants_are_committed():
    variants = set(all_variants("sm90", "fwd"))
    assert {s.replace(quant=Quant.BLOCK) for s in FP8_DEFAULTS} <= variants
    assert set(BLOCK_CHECKED) <= variants and len(BLOCK_CHECKED) == 2


@pytest.mark.parametrize("spec", BLOCK_CHECKED, ids=lambda s: s.name)
def test_block_sass(cubins, block_cubins, spec):
    """A _blockq variant: QGMMA only, no spill or local memory, each setmaxnreg region within its
    budget; the same QGMMA, MUFU.EX2 and e4m3 conversion counts as its per-head twin (the V ratio
    rides in the exp2 bias, no per-score work is added); the key tile's (k descale, log2 r, 1 / r)
    arrive in one 16-byte global load (LDG.E.128) per step."""
    text = sass.disassemble(block_cubins[spec.name])
    report = sass.analyze(block_cubins[spec.name])
    twin = sass.analyze(cubins[spec.replace(quant=Quant.TENSOR).name])
    summary = f"{spec.name}: {report.summary()}"
    _assert_uniform_datapath(report, summary)
    assert report.missing("sm90", "e4m3") == [], summary
    assert report.spills == 0 and report.local_bytes == 0 and report.stack_bytes == 0, summary
    assert report.counts["LDL"] == 0 and report.counts["STL"] == 0, summary
    assert report.counts["HGMMA"] == 0, summary
    per_block = spec.head_dim // fp8.MMA_K + spec.tile_n // fp8.MMA_K
    assert report.counts["QGMMA"] == 3 * per_block == twin.counts["QGMMA"], summary
    for op in ("MUFU.EX2", "F2FP.SATFINITE.E4M3"):
        assert report.counts[op] == twin.counts[op], (op, summary, twin.summary())
    # one per step body (prologue, masked, unmasked) plus the first tile's before the loops
    assert text.count("LDG.E.128") == 4, summary
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == _budgets(spec), regions
    assert all(used < budget for budget, used in regions), regions
    _assert_split_fits(report, spec)


# VTranspose.HOISTED (_hvt, the e4m3 default): the V transpose's addresses hoisted (fp8_transpose.TransposeV);
# the hd128 default and hd256's default tile and schedule (without its lazy_rescale) keep a twin
# with the indexed transpose among the alternatives.
def _indexed(spec):
    return spec.replace(v_transpose=VTranspose.INDEXED)


HOISTED = [
    s
    for s in FP8_DEFAULTS + FP8_ALTERNATIVES
    if s.options.v_transpose is VTranspose.HOISTED and _indexed(s) in FP8_ALTERNATIVES
]
TWINS = [_indexed(s) for s in HOISTED]
HOISTED_CHECKED = [s for s in HOISTED if not s.causal]


def _cubin(spec, *fixtures):
    """The cubin of ``spec`` from whichever of the cubin fixtures compiled it."""
    return next(found[spec.name] for found in fixtures if spec.name in found)


def _instructions(text: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction of ``text``, in code order."""
    return [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"^\s+/\*([0-9a-f]+)\*/\s+([^;]*);", text, re.MULTILINE)
    ]


def producer_block_instructions(text: str, steps_per_trip: int, steps: int) -> int:
    """Instructions one producer warp (not warp 0, which also issues the TMA loads) executes per
    key block, counted from the SASS: the producer's key loop (the outermost backward branch between
    the two setmaxnreg marks) taken once, less warp 0's TMA stretch, plus each further trip of an
    inner transpose loop (a backward branch over shared loads, ``steps / steps_per_trip`` trips);
    mbarrier retry loops count once."""
    lines = _instructions(text)
    marks = [i for i, (_, ins) in enumerate(lines) if "USETMAXREG" in ins]
    producer = lines[marks[0] : marks[1]]
    index = {addr: i for i, (addr, _) in enumerate(producer)}
    loops = []
    for i, (addr, ins) in enumerate(producer):
        target = re.search(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in index:
            loops.append((index[int(target.group(1), 16)], i))
    start, end = max(loops, key=lambda lp: lp[1] - lp[0])
    body = producer[start : end + 1]
    # warp 0's TMA stretch: the first forward branch in the loop skips it for the other warps
    skip = next(
        (int(m.group(1), 16) for _, ins in body if (m := re.search(r"@P\d BRA\s+0x([0-9a-f]+)", ins))),
        None,
    )
    count = len(body)
    if skip is not None and skip in index:
        first = next(i for i, (_, ins) in enumerate(body) if re.search(r"@P\d BRA", ins))
        count -= index[skip] - (start + first + 1)
    for s, e in loops:
        if start < s and e < end and any(ins.startswith("LDS") for _, ins in producer[s : e + 1]):
            count += (e - s + 1) * (steps // steps_per_trip - 1)
    return count


def test_hoisted_variants_are_committed():
    assert all(s.options.v_transpose is VTranspose.HOISTED for s in FP8_DEFAULTS)
    assert {(s.head_dim, s.tile_n, s.stages, s.causal) for s in HOISTED} == {
        (128, 128, 3, False), (128, 128, 3, True), (256, 64, 3, False), (256, 64, 3, True),
    }  # fmt: skip
    assert set(TWINS) <= set(FP8_ALTERNATIVES)


@pytest.mark.parametrize("spec", HOISTED_CHECKED, ids=lambda s: s.name)
def test_hoisted_transpose_sass(cubins, alternative_cubins, spec):
    """The _hvt producer: the transpose fully unrolled (each step's 4 LDS, 8 PRMT, 4 STS once in the
    producer's code), and per key block a producer warp executes under a third of its twin's
    instructions (hd128: 603 -> 194, hd256: 726 -> 186 on sm_90a, with the lane masks' address
    XORs and per-thread PRMT selectors, fp8_transpose.TRANSPOSE_LANE_MASKS); the consumers' code keeps its
    QGMMA, MUFU.EX2 and e4m3 conversion counts."""
    twin = _indexed(spec)
    assert spec in CHECKED + FP8_ALTERNATIVES and twin in TWINS
    text = sass.disassemble(_cubin(spec, cubins, alternative_cubins))
    twin_text = sass.disassemble(alternative_cubins[twin.name])
    steps = fp8_transpose.transpose_steps(spec.tile_n, spec.head_dim)
    lines = _instructions(text)
    marks = [i for i, (_, ins) in enumerate(lines) if "USETMAXREG" in ins]
    producer_ops = [ins.split()[0] if not ins.startswith("@") else ins.split()[1] for _, ins in lines[marks[0] : marks[1]]]
    assert sum(op == "LDS" for op in producer_ops) == 4 * steps
    assert sum(op == "STS" for op in producer_ops) == 4 * steps
    assert sum(op == "PRMT" for op in producer_ops) == 8 * steps
    hoisted = producer_block_instructions(text, steps, steps)
    before = producer_block_instructions(twin_text, 2, steps)  # the twin's loop is unrolled twice
    assert 16 * steps < hoisted < 200 and before > 3 * hoisted, (hoisted, before)
    report = sass.analyze(_cubin(spec, cubins, alternative_cubins))
    twin_report = sass.analyze(alternative_cubins[twin.name])
    for op in ("QGMMA", "MUFU.EX2", "F2FP.SATFINITE.E4M3"):
        assert report.counts[op] == twin_report.counts[op], (op, report.summary(), twin_report.summary())
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0


def test_smem_layouts_match_the_dsl(tmp_path):
    """fp8.SMEM_LAYOUTS_V_VT (what tests/test_fp8_layout.py evaluates the hoisted transpose's
    addresses with) are the layouts fp8.smem_layouts builds; and the byte offset of word (row, w)
    through the 32-bit recast view (what the plain transpose indexes) is 4x the word offset, i.e.
    the byte layout's offset at (row, 4 w)."""
    code = (
        "    for (tile_n, head_dim, stages) in fp8.SMEM_LAYOUTS_V_VT:\n"
        "        _, _, sv, svt = fp8.smem_layouts(tile_n, head_dim, 2, stages)\n"
        "        print('L', tile_n, head_dim, stages, str(sv) + '|' + str(svt))\n"
        "        for lay, rows, cols in ((sv, tile_n, head_dim), (svt, head_dim, tile_n)):\n"
        "            l32 = cute.recast_layout(32, 8, lay.outer)\n"
        "            bad = [(r, w, s) for s in range(stages) for r in range(rows) for w in range(cols // 4)\n"
        "                   if 4 * l32((r, w, s)) != lay.outer((r, 4 * w, s))]\n"
        "            print('R', tile_n, head_dim, stages, len(bad))\n"
    )
    out = _run_dsl_probe(tmp_path / "probe_smem.py", code)
    layouts = {}
    for line in out.splitlines():
        kind, *rest = line.split(" ", 4)
        if kind == "L":
            layouts[tuple(int(x) for x in rest[:3])] = tuple(rest[3].split("|"))
        elif kind == "R":
            assert rest[3] == "0", line
    assert layouts == fp8.SMEM_LAYOUTS_V_VT


# VTranspose.WIDE (_hvt_wvt): the V transpose with 64-bit shared-memory accesses
# (fp8_wide_transpose.WideTransposeV), committed on the hd128 and hd256 default tiles and schedules
# beside their _hvt twins (the defaults).
WIDE = [s for s in FP8_ALTERNATIVES if s.options.v_transpose is VTranspose.WIDE]
WIDE_CHECKED = [s for s in WIDE if not s.causal]


def _hoisted(spec):
    return spec.replace(v_transpose=VTranspose.HOISTED)


def _producer_ops(text: str) -> dict[str, int]:
    """Instruction forms (opcode with modifiers) of the producer region (between the setmaxnreg marks)."""
    lines = _instructions(text)
    marks = [i for i, (_, ins) in enumerate(lines) if "USETMAXREG" in ins]
    ops: dict[str, int] = {}
    for _, ins in lines[marks[0] : marks[1]]:
        op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
        ops[op] = ops.get(op, 0) + 1
    return ops


def test_wide_variants_are_committed():
    assert {(s.head_dim, s.tile_n, s.stages, s.causal) for s in WIDE} == {
        (128, 128, 3, False), (128, 128, 3, True), (256, 64, 3, False), (256, 64, 3, True),
    }  # fmt: skip
    assert all(_hoisted(s) in HOISTED for s in WIDE)


@pytest.mark.parametrize("spec", WIDE_CHECKED, ids=lambda s: s.name)
def test_wide_transpose_sass(cubins, alternative_cubins, spec):
    """The _wvt producer: 8 LDS.64, 32 PRMT and 8 STS.64 per unit, fully unrolled, no 32-bit shared
    access left, half the producer's shared-memory instructions of its _hvt twin; per key block a
    producer warp executes no more instructions than the twin's (sm_90a, DSL 4.8.1: hd128 194 ->
    176, the XOR-derived addresses take most of the LDS/STS savings; hd256 186 -> 152). The consumers keep
    their QGMMA, MUFU.EX2 and e4m3 conversion counts; no spill; both setmaxnreg budgets respected."""
    twin = _hoisted(spec)
    assert twin in HOISTED
    text = sass.disassemble(alternative_cubins[spec.name])
    twin_text = sass.disassemble(_cubin(twin, cubins, alternative_cubins))
    steps = fp8_wide_transpose.wide_steps(spec.tile_n, spec.head_dim)
    ops, twin_ops = _producer_ops(text), _producer_ops(twin_text)
    assert ops.get("LDS.64") == 8 * steps and ops.get("STS.64") == 8 * steps, ops
    assert not any(op.split(".")[0] in ("LDS", "STS") and op not in ("LDS.64", "STS.64") for op in ops), ops
    assert ops.get("PRMT") == 32 * steps == twin_ops.get("PRMT"), (ops, twin_ops)
    assert 2 * ops["LDS.64"] == twin_ops["LDS"] and 2 * ops["STS.64"] == twin_ops["STS"], (ops, twin_ops)
    wide = producer_block_instructions(text, steps, steps)
    hoisted = producer_block_instructions(twin_text, 1, 1)
    print(f"{spec.name}: producer warp per key block {hoisted} (_hvt) -> {wide} (_wvt)")
    assert 48 * steps < wide <= hoisted + 4, (wide, hoisted)
    report = sass.analyze(alternative_cubins[spec.name])
    twin_report = sass.analyze(_cubin(twin, cubins, alternative_cubins))
    for op in ("QGMMA", "MUFU.EX2", "F2FP.SATFINITE.E4M3"):
        assert report.counts[op] == twin_report.counts[op], (op, report.summary(), twin_report.summary())
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == _budgets(spec), regions
    assert all(used < budget for budget, used in regions), regions
    _assert_split_fits(report, spec)


# lazy_rescale (_lres): O rescaled only when a warp's row max moves by more than 2^4; hd256's
# default, committed beside the hd128 default, on hd256's 128x96 tile and on hd128's 192x96 (both masks).
LAZY = [s for s in FP8_ALTERNATIVES + CHECKED if s.options.lazy_rescale]
LAZY_CHECKED = compile_sample(LAZY, keep=[s for s in LAZY if s in CHECKED])


def test_lazy_variants_are_committed():
    variants = [s for s in FP8_DEFAULTS + FP8_ALTERNATIVES if s.options.lazy_rescale]
    assert {(s.head_dim, s.tile_n, s.causal) for s in variants} == {
        (128, 128, False), (128, 128, True), (128, 96, False), (128, 96, True),
        (256, 64, False), (256, 64, True), (256, 96, False), (256, 96, True), (256, 128, False), (256, 128, True),
    }  # fmt: skip
    # (a persistent variant's twin: its one-CTA-per-tile twin without the option; RowSum.MMA,
    # OAccum.TWO_LEVEL and v_mean are committed with lazy_rescale only, so a twin has none of them)
    twins = {
        s.replace(
            lazy_rescale=False,
            scheduler=Scheduler.GRID,
            row_sum=RowSum.FADD,
            o_accum=OAccum.ONE_LEVEL,
            v_mean=False,
        )
        for s in variants
    }
    assert twins <= set(FP8_DEFAULTS) | set(FP8_ALTERNATIVES)
    assert {s.head_dim for s in FP8_DEFAULTS if s.options.lazy_rescale} == {256}
    assert any(s.options.lazy_rescale for s in CHECKED)


@pytest.mark.parametrize("spec", LAZY_CHECKED, ids=lambda s: s.name)
def test_lazy_rescale_sass(cubins, alternative_cubins, spec):
    """A _lres variant: one warp vote per softmax (the two loop bodies and the overlap prologue),
    and in each loop body the O rescale (head_dim / 2 FMULs per thread) behind a branch of its own
    that the vote decides; QGMMA only, no spill, budgets kept."""
    text = sass.disassemble(_cubin(spec, cubins, alternative_cubins))
    report = sass.analyze(_cubin(spec, cubins, alternative_cubins))
    bodies = 3 if spec.options.schedule.overlap else 2
    assert text.count("VOTE.ANY") == bodies, report.summary()
    # (OAccum.TWO_LEVEL: the fp32 copy's two row scales follow O's rescale behind the same branch)
    two_level = spec.options.o_accum is OAccum.TWO_LEVEL
    rescales = [n for n in skipped_fmuls(text) if n == spec.head_dim // 2 + (2 if two_level else 0)]
    assert len(rescales) == 2, skipped_fmuls(text)
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0, report.summary()
    assert report.counts["HGMMA"] == 0 and report.missing("sm90", "e4m3") == [], report.summary()
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == _budgets(spec), regions
    assert all(used < budget for budget, used in regions), regions


# The row sums by a P x ones WGMMA (RowSum.MMA, _smma) and O accumulated in two levels
# (OAccum.TWO_LEVEL, _tlacc): committed on the tuned tiles (hd128 192x96, hd256 128x96; two levels at
# hd128 only, where its fp32 copy of O fits).
SUM_MMA = [s for s in FP8_ALTERNATIVES if s.options.row_sum is RowSum.MMA]
TWO_LEVEL = [s for s in FP8_ALTERNATIVES if s.options.o_accum is OAccum.TWO_LEVEL]
SUM_MMA_CHECKED = compile_sample(SUM_MMA)
TWO_LEVEL_CHECKED = compile_sample(TWO_LEVEL)


def _fadd_sums(spec):
    return spec.replace(row_sum=RowSum.FADD)


def _one_level(spec):
    return spec.replace(o_accum=OAccum.ONE_LEVEL)


def test_sum_mma_and_two_level_are_committed():
    assert {(s.head_dim, s.causal) for s in SUM_MMA} == {(128, False), (128, True), (256, False), (256, True)}
    assert {(s.head_dim, s.causal) for s in TWO_LEVEL} == {(128, False), (128, True)}
    alternatives = set(FP8_ALTERNATIVES)
    assert all(_fadd_sums(s) in alternatives for s in SUM_MMA)
    assert all(_one_level(s) in alternatives for s in TWO_LEVEL)


def _step(spec, text):
    """The unmasked key step's loop: the shortest loop that issues S, P V and, with RowSum.MMA, the
    row sums."""
    products = 2 if spec.options.row_sum is RowSum.MMA else 1
    issues = spec.head_dim // fp8.MMA_K + products * spec.tile_n // fp8.MMA_K
    return step_loop(text, issues)


@pytest.mark.parametrize("spec", SUM_MMA_CHECKED, ids=lambda s: s.name)
def test_sum_mma_sass(alternative_cubins, spec):
    """A _smma variant's key step: the P x ones product (QGMMA with N = 8, one per 32 keys) and no
    floating-point add per probability: its twin's step adds tile_n / 2 - 2 per thread for the row
    sums, this one at most 8 (the block sums, the lazy vote's and the rescale's arithmetic)."""
    text = sass.disassemble(alternative_cubins[spec.name])
    twin = sass.disassemble(alternative_cubins[_fadd_sums(spec).name])
    step, twin_step = _step(spec, text), _step(_fadd_sums(spec), twin)
    sums = [ins for ins in step if ins.startswith("QGMMA.64x8x32.F32.E4M3.E4M3")]
    assert len(sums) == spec.tile_n // fp8.MMA_K, step
    fadds = sum(ins.startswith("FADD") for ins in step)
    twin_fadds = sum(ins.startswith("FADD") for ins in twin_step)
    assert twin_fadds >= spec.tile_n // 2 - 2 and fadds <= 8, (fadds, twin_fadds)
    assert len(step) < len(twin_step) - spec.tile_n // 4, (len(step), len(twin_step))


@pytest.mark.parametrize("spec", TWO_LEVEL_CHECKED, ids=lambda s: s.name)
def test_two_level_sass(alternative_cubins, spec):
    """A _tlacc variant's key step: the promotion of O behind one branch, a thread's head_dim / 2
    accumulator values through its fp32 copy in shared memory in 16-byte accesses (head_dim / 8
    LDS.128 and STS.128, no other shared-memory access: the consumers read nothing else from shared
    memory themselves) and one FFMA each; no spill, budgets kept."""
    text = sass.disassemble(alternative_cubins[spec.name])
    step = _step(spec, text)
    chunks = spec.head_dim // 2 // fp8_two_level.O32_CHUNK
    assert sum(ins.startswith("LDS.128") for ins in step) == chunks, step
    assert sum(ins.startswith("STS.128") for ins in step) == chunks, step
    assert not [ins for ins in step if ins.startswith(("LDS", "STS")) and not ins.startswith(("LDS.128", "STS.128"))]
    twin = _step(_one_level(spec), sass.disassemble(alternative_cubins[_one_level(spec).name]))
    ffmas = sum(ins.startswith("FFMA") for ins in step) - sum(ins.startswith("FFMA") for ins in twin)
    assert ffmas >= spec.head_dim // 2, ffmas
    report = sass.analyze(alternative_cubins[spec.name])
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0, report.summary()


# v's column means added in the epilogue (_vmean): committed on the tuned tiles (hd128 192x96,
# hd256 128x96, persistent too), what flash_attn_func(v_mean=) runs there.
V_MEAN = [s for s in FP8_ALTERNATIVES if s.options.v_mean]
V_MEAN_CHECKED = compile_sample(V_MEAN)


def test_v_mean_variants_are_committed():
    assert {(s.head_dim, s.causal, s.options.scheduler) for s in V_MEAN} == {
        (d, c, p) for d in (128, 256) for c in (False, True) for p in (Scheduler.GRID, Scheduler.PERSISTENT)
    }
    assert all(s.replace(v_mean=False) in set(FP8_ALTERNATIVES) for s in V_MEAN)


@pytest.mark.parametrize("spec", V_MEAN_CHECKED, ids=lambda s: s.name)
def test_v_mean_sass(alternative_cubins, spec):
    """A _vmean variant's key step is its twin's (the means are added after the key loop): as
    long, with the same tensor-core, MUFU, floating-point and conversion instructions (ptxas may
    pick other integer moves); the kernel loads a thread's head_dim / 4 column means (one LDG
    each, in the epilogue) on top of its twin's loads; no spill, budgets kept."""
    twin_spec = spec.replace(v_mean=False)
    text, twin_text = (sass.disassemble(alternative_cubins[s.name]) for s in (spec, twin_spec))
    step, twin_step = _step(spec, text), _step(twin_spec, twin_text)
    assert len(step) == len(twin_step), (len(step), len(twin_step))
    classes = ("QGMMA", "MUFU", "FMUL", "FFMA", "FADD", "FMNMX", "F2FP", "FSEL", "SHFL")

    def count(loop):
        return {c: sum(ins.startswith(c) for ins in loop) for c in classes}

    assert count(step) == count(twin_step), (count(step), count(twin_step))
    report = sass.analyze(alternative_cubins[spec.name])
    loads = len(re.findall(r"\sLDG\.", text)) - len(re.findall(r"\sLDG\.", twin_text))
    assert loads == spec.head_dim // 4, loads
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0, report.summary()
    regions = sass.setmaxnreg_regions(text)
    assert [budget for budget, _ in regions] == _budgets(spec), regions
    assert all(used < budget for budget, used in regions), regions


# The alternatives the checks above read: test_alternative_sass's sample, the hoisted and wide
# transposes' twins, the lazy, row-sum, two-level and v_mean variants checked and their twins.
ALT_COMPILED = [
    s
    for s in FP8_ALTERNATIVES
    if s in compile_sample(FP8_ALTERNATIVES)
    or s in HOISTED_CHECKED + [_indexed(h) for h in HOISTED_CHECKED]
    or s in WIDE_CHECKED + [_hoisted(w) for w in WIDE_CHECKED]
    or s in LAZY_CHECKED + SUM_MMA_CHECKED + [_fadd_sums(t) for t in SUM_MMA_CHECKED]
    or s in TWO_LEVEL_CHECKED + [_one_level(t) for t in TWO_LEVEL_CHECKED]
    or s in V_MEAN_CHECKED + [v.replace(v_mean=False) for v in V_MEAN_CHECKED]
]


@pytest.fixture(scope="module")
def alternative_cubins(tmp_path_factory):
    return sass.dump_cubins(ALT_COMPILED, "sm_90a", tmp_path_factory.mktemp("sm_90a_fp8_alt"))
