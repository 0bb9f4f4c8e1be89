"""The sm80-family decode kernel (templates/decode_sm80.py.j2) compiles on this CPU, and its SASS
shows the design: mma.sync (HMMA) on the packed query rows, cp.async (LDGSTS) for Q and the K/V
rows, exp2 on MUFU, no local-memory spills, registers within the 255 limit, and the append and combine
kernels beside the decode kernel in the same cubin.

Dense and paged caches, the masks and softcap, head dims 64 and 128, row tiles of 1, 2, 4 and 8
warps, the KEYS schedule (4 warps splitting the keys of a 16-row tile) and the line-wide K/V
copies (DecodeCopy.LINES); for sm_90a (H100/H200:
the GPUs the decode path is measured on) and a subset for sm_80.
"""

from __future__ import annotations

import pytest

from cutefa import sass
from cutefa.model import policy_decode
from cutefa.model.options import CacheDtype, Mask

pytestmark = pytest.mark.compile


def _spec(
    head_dim,
    rows,
    mask=Mask.NONE,
    paged=False,
    softcap=False,
    schedule=policy_decode.DecodeSchedule.ROWS,
    copy=policy_decode.DecodeCopy.SECTORS,
    pages=policy_decode.DecodePages.ROWS,
):
    return policy_decode.decode_spec(
        "bf16", head_dim, rows, mask=mask, paged=paged, softcap=softcap, schedule=schedule, copy=copy, pages=pages,
        page_size=16,
    )  # fmt: skip


KEYS = policy_decode.DecodeSchedule.KEYS
LINES = policy_decode.DecodeCopy.LINES
CHUNKS = policy_decode.DecodePages.CHUNKS


SM90A = [
    _spec(128, 4),  # GQA 32/8, one token: one warp
    _spec(128, 4, Mask.CAUSAL, paged=True),
    _spec(64, 32, Mask.LOCAL, softcap=True),  # MQA 32/1 or 8 heads x 4 tokens: two warps
    _spec(64, 64, Mask.CAUSAL, paged=True),  # 4 heads x 16 tokens: four warps
    _spec(128, 128, Mask.LOCAL, paged=True, softcap=True),  # eight warps
    _spec(128, 4, schedule=KEYS),  # four warps splitting the keys
    _spec(128, 4, Mask.CAUSAL, paged=True, schedule=KEYS),
    _spec(128, 4, copy=LINES),  # a 128-byte line per 8 threads (SM90A[0] with line copies)
    _spec(128, 4, Mask.CAUSAL, paged=True, copy=LINES),
    _spec(128, 4, Mask.CAUSAL, paged=True, copy=LINES, pages=CHUNKS),  # a page read per 16 keys
]
SM80 = [
    _spec(128, 4, Mask.CAUSAL, paged=True),
    _spec(64, 64),
    _spec(64, 4, Mask.LOCAL, softcap=True, schedule=KEYS),
]


@pytest.fixture(scope="module")
def cubins_sm90a(tmp_path_factory):
    return sass.dump_cubins(SM90A, "sm_90a", tmp_path_factory.mktemp("sm_90a"))


@pytest.fixture(scope="module")
def cubins_sm80(tmp_path_factory):
    return sass.dump_cubins(SM80, "sm_80", tmp_path_factory.mktemp("sm_80"))


