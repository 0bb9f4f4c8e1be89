"""Dispatch: problem -> variant per head dim, tuned-table precedence, rejection reasons, explain, logging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cutefa import dispatch, tuned_tables
from cutefa.model import rules
from cutefa.model.committed import default_variants
from cutefa.model.defaults import DEFAULT_BWD_TILES, DEFAULT_TILES, default_spec
from cutefa.model.options import DqLayout
from cutefa.model.spec import HEAD_DIMS, VariantSpec


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty tuned-table dir, only the sm80 forward implemented, and fresh memo caches."""
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    monkeypatch.setattr(tuned_tables, "TUNED_DIR", tuned)
    monkeypatch.setattr(rules, "IMPLEMENTED", {("sm80", "fwd"): ("fp16", "bf16")})
    dispatch.clear_caches()
    yield tuned
    dispatch.clear_caches()


def problem(**overrides) -> dict:
    base = {"target": "sm_80", "dtype": "bf16", "head_dim": 128, "causal": False, "seqlen_q": 1024}
    base.update(seqlen_k=1024, batch=2, heads_q=16, heads_kv=4)
    return {**base, **overrides}


def heuristic_name(dtype: str = "bf16", head_dim: int = 128, causal: bool = False) -> str:
    return VariantSpec("sm80", "fwd", dtype, head_dim, *DEFAULT_TILES["sm80"][head_dim], causal=causal).name


def write_table(directory: Path, name: str, entries: list[dict], **fields) -> Path:
    table = {"arch": "sm80", "gpu": "A100", "target": "sm_80", "measured_on": "A100-SXM4-80GB, test fixture"}
    path = directory / name
    path.write_text(json.dumps({**table, **fields, "entries": entries}))
    return path


def entry(variant: str, max_seqlen_k: int | None, **fields) -> dict:
    return {
        "dtype": "bf16",
        "head_dim": 128,
        "causal": False,
        "max_seqlen_k": max_seqlen_k,
        "variant": variant,
        **fields,
    }


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_heuristic_choice_per_head_dim(head_dim, dtype, causal):
    choice = dispatch.choose(**problem(head_dim=head_dim, dtype=dtype, causal=causal))
    tile = DEFAULT_TILES["sm80"][head_dim]
    assert choice.spec == VariantSpec("sm80", "fwd", dtype, head_dim, *tile, causal=causal)
    assert choice.target == "sm_80"
    assert choice.reason.startswith(
        f"heuristic: default_config('sm80', 'fwd', {dtype!r}, {head_dim}) = {tile[0]}x{tile[1]} tile"
    )


def test_torch_dtypes_are_accepted_and_others_refused():
    assert dispatch.choose(**problem(dtype=torch.float16)).spec.dtype == "fp16"
    with pytest.raises(ValueError, match="dtype=torch.float32 is not one of"):
        dispatch.choose(**problem(dtype=torch.float32))


def test_rejected_candidates_carry_reasons_on_hopper():
    choice = dispatch.choose(**problem(target="sm_90a"))
    assert choice.spec.arch == "sm80" and choice.target == "sm_90a"
    assert choice.rejected == [
        ("sm100", "family sm100 does not run on sm_90a"),
        ("sm90", "no sm90 fwd kernel exists yet"),
    ]


def test_blackwell_falls_back_to_sm80_family():
    choice = dispatch.choose(**problem(target="sm_100a"))
    assert choice.spec.arch == "sm80" and choice.target == "sm_100a"
    assert ("sm100", "no sm100 fwd kernel exists yet") in choice.rejected


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("capability", "target"), [((10, 0), "sm_100a"), ((10, 3), "sm_103a")])
def test_blackwell_picks_the_sm100_family(monkeypatch, head_dim, causal, capability, target):
    """cc 10.0 (B200) and 10.3 (B300) -> their own 'a' target -> the sm100 default (tile and exp2
    emulation share), compiled for that target."""
    implemented = {("sm80", "fwd"): ("fp16", "bf16"), ("sm100", "fwd"): ("fp16", "bf16")}
    monkeypatch.setattr(rules, "IMPLEMENTED", implemented)
    assert dispatch.target_for_capability(*capability) == target
    choice = dispatch.choose(**problem(target=target, head_dim=head_dim, causal=causal))
    tile = DEFAULT_TILES["sm100"][head_dim]
    options = default_spec("sm100", "fwd", "fp16", head_dim).options
    assert choice.spec == VariantSpec("sm100", "fwd", "bf16", head_dim, *tile, causal=causal, options=options)
    assert choice.target == target
    assert choice.reason.startswith(f"heuristic: default_config('sm100', 'fwd', 'bf16', {head_dim}) = ")
    assert ("sm90", f"family sm90 does not run on {target}") in choice.rejected


