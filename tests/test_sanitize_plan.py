"""tools/sanitize.py on the CPU: the plan (every default family and direction, the ragged cases, one
small launch for racecheck), the commands it builds, finding the sanitizer, reading its reports
(faked), and a whole invocation against a fake compute-sanitizer that writes a canned report."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
from cpu_support import load_tool

from cutefa.model.defaults import default_spec

sanitize = load_tool("sanitize")
sanitize_drive = load_tool("sanitize_drive")

MEMCHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at 0x1f30 in kernel_cutlass_kernel_flash_fwd_0
=========     by thread (12,0,0) in block (7,1,0)
=========     Address 0x7f00001000 is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f1e0] in libcuda.so.1
=========
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaFuncGetAttributes.
=========     Saved host backtrace up to driver entry point at error
=========
========= ERROR SUMMARY: 2 errors
"""

RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at kernel_cutlass_bwd+0x4a0
=========     and Read access at kernel_cutlass_bwd+0x5f0 [128 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""

CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"


def test_plan_covers_every_default_family_and_direction():
    runs, skipped = sanitize.plan(list(sanitize.TOOLS), list(sanitize.KERNELS), [64, 128, 256], "sm_90a")
    assert skipped == []
    assert len(runs) == 4 * 5 * 3
    specs = {(r.kernel, r.hdim): r.spec for r in runs}
    assert specs[("sm80_fwd", 128)] == default_spec("sm80", "fwd", "bf16", 128).name
    assert specs[("sm80_bwd", 256)] == default_spec("sm80", "bwd", "bf16", 256).name
    assert specs[("sm90_fwd", 64)] == default_spec("sm90", "fwd", "bf16", 64).name
    assert specs[("sm90_bwd", 128)] == default_spec("sm90", "bwd", "bf16", 128).name
    assert specs[("sm90_fwd_e4m3", 256)] == default_spec("sm90", "fwd", "e4m3", 256).name
    assert all("causal" not in spec for spec in specs.values())  # causal cases run the twin
    assert {r.tool for r in runs} == set(sanitize.TOOLS)


def test_ragged_cases_and_a_single_small_racecheck_launch():
    cases = sanitize.cases_for("memcheck")
    assert cases == sanitize.cases_for("initcheck") == sanitize.cases_for("synccheck")
    seqlens = {(sq, sk) for _, sq, sk, *_ in cases}
    assert {(1, 1), (17, 17), (1000, 1000), (1000, 17), (17, 1000)} <= seqlens
    for s in (1, 17, 1000):
        assert {c[-1] for c in cases if c[1] == c[2] == s} == {False, True}
    assert any(hq != hkv for _, _, _, hq, hkv, _ in cases)  # GQA
    (race,) = sanitize.cases_for("racecheck")
    batch, sq, sk, hq, hkv, _ = race
    assert batch == 1 and sq == sk <= 256 and hq * hkv <= 2


def test_the_plan_leaves_out_what_the_target_cannot_run():
    runs, skipped = sanitize.plan(["memcheck"], ["sm90_fwd", "sm80_fwd"], [128], "sm_80")
    assert [r.kernel for r in runs] == ["sm80_fwd"]
    assert len(skipped) == 1 and skipped[0].startswith("sm90_fwd hd128: family sm90 does not run on sm_80")


def test_commands(tmp_path):
    run = sanitize.Run("initcheck", "sm90_fwd", 128, "cutefa_x", ((1, 17, 17, 2, 2, True),))
    cmd = sanitize.sanitizer_command("/opt/cs", run, tmp_path / "a.log")
    assert cmd[:3] == ["/opt/cs", "--tool", "initcheck"]
    assert cmd[cmd.index("--log-file") + 1] == str(tmp_path / "a.log")
    assert cmd[cmd.index("--drive") - 2 :][:2] == [
        sys.executable,
        str(sanitize.Path(sanitize.__file__).resolve()),
    ]
    payload = json.loads(cmd[-1])
    assert payload == {
        "spec": "cutefa_x",
        "cases": [[1, 17, 17, 2, 2, True]],
        "poison": False,
        "check": False,
    }
    race = sanitize.sanitizer_command(
        "/opt/cs", sanitize.Run("racecheck", "k", 64, "s", ()), tmp_path / "r.log"
    )
    assert (
        "--racecheck-report" in race and json.loads(race[-1])["poison"] is True
    )  # initcheck alone: unpoisoned
    old = sanitize.sanitizer_command("/opt/cs", run, tmp_path / "a.log", help_text="--tool --log-file")
    assert (
        "--target-processes" not in old and "--print-limit" not in old and old[1:3] == ["--tool", "initcheck"]
    )
    env = sanitize.run_env()
    assert env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(sanitize.REPO)


def test_reports_are_read():
    found = sanitize.parse_report(MEMCHECK_ERRORS)
    assert found["errors"] == 2 and found["warnings"] is None
    heads = [r["headline"] for r in found["records"]]
    assert heads == [
        "Invalid __global__ read of size 16 bytes",
        'Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaFuncGetAttributes.',
    ]
    assert found["cutefa"] == 1 and found["records"][0]["detail"][0].startswith("at 0x1f30 in kernel_cutlass")
    race = sanitize.parse_report(RACECHECK)
    assert (race["errors"], race["warnings"], race["cutefa"]) == (1, 0, 1)
    assert sanitize.parse_report(CLEAN) == {"errors": 0, "warnings": None, "records": [], "cutefa": 0}
    assert sanitize.parse_report("Segmentation fault")["errors"] is None


def _outcome(text, exit_code=0, timed_out=False):
    run = sanitize.Run("memcheck", "sm90_fwd", 128, "cutefa_sm90_fwd_bf16_hd128_x", ((1, 1, 1, 2, 2, False),))
    return sanitize.outcome_of(run, ["cs"], text, exit_code, 12.3, timed_out, sanitize.Path("x.log"))


def test_statuses():
    assert _outcome(CLEAN).status == "clean" and _outcome(CLEAN).clean
    bad = _outcome(MEMCHECK_ERRORS)
    assert bad.status == "2 errors (1 in cutefa kernels)" and not bad.clean
    assert _outcome("", exit_code=-11).status == "failed (exit -11, no summary)"
    assert _outcome("", exit_code=None, timed_out=True).status == "timeout"
    crashed = _outcome(CLEAN, exit_code=1)
    assert crashed.status == "0 errors, but the driver exited 1" and not crashed.clean


def test_the_table_is_kernel_by_tool(tmp_path):
    a = _outcome(CLEAN)
    b = _outcome(MEMCHECK_ERRORS)
    b.tool, b.key = "racecheck", "racecheck:" + b.spec
    text = sanitize.write_summary(tmp_path, {a.key: a, b.key: b}, {a.spec: "ok"}, {"gpu": "H100"})
    lines = text.splitlines()
    assert lines[0] == "| kernel | variant | memcheck | racecheck | outputs checked |"
    assert lines[2] == f"| sm90_fwd hd128 | {a.spec} | clean | 2 errors (1 in cutefa kernels) | ok |"
    blob = json.loads((tmp_path / "sanitize.json").read_text())
    assert {r["status"] for r in blob["runs"]} == {"clean", "2 errors (1 in cutefa kernels)"}
    again, prepared = sanitize.load_previous(tmp_path / "sanitize.json")
    assert set(again) == {a.key, b.key} and prepared == {a.spec: "ok"} and again[b.key].status == b.status


def test_the_sanitizer_is_found_or_a_clear_error(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert sanitize.find_sanitizer(str(fake)) == str(fake)
    monkeypatch.setenv("PATH", str(fake.parent))
    assert sanitize.find_sanitizer() == str(fake)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sanitize.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(sanitize.Path, "is_file", lambda self: False)
    with pytest.raises(SystemExit, match="compute-sanitizer not found.*PATH.*--sanitizer"):
        sanitize.find_sanitizer()


def test_a_whole_invocation_against_a_fake_sanitizer(tmp_path, capsys):
    """A fake compute-sanitizer that runs nothing and writes a clean report for every tool but
    racecheck: the table, the JSON, the exit status, and a later invocation adding to the same folder."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--help" ]; then echo "--tool --log-file --target-processes --print-limit --racecheck-report"; exit 0; fi\n'
        'if [ "$1" = "--version" ]; then echo "Version 2099.1"; exit 0; fi\n'
        'tool="$2"; log=""\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "--log-file" ]; then log="$2"; fi; shift; done\n'
        'if [ "$tool" = racecheck ]; then printf "%s" "$RACE" > "$log"; else printf "%s" "$CLEAN" > "$log"; fi\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    os.environ["RACE"], os.environ["CLEAN"] = RACECHECK, CLEAN
    try:
        out = tmp_path / "out"
        common = ["--out", str(out), "--sanitizer", str(fake), "--target", "sm_90a", "--no-prepare"]
        code = sanitize.main(
            [*common, "--tools", "memcheck", "--kernels", "sm90_fwd,sm80_bwd", "--hdim", "128"]
        )
        assert code == 0
        code = sanitize.main([*common, "--tools", "racecheck", "--kernels", "sm90_fwd", "--hdim", "128"])
        assert code == 1  # the racecheck run is not clean
    finally:
        del os.environ["RACE"], os.environ["CLEAN"]
    text = capsys.readouterr().out
    assert "| sm90_fwd hd128 |" in text and "1 errors (1 in cutefa kernels)" in text
    blob = json.loads((out / "sanitize.json").read_text())
    assert sorted(r["key"].split(":")[0] for r in blob["runs"]) == ["memcheck", "memcheck", "racecheck"]
    assert (out / "sanitize.md").read_text().startswith("# compute-sanitizer")
    assert blob["meta"]["version"] == ["Version 2099.1"]


def test_plan_only_needs_no_gpu(capsys):
    assert sanitize.main(["--plan", "--target", "sm_90a", "--tools", "racecheck", "--hdim", "64"]) == 0
    out = capsys.readouterr().out
    assert "10 runs for sm_90a" in out and "(1 case)" in out  # 5 dense kernels, 5 feature groups
    assert sanitize.main(["--plan", "--target", "sm_90a", "--tools", "memcheck", "--kernels", "dense"]) == 0
    assert "15 runs for sm_90a" in capsys.readouterr().out


def test_plan_covers_the_feature_and_decode_kernels():
    """The groups the dispatcher runs for packed sequences, windows and decode: the default variant
    with the feature axes, the sm80 backward on a Hopper target, the paged split-KV decode variant."""
    from cutefa.model.options import Mask
    from cutefa.model.spec import parse_name

    runs, skipped = sanitize.plan(["memcheck"], list(sanitize.FEATURE_KERNELS), [64, 128, 256], "sm_90a")
    assert skipped == [] and len(runs) == 5 * 3
    for kernel, hdim, name in ((r.kernel, r.hdim, r.spec) for r in runs):
        spec = parse_name(name)
        assert spec.head_dim == hdim and not spec.causal
        if kernel == "sm80_decode":
            assert spec.arch == "sm80" and spec.features.paged_kv and spec.features.split_kv
        else:
            arch, direction = kernel.split("_")[:2]
            default = default_spec(arch, direction, "bf16", hdim)
            assert (spec.arch, spec.direction, spec.tile_m, spec.tile_n) == (
                arch, direction, default.tile_m, default.tile_n,
            )  # fmt: skip
            assert spec.features.varlen == kernel.endswith("varlen")
            assert (spec.mask is Mask.LOCAL) == kernel.endswith("local")
    runs, skipped = sanitize.plan(["memcheck"], list(sanitize.FEATURE_KERNELS), [128], "sm_80")
    assert sorted(r.kernel for r in runs) == ["sm80_bwd_local", "sm80_bwd_varlen", "sm80_decode"]
    assert len(skipped) == 2 and all("does not run on sm_80" in why for why in skipped)


def test_feature_cases_are_ragged():
    varlen = sanitize.cases_for("memcheck", "sm90_fwd_varlen")
    lengths = {n for lq, lk, *_ in varlen for n in (*lq, *lk)}
    assert {0, 1, 17, 1000} <= lengths  # an empty sequence inside the batch
    assert any(lq != lk for lq, lk, *_ in varlen) and {c[-1] for c in varlen} == {False, True}
    assert any(hq != hkv for _, _, hq, hkv, _ in varlen)
    local = sanitize.cases_for("initcheck", "sm80_bwd_local")
    assert {1, 17, 1000} <= {c[1] for c in local} and {c[5] for c in local} == {False, True}
    bench_check = sanitize_features_bench_check()
    assert any(bench_check.rows_without_keys(sq, sk, causal, (left, right))
               for _, sq, sk, _, _, causal, left, right in local)  # fmt: skip
    decode = sanitize.cases_for("synccheck", "sm80_decode")
    assert {c[4] for c in decode} == {16, 64}  # page sizes
    assert {c[5] > 1 for c in decode} == {False, True}  # one split, and several with the combine
    assert {0, 1, 17, 1000} <= {n for c in decode for n in c[0]}
    assert any(hq // hkv > 1 and tokens == 1 for _, tokens, hq, hkv, *_ in decode)  # GQA packed rows
    rows = {tokens * hq // hkv for _, tokens, hq, hkv, *_ in decode}
    assert rows <= {sanitize.sanitize_features.DECODE_ROWS, 2 * sanitize.sanitize_features.DECODE_ROWS}
    for kernel in sanitize.FEATURE_KERNELS:
        (race,) = sanitize.cases_for("racecheck", kernel)
        assert race in sanitize.prepare_cases(kernel)
    assert sanitize.prepare_cases("sm90_fwd") == tuple(dict.fromkeys(sanitize.RAGGED + sanitize.RACE))


def sanitize_features_bench_check():
    sys.path.insert(0, str(sanitize.Path(sanitize.__file__).parent))
    import bench_check

    return bench_check


def test_kernel_groups_and_nested_cases_in_the_payload(tmp_path):
    args = sanitize.parse_args(["--kernels", "features,sm90_fwd"])
    assert args.kernels == [*sanitize.FEATURE_KERNELS, "sm90_fwd"]
    assert sanitize.parse_args([]).kernels == list(sanitize.ALL_KERNELS)
    assert sanitize.parse_args(["--kernels", "dense"]).kernels == list(sanitize.KERNELS)
    case = sanitize.cases_for("memcheck", "sm90_fwd_varlen")[0]
    run = sanitize.Run("memcheck", "sm90_fwd_varlen", 128, "cutefa_x", (case,))
    payload = json.loads(sanitize.sanitizer_command("/opt/cs", run, tmp_path / "a.log")[-1])
    assert payload["cases"] == [[list(case[0]), list(case[1]), *case[2:]]]


def test_bad_arguments_are_refused(capsys):
    for bad in (
        ["--tools", "leakcheck"],
        ["--kernels", "sm100_fwd"],
        ["--kernels", "sm100_decode"],
        ["--hdim", "80"],
        ["--jobs", "0"],
    ):
        with pytest.raises(SystemExit):
            sanitize.parse_args(bad)
    assert "--" in capsys.readouterr().err


def test_the_backward_driver_gets_the_float32_forward():
    """The backward runs are given out (bf16) and lse from the float32 reference, grouped heads and
    bottom-right causal rows without a key included."""
    import torch
    from cpu_support import reference

    sys.path.insert(0, str(sanitize.Path(sanitize.__file__).parent))
    import bench_check

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 4, 16, generator=gen).bfloat16()
    k, v = (torch.randn(2, 5, 2, 16, generator=gen).bfloat16() for _ in range(2))
    out, lse = sanitize_drive._forward_reference(bench_check, q, k, v, True, 0.25)
    expect, expect_lse = reference(q.float(), k.float(), v.float(), True, 0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, expect.bfloat16())
    torch.testing.assert_close(lse, expect_lse)