def _hmma_per_body(spec) -> int:
    """Per mainloop body each warp issues (keys / 8) * (head_dim / 16) HMMAs for S = Q K^T of its
    16 rows and (head_dim / 8) * (keys / 16) for O += P V (keys: its keys of a block, tile_n or
    the KEYS schedule's 16)."""
    keys = policy_decode.warp_keys(spec)
    return (keys // 8) * (spec.head_dim // 16) + (spec.head_dim // 8) * (keys // 16)


def _check(cubin, spec, target) -> None:
    report = sass.analyze(cubin)
    assert report.missing("sm80") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert 0 < report.registers <= 255, f"{spec.name}: {report.summary()}"
    # masked and unmasked bodies (and the left edge's with a window), each a whole step of HMMAs
    bodies = 3 if spec.mask is Mask.LOCAL else 2
    assert report.counts["HMMA"] == bodies * _hmma_per_body(spec), f"{spec.name}: {report.summary()}"
    text = sass.disassemble(cubin)
    kernels = sass.kernel_sections(text)
    assert len(kernels) == 3, list(kernels)
    combine = sass.kernel_text(text, "combine")
    assert "SHFL.BFLY" in combine and "HMMA" not in combine and "MUFU.EX2" in combine
    # programmatic dependent launch on sm_90+: the splits trigger the combine's launch at their top
    # (griddepcontrol.launch_dependents: PREEXIT), the combine waits for them (griddepcontrol.wait:
    # ACQBULK) before its first read; sm_80 has neither instruction
    pdl = target != "sm_80"
    assert ("ACQBULK" in sass.opcode_forms(combine)) is pdl, sass.opcode_forms(combine)
    assert ("PREEXIT" in sass.opcode_forms(sass.kernel_text(text, "kernel"))) is pdl
    # the append: element loads and stores of q/k/v rows, the rotation in float32 FMAs, no MMA
    append = sass.opcode_forms(sass.kernel_text(text, "append"))
    assert append.get("LDG.E.U16", 0) > 0 and append.get("STG.E.U16", 0) > 0, append
    assert "HMMA" not in append and "LDGSTS" not in " ".join(append), append
    decode = sass.kernel_text(text, "kernel")
    forms = sass.opcode_forms(decode)
    # the K/V tiles by cp.async, 16 bytes a copy; fp32 partial rows as 8-byte pairs
    assert forms.get("LDGSTS.E.BYPASS.LTC128B.128", 0) > 0, forms
    assert forms.get("STG.E.64", 0) > 0, forms
    if spec.features.paged_kv:
        assert any(f.startswith("LDG.E") and not f.endswith(".128") for f in forms), forms  # page table reads


@pytest.mark.parametrize("spec", SM90A, ids=lambda s: s.name)
def test_decode_sass_sm90a(cubins_sm90a, spec):
    _check(cubins_sm90a[spec.name], spec, "sm_90a")


@pytest.mark.parametrize("spec", SM80, ids=lambda s: s.name)
def test_decode_sass_sm80(cubins_sm80, spec):
    _check(cubins_sm80[spec.name], spec, "sm_80")


def test_keys_tile_syncs_its_warps_only_outside_the_mainloop(cubins_sm90a):
    """The KEYS schedule: each warp copies its own 16-key slices (one row a thread: 16 cp.async of
    16 bytes per K or V block of 16 x 128), no CTA barrier in the mainloop (one after Q landed, two
    around the merge of the warps' rows), Q kept in registers (ldmatrix of Q once), registers low
    enough for 2 CTAs of 128 threads an SM (policy_decode.KEY_REGISTERS_PER_THREAD)."""
    for spec in (s for s in SM90A if policy_decode.schedule_of(s) is KEYS):
        report = sass.analyze(cubins_sm90a[spec.name])
        assert report.counts["BAR.SYNC"] == 3, report.summary()
        assert report.registers <= policy_decode.KEY_REGISTERS_PER_THREAD[spec.head_dim], report.summary()
        # per body: K and V slices 8 ldmatrix.x4 each; Q: 8 once (16 x 128)
        assert report.counts["LDSM"] == 2 * 16 + spec.head_dim // 16, report.summary()
        text = sass.disassemble(cubins_sm90a[spec.name])
        forms = sass.opcode_forms(sass.kernel_text(text, "kernel"))
        assert {f for f in forms if f.startswith("LDGSTS")} == {"LDGSTS.E.BYPASS.LTC128B.128"}, forms


def test_one_warp_tile_keeps_few_copy_rows(cubins_sm90a):
    """Two threads side by side on a row: a one-warp CTA issues (tile_n * head_dim / 8) / 32 = 32
    cp.async per K or V block of 64 x 128 from 4 row addresses; the registers stay well below the
    limit (the prefill's 8-threads-per-row layout gives this tile 16 rows a thread and 255)."""
    spec = SM90A[0]
    assert policy_decode.copy_threads_per_row(spec) == 2
    report = sass.analyze(cubins_sm90a[spec.name])
    assert report.registers <= 232, report.summary()


def test_line_copies_issue_the_sector_copies_count(cubins_sm90a):
    """DecodeCopy.LINES moves the same bytes by the same 16-byte cp.async (as many per thread), laid
    out 8 threads a row instead of 2 (policy_decode.copy_threads_per_row); no spills at 255
    registers or fewer (one-warp CTAs: shared memory, not registers, bounds their residency)."""
    for lines in (s for s in SM90A if s.options.line_copy and not s.options.page_chunks):
        sectors = lines.replace(line_copy=False)
        assert sectors in SM90A and policy_decode.copy_threads_per_row(lines) == 8
        counts = [
            sass.opcode_forms(sass.kernel_text(sass.disassemble(cubins_sm90a[s.name]), "kernel"))
            for s in (lines, sectors)
        ]
        copies = [c.get("LDGSTS.E.BYPASS.LTC128B.128", 0) for c in counts]
        assert copies[0] == copies[1] > 0, (lines.name, copies)
        report = sass.analyze(cubins_sm90a[lines.name])
        assert report.spills == 0 and report.registers <= 255, report.summary()


def test_page_chunks_read_the_table_once_per_chunk(cubins_sm90a):
    """DecodePages.CHUNKS: the same copies as the per-row paged line copy, with the sector layout's
    page-table reads (4 a 64-key block a thread instead of 16: 29 LDG in the kernel against 113 at
    hd128) and far fewer instructions and registers (sm_90a, DSL 4.8.1: 4,120 against 5,768; 168
    registers against 245), no spills."""
    chunks = next(s for s in SM90A if s.options.page_chunks)
    per_row = chunks.replace(page_chunks=False)
    sectors = per_row.replace(line_copy=False)
    assert per_row in SM90A and sectors in SM90A and policy_decode.chunk_row_step(chunks) == 4
    texts = {s: sass.kernel_text(sass.disassemble(cubins_sm90a[s.name]), "kernel") for s in (chunks, per_row, sectors)}
    forms = {s: sass.opcode_forms(t) for s, t in texts.items()}
    loads = {s: sum(n for f, n in forms[s].items() if f.startswith("LDG.")) for s in texts}
    copies = {s: forms[s].get("LDGSTS.E.BYPASS.LTC128B.128", 0) for s in texts}
    assert copies[chunks] == copies[per_row] == copies[sectors] > 0, copies
    assert loads[chunks] == loads[sectors] < loads[per_row], loads
    sizes = {s: sum(forms[s].values()) for s in texts}
    assert sizes[chunks] < 0.8 * sizes[per_row], sizes
    report = sass.analyze(cubins_sm90a[chunks.name])
    assert report.spills == 0 and report.registers < sass.analyze(cubins_sm90a[per_row.name]).registers


# An e4m3 cache (sm_90a and newer): the tiles cp.async'd as bytes and widened on chip
E4M3 = policy_decode.decode_spec("bf16", 128, 4, mask=Mask.CAUSAL, paged=True, cache_dtype=CacheDtype.E4M3)


@pytest.fixture(scope="module")
def cubin_e4m3(tmp_path_factory):
    return sass.dump_cubins([E4M3], "sm_90a", tmp_path_factory.mktemp("sm_90a_e4m3"))[E4M3.name]


def test_e4m3_cache_decode_sass_sm90a(cubin_e4m3):
    spec = E4M3
    report = sass.analyze(cubin_e4m3)
    assert report.missing("sm80") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0 and report.local_bytes == 0, report.summary()
    assert 0 < report.registers <= 255, report.summary()
    assert report.counts["HMMA"] == 2 * _hmma_per_body(spec), report.summary()
    text = sass.disassemble(cubin_e4m3)
    assert len(sass.kernel_sections(text)) == 3  # append (quantizing new tokens), decode and combine
    forms = sass.opcode_forms(sass.kernel_text(text, "kernel"))
    assert not any(f.startswith(("LDL", "STL")) for f in forms), forms
    # 16-byte cp.async of the e4m3 rows; each thread's chunks read back as 16-byte vectors and
    # widened: e4m3 pairs to f16x2, then (bf16) through f32 pairs into bf16x2
    assert any(f.startswith("LDGSTS") and f.endswith(".128") for f in forms), forms
    assert forms.get("LDS.128", 0) > 0 and forms.get("STS.128", 0) > 0, forms
    # four widening sites (K and V of the masked and the unmasked step), each a loop over the
    # thread's rows whose body widens the thread's 16-byte chunks of one row
    chunks = 4 * (spec.head_dim // 16) // policy_decode.copy_threads_per_row(spec)
    assert forms.get("F2FP.F16.E4M3.UNPACK_B", 0) == chunks * 8, forms
    assert forms.get("F2FP.BF16.F32.PACK_AB", 0) >= chunks * 8, forms
    assert forms.get("HADD2.F32", 0) == chunks * 16, forms