SPACE_IMPLEMENTED = dict(rules.IMPLEMENTED)  # the real kernel set, before the fixture narrows it


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["e4m3", torch.float8_e4m3fn])
def test_fp8_on_blackwell_picks_the_sm100_e4m3_default(monkeypatch, head_dim, causal, dtype):
    """An fp8 call on a B200 (what the API's fp8 path asks with q's torch dtype) gets the sm100 e4m3
    default of the head dim, compiled for sm_100a; on an H100/H200 the sm90 e4m3 default."""
    monkeypatch.setattr(rules, "IMPLEMENTED", SPACE_IMPLEMENTED)
    choice = dispatch.choose(**problem(target="sm_100a", dtype=dtype, head_dim=head_dim, causal=causal))
    tile = DEFAULT_TILES["sm100"][head_dim]
    options = default_spec("sm100", "fwd", "fp16", head_dim).options  # the 16-bit default's
    assert choice.spec == VariantSpec("sm100", "fwd", "e4m3", head_dim, *tile, causal=causal, options=options)
    assert choice.target == "sm_100a"
    assert choice.spec in default_variants("sm100", "fwd")  # committed in generated/
    hopper = dispatch.choose(**problem(target="sm_90a", dtype=dtype, head_dim=head_dim, causal=causal))
    assert (hopper.spec.arch, hopper.spec.dtype) == ("sm90", "e4m3")


def test_tuned_table_takes_precedence_by_seqlen_bucket(isolated):
    short, longer = "cutefa_sm80_fwd_bf16_hd128_64x64_s1_w4", "cutefa_sm80_fwd_bf16_hd128_128x128_s1_w8"
    write_table(isolated, "sm80_a100.json", [entry(longer, None), entry(short, 1024)])
    for seqlen_k, want in ((1, short), (1000, short), (1024, short), (1025, longer), (10**6, longer)):
        choice = dispatch.choose(**problem(seqlen_k=seqlen_k, gpu_name="NVIDIA A100-SXM4-80GB"))
        assert choice.spec.name == want, seqlen_k
        assert "tuned table sm80_a100.json (measured on A100-SXM4-80GB, test fixture)" in choice.reason
        assert "another GPU" not in choice.reason and "no table for this GPU" not in choice.reason
    # problems the table does not cover use the heuristic
    assert dispatch.choose(**problem(dtype="fp16")).reason.startswith("heuristic")
    assert dispatch.choose(**problem(causal=True)).reason.startswith("heuristic")
    assert dispatch.choose(**problem(target="sm_86")).reason.startswith("heuristic")


def test_table_of_this_gpu_wins_over_another_gpu_of_the_target(isolated):
    write_table(isolated, "sm80_a100.json", [entry("cutefa_sm80_fwd_bf16_hd128_64x64_s1_w4", None)])
    write_table(
        isolated, "sm80_a800.json", [entry("cutefa_sm80_fwd_bf16_hd128_128x128_s1_w8", None)], gpu="A800"
    )
    assert dispatch.choose(**problem(gpu_name="NVIDIA A800 80GB")).spec.name.endswith("128x128_s1_w8")
    other = dispatch.choose(**problem(gpu_name="NVIDIA A30"))
    assert other.spec.name.endswith("64x64_s1_w4")
    assert "a A100; no table for this GPU" in other.reason


def test_a_fresh_table_of_some_head_dims_leaves_the_others_to_the_committed_one(
    isolated, tmp_path, monkeypatch
):
    """A table in $CUTEFA_TUNED_DIR (asked first) that covers head dim 64 only: head dim 64 takes its
    entry, head dim 128 the committed table's (not the heuristic)."""
    committed = "cutefa_sm80_fwd_bf16_hd128_128x128_s1_w8"
    write_table(isolated, "sm80_a100.json", [entry(committed, None)])
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    fresh = "cutefa_sm80_fwd_bf16_hd64_64x64_s1_w4"
    write_table(fresh_dir, "sm80_a100.json", [entry(fresh, None, head_dim=64)], measured_on="fresh fixture")
    monkeypatch.setenv("CUTEFA_TUNED_DIR", str(fresh_dir))
    dispatch.clear_caches()
    a100 = "NVIDIA A100-SXM4-80GB"
    choice = dispatch.choose(**problem(head_dim=64, gpu_name=a100))
    assert choice.spec.name == fresh and "fresh fixture" in choice.reason
    choice = dispatch.choose(**problem(gpu_name=a100))
    assert choice.spec.name == committed and "test fixture" in choice.reason


def test_invalid_tuned_entry_is_rejected_and_the_heuristic_used(isolated):
    bad = "cutefa_sm80_fwd_bf16_hd128_64x64_s1_w8"  # 64 rows cannot feed 8 warps of 16-row slabs
    write_table(isolated, "sm80_a100.json", [entry(bad, None)])
    choice = dispatch.choose(**problem())
    assert choice.reason.startswith("heuristic")
    assert (bad, rules.why_invalid(VariantSpec("sm80", "fwd", "bf16", 128, 64, 64, 1, 8))) in choice.rejected


def test_tuned_entry_for_another_problem_is_rejected(isolated):
    write_table(isolated, "sm80_a100.json", [entry("cutefa_sm80_fwd_bf16_hd64_128x128_s1_w4", None)])
    choice = dispatch.choose(**problem())
    label, why = choice.rejected[-1]
    assert label == "cutefa_sm80_fwd_bf16_hd64_128x128_s1_w4"
    assert "names a variant for another problem" in why
    assert choice.reason.startswith("heuristic")


_HEADER = {"arch": "sm80", "gpu": "A100", "target": "sm_80"}
_ODD_ENTRY = {"dtype": "bf16", "head_dim": 128, "causal": False, "max_seqlen_k": 1000, "variant": "v"}
MALFORMED = {
    "not-json": "{not json",
    "missing-measured_on": json.dumps({**_HEADER, "entries": []}),
    "max_seqlen_k-not-power-of-two": json.dumps({**_HEADER, "measured_on": "x", "entries": [_ODD_ENTRY]}),
}


@pytest.mark.parametrize("text", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_tables_are_skipped_with_a_warning(isolated, caplog, text):
    (isolated / "sm80_broken.json").write_text(text)
    with caplog.at_level("WARNING", logger="cutefa"):
        choice = dispatch.choose(**problem())
    assert choice.reason.startswith("heuristic")
    assert "ignoring tuned table sm80_broken.json" in caplog.text


def test_explain_names_choice_reason_and_rejections(isolated):
    bad = "cutefa_sm80_fwd_bf16_hd128_64x64_s1_w8"
    write_table(isolated, "sm80_a100.json", [entry(bad, None)], target="sm_90a")
    text = dispatch.explain_problem(**problem(target="sm_90a", causal=True, gpu_name="NVIDIA H200"))
    lines = text.splitlines()
    assert (
        lines[0]
        == "cutefa forward: q=(2, 1024, 16, 128) k=(2, 1024, 4, 128) bf16 causal=True on sm_90a (NVIDIA H200)"
    )
    assert lines[1] == f"chosen: {heuristic_name(causal=True)} (family sm80, compiled for sm_90a)"
    assert lines[2].startswith("  why: heuristic: default_config('sm80', 'fwd', 'bf16', 128) = ")
    assert lines[3:] == [
        "rejected:",
        "  sm100: family sm100 does not run on sm_90a",
        "  sm90: no sm90 fwd kernel exists yet",
    ]  # the table entry is for non-causal problems, so it is not a candidate here
    text = dispatch.explain_problem(**problem(target="sm_90a", gpu_name="NVIDIA H200"))
    assert f"  {bad}: tile_m=64 is not a multiple of 16*warps=128" in text


def test_explain_reports_no_kernel():
    text = dispatch.explain_problem(**problem(dtype="e4m3"))
    assert "no kernel: every candidate was rejected" in text
    assert "  sm80: no e4m3 sm80 fwd kernel exists yet" in text
    with pytest.raises(NotImplementedError, match="no cutefa kernel for q=.* e4m3 .*sm80: no e4m3"):
        dispatch.choose(**problem(dtype="e4m3"))


def test_a_tile_the_target_cannot_hold_falls_back_to_one_it_can():
    """sm_86/sm_89 GPUs hold 99 KiB per block: the sm80 hd256 forward default (128x64, 129 KiB) does
    not run there, so dispatch takes the largest committed tile that does (64x64, 97 KiB) and says
    why; on sm_80 (163 KiB) the default runs."""
    default = dispatch.choose(**problem(head_dim=256))
    assert (default.spec.tile_m, default.spec.tile_n) == (128, 64)
    for target in ("sm_86", "sm_89"):
        small = dispatch.choose(**problem(head_dim=256, target=target))
        assert (small.spec.tile_m, small.spec.tile_n, small.spec.warps) == (64, 64, 4)
        assert rules.why_not_on(small.spec, target) is None
        assert f"over the shared memory of {target} GPUs (needs 129.0 KiB of shared memory" in small.reason
        assert "the largest committed tile that fits: 64x64, 1 stage(s), 4 warps" in small.reason
    assert (
        dispatch.choose(**problem(head_dim=128, target="sm_89")).spec
        == dispatch.choose(**problem(head_dim=128)).spec
    )


def test_fitting_variant():
    spec = dispatch.choose(**problem(head_dim=256)).spec
    assert rules.fitting_variant(spec, "sm_80") is spec
    assert rules.fitting_variant(spec, "sm_86") == spec.replace(tile_m=64, warps=4)
    bwd = VariantSpec("sm80", "bwd", "bf16", 192, 64, 64, 1, 8, dq_layout=DqLayout.TILE)
    assert rules.fitting_variant(bwd, "sm_86") is None  # no committed hd192 backward tile within 99 KiB


def test_unsupported_arch_names_gpu_and_what_is_supported():
    with pytest.raises(NotImplementedError) as err:
        dispatch.choose(**problem(target="sm_75", gpu_name="Tesla T4"))
    message = str(err.value)
    assert message.startswith("no cutefa kernel for Tesla T4 (sm_75): cutefa needs compute capability 8.0+")
    assert "'sm_80'" in message and "'sm_90a'" in message
    with pytest.raises(NotImplementedError, match=r"no cutefa kernel for sm_120: cutefa has no build for it"):
        dispatch.choose(**problem(target="sm_120"))
    with pytest.raises(ValueError, match="is not a compile target like 'sm_90a'"):
        dispatch.choose(**problem(target="ampere"))
    assert "no kernel: no cutefa kernel for Tesla T4 (sm_75)" in dispatch.explain_problem(
        **problem(target="sm_75", gpu_name="Tesla T4")
    )


def test_choices_are_memoized_per_seqlen_bucket(monkeypatch):
    calls = []
    search = dispatch._search
    monkeypatch.setattr(dispatch, "_search", lambda p: calls.append(p.bucket) or search(p))
    first = dispatch.choose(**problem(seqlen_k=600))
    assert dispatch.choose(**problem(seqlen_k=1024, seqlen_q=7, batch=9, heads_q=8, heads_kv=8)) is first
    dispatch.choose(**problem(seqlen_k=1025))
    dispatch.choose(**problem(seqlen_k=70000))
    dispatch.choose(**problem(seqlen_k=10**7))
    dispatch.choose(**problem(seqlen_k=600, causal=True))
    assert calls == [1024, 2048, None, 1024]


def test_seqlen_bucket():
    assert [tuned_tables.seqlen_bucket(n) for n in (0, 1, 2, 3, 1000, 65536)] == [1, 1, 2, 4, 1024, 65536]
    assert tuned_tables.seqlen_bucket(65537) is None


def test_current_target_from_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: {0: (9, 0), 1: (8, 6)}[d])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: {0: "NVIDIA H200", 1: "NVIDIA RTX A6000"}[d])
    assert dispatch.current_target() == "sm_90a"
    assert dispatch.device_target(torch.device("cuda", 1)) == ("sm_86", "NVIDIA RTX A6000")
    assert dispatch.current_target("cuda:0") == "sm_90a"


def test_run_log_line(caplog, capsys):
    choice = dispatch.choose(**problem())
    try:
        dispatch.set_logging(False)
        with caplog.at_level("INFO", logger="cutefa"):
            dispatch.log_run(choice, (2, 1024, 16, 128), (2, 1024, 4, 128), False)
        assert caplog.records == []
        dispatch.set_logging(True)
        dispatch.log_run(choice, torch.Size((2, 1024, 16, 128)), (2, 1024, 4, 128), False)
    finally:
        dispatch.set_logging(False)
    line = (
        f"cutefa: ran {heuristic_name()} on sm_80 for q=(2, 1024, 16, 128) k=(2, 1024, 4, 128) causal=False"
    )
    assert [r.getMessage() for r in caplog.records] == [line]
    assert capsys.readouterr().err == line + "\n"  # the stderr of the moment, not the one at set-up


def test_cutefa_log_env_enables_run_logging_to_stderr(isolated):
    code = (
        "from pathlib import Path\n"
        "from cutefa import dispatch as d, tuned_tables\n"
        f"tuned_tables.TUNED_DIR = Path({str(isolated)!r})\n"
        "c = d.choose(target='sm_80', dtype='fp16', head_dim=64, causal=True, seqlen_q=5, seqlen_k=5,"
        " batch=1, heads_q=2, heads_kv=1)\n"
        "d.log_run(c, (1, 5, 2, 64), (1, 5, 1, 64), True)\n"
    )
    env = {**os.environ, "CUTEFA_LOG": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    name = heuristic_name("fp16", 64, causal=True)
    assert (
        proc.stderr.strip() == f"cutefa: ran {name} on sm_80 for q=(1, 5, 2, 64) k=(1, 5, 1, 64) causal=True"
    )
    env["CUTEFA_LOG"] = "0"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert proc.stderr == ""


def test_backward_tables_steer_the_backward_only(isolated, monkeypatch):
    from cutefa.api import backward

    monkeypatch.setattr(
        rules, "IMPLEMENTED", {("sm80", "fwd"): ("fp16", "bf16"), ("sm80", "bwd"): ("fp16", "bf16")}
    )
    default = default_spec("sm80", "bwd", "bf16", 128)
    assert (default.tile_m, default.tile_n, default.stages, default.warps) == DEFAULT_BWD_TILES["sm80"][128]
    other = default.replace(tile_m=128, tile_n=64)
    assert rules.why_invalid(other) is None and other != default
    bwd_entries = [entry(other.name, 2048), entry(default.name, None)]
    write_table(isolated, "sm80_bwd_a100.json", bwd_entries, direction="bwd")
    dispatch.clear_caches()
    choose = backward.choose_bwd
    assert choose("sm_80", torch.bfloat16, 128, False, seqlen_k=1000, gpu_name="NVIDIA A100") == other
    assert choose("sm_80", torch.bfloat16, 128, False, seqlen_k=8192, gpu_name="NVIDIA A100") == default
    assert choose("sm_80", torch.bfloat16, 128, False) == default  # no length: the default tile
    # A backward table never steers the forward, nor a forward table the backward.
    assert dispatch.choose(**problem()).reason.startswith("heuristic")
    write_table(isolated, "sm80_a100.json", [entry(heuristic_name(), None)])
    (isolated / "sm80_bwd_a100.json").unlink()
    dispatch.clear_caches()
    assert choose("sm_80", torch.bfloat16, 128, False, seqlen_k=1000, gpu_name="NVIDIA A100") == default


def test_backward_table_entry_for_a_forward_variant_is_refused(isolated, monkeypatch):
    from cutefa.api import backward

    monkeypatch.setattr(
        rules, "IMPLEMENTED", {("sm80", "fwd"): ("fp16", "bf16"), ("sm80", "bwd"): ("fp16", "bf16")}
    )
    write_table(isolated, "sm80_bwd_a100.json", [entry(heuristic_name(), None)], direction="bwd")
    dispatch.clear_caches()
    default = default_spec("sm80", "bwd", "bf16", 128)
    assert (default.tile_m, default.tile_n, default.stages, default.warps) == DEFAULT_BWD_TILES["sm80"][128]
    assert backward.choose_bwd("sm_80", torch.bfloat16, 128, False, seqlen_k=512, gpu_name="A100") == default


def test_table_direction_is_checked(isolated, caplog):
    write_table(isolated, "sm80_sideways.json", [entry(heuristic_name(), None)], direction="sideways")
    with caplog.at_level("WARNING", logger="cutefa"):
        assert dispatch.choose(**problem()).reason.startswith("heuristic")
    assert "direction='sideways'" in caplog.text


def test_centered_v_takes_the_v_centered_entries(isolated, monkeypatch):
    """An fp8 problem whose v was centered (flash_attn_func(v_mean=)) takes a table's v_centered
    entries where it has them and the plain entries where not; other problems never take them.
    v_centered is checked in the table (a bool, e4m3 entries only) and in the call."""
    monkeypatch.setattr(rules, "IMPLEMENTED", SPACE_IMPLEMENTED)
    two_level = "cutefa_sm90_fwd_e4m3_hd128_192x96_s2_w16_ov_hvt_lres_tlacc"
    plain = "cutefa_sm90_fwd_e4m3_hd128_192x96_s2_w16_ov_hvt_lres"
    hd256 = "cutefa_sm90_fwd_e4m3_hd256_128x96_s2_w12_ov_pp_hvt_lres"
    e4m3 = {"dtype": "e4m3"}
    entries = [
        entry(two_level, None, **e4m3),
        entry(plain, None, v_centered=True, **e4m3),
        entry(hd256, None, head_dim=256, **e4m3),
    ]
    write_table(isolated, "sm90_h200.json", entries, arch="sm90", gpu="H200", target="sm_90a")
    h200 = problem(target="sm_90a", dtype="e4m3", gpu_name="NVIDIA H200")
    assert dispatch.choose(**h200).spec.name == two_level
    centered = dispatch.choose(**h200, v_centered=True)
    assert centered.spec.name == plain and "v_centered=True" in centered.reason
    assert dispatch.choose(**h200, v_centered=False).spec.name == two_level  # memoized apart
    # (hd256 has no centered entry: the plain one)
    assert dispatch.choose(**{**h200, "head_dim": 256}, v_centered=True).spec.name == hd256
    text = dispatch.explain_problem(**h200, v_centered=True)
    assert "v centered" in text and f"chosen: {plain}" in text
    with pytest.raises(ValueError, match="v_centered applies to e4m3"):
        dispatch.choose(**problem(), v_centered=True)
    with pytest.raises(TypeError, match="v_centered must be a bool"):
        dispatch.choose(**h200, v_centered=1)
    with pytest.raises(ValueError, match="true only on e4m3 entries"):
        tuned_tables.load_table(
            write_table(isolated, "bad.json", [entry(heuristic_name(), None, v_centered=True)])
        )


def test_tables_cleared_while_being_read_are_still_returned(monkeypatch):
    """clear_caches from another thread while the tuned tables are read: it waits for the reading,
    the reader gets the tables it read (never None), and the next look-up reads them again."""
    cleared = threading.Event()
    reads = []

    def read():
        reads.append(len(reads))
        if len(reads) == 1:
            threading.Thread(target=lambda: (dispatch.clear_caches(), cleared.set())).start()
            assert not cleared.wait(0.2), "the clear did not wait for the reading under way"
        return []

    monkeypatch.setattr(tuned_tables, "_read_tables", read)
    assert tuned_tables.tuned_tables() == []
    assert cleared.wait(10)
    assert tuned_tables.tuned_tables() == [] and reads == [0, 1]


def test_a_choice_made_across_a_clear_is_not_memoized(monkeypatch):
    """A choice whose search a clear_caches overtook (from another thread; here inside the search)
    is returned but not memoized: it may rest on the tables from before the clear."""
    search = dispatch._search

    def search_then_clear(p):
        found = search(p)
        dispatch.clear_caches()
        return found

    monkeypatch.setattr(dispatch, "_search", search_then_clear)
    assert dispatch.choose(**problem()).spec.name == heuristic_name()
    assert not dispatch._CHOICES
    monkeypatch.setattr(dispatch, "_search", search)
    dispatch.choose(**problem())
    assert len(dispatch._CHOICES) == 1
