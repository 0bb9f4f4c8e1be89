"""The cutefa command, run in-process: listings, generate --check, show, and user errors."""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass

import pytest

from cutefa import cli
from cutefa.model import committed, rules
from cutefa.model.options import DqLayout
from cutefa.model.spec import Features, VariantSpec

TEMPLATE = '"""{{ name }}"""\nTHREADS = {{ spec.threads }}\n'
DEFAULTS = [s for arch in ("sm80", "sm90", "sm100") for s in committed.default_variants(arch)]


@pytest.fixture
def dirs(tmp_path):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "fwd_sm80.py.j2").write_text(TEMPLATE)
    (templates / "fwd_sm100.py.j2").write_text(TEMPLATE)
    (templates / "fwd_sm90.py.j2").write_text(TEMPLATE)
    (templates / "fwd_sm90_fp8.py.j2").write_text(TEMPLATE)
    (templates / "bwd_sm80.py.j2").write_text(TEMPLATE)
    (templates / "bwd_sm100.py.j2").write_text(TEMPLATE)
    (templates / "bwd_sm90.py.j2").write_text(TEMPLATE)
    (templates / "bwd_sm90_hsplit.py.j2").write_text(TEMPLATE)
    (templates / "bwd_sm90_swapkv.py.j2").write_text(TEMPLATE)
    return ["--out-dir", str(tmp_path / "generated"), "--templates-dir", str(templates)]


def _names(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines() if line.startswith("cutefa_")]


def _row(text: str, name: str) -> list[str]:
    """The cells of the table row that starts with ``name``."""
    line = next(line for line in text.splitlines() if line.split() and line.split()[0] == name)
    return re.split(r"\s{2,}", line)


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("list", "generate", "compile", "show", "explain", "bench", "tune"):
        assert command in out


def test_no_command(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_list_defaults(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert re.split(r"\s{2,}", out.splitlines()[0]) == ["name", "smem KiB", "est regs", "status"]
    assert _names(out) == [s.name for s in DEFAULTS]
    name = "cutefa_sm80_fwd_bf16_hd64_128x64_s1_w4_causal"
    assert _row(out, name) == [name, "33.0", "224", "ok (hardware-tested on H200 (sm_90a))"]
    assert out.endswith(f"{len(DEFAULTS)} variant(s)\n")


@pytest.mark.parametrize("pattern", ["sm80_fwd_bf16*hd128*", "cutefa_sm80_fwd_bf16*hd128*"])
def test_list_glob(capsys, pattern):
    assert cli.main(["list", "--kernels", pattern]) == 0
    names = _names(capsys.readouterr().out)
    assert names == [
        s.name for s in DEFAULTS if (s.arch, s.direction, s.dtype, s.head_dim) == ("sm80", "fwd", "bf16", 128)
    ]
    assert len(names) >= 2  # the default, causal and not


def test_list_all_and_invalid(capsys):
    assert cli.main(["list", "--all", "--arch", "sm80"]) == 0
    assert _names(capsys.readouterr().out) == [s.name for s in rules.valid_variants("sm80")]
    assert cli.main(["list", "--invalid", "--arch", "sm90", "--kernels", "*hd64_64x64*"]) == 0
    out = capsys.readouterr().out
    assert "cutefa_sm90_fwd_e4m3_hd64_64x64_s2_w8_hvt  " in out  # e4m3 candidates carry their dtype flag
    assert "the sm90 fp8 forward runs two or three consumer warpgroups" in out
    assert "pingpong needs two or three consumer warpgroups" in out
    assert " ok" not in out


def test_list_marks_untested_hardware(capsys, monkeypatch):
    blackwell = VariantSpec("sm100", "fwd", "bf16", 128, 128, 128, 2, 16)
    monkeypatch.setattr(rules, "IMPLEMENTED", {("sm100", "fwd"): ("bf16",)})
    assert cli.main(["list", "--all", "--arch", "sm100", "--kernels", blackwell.name]) == 0
    assert "ok (compiled, not hardware-tested)" in capsys.readouterr().out


def test_list_user_errors(capsys):
    assert cli.main(["list", "--kernels", "nothing*"]) == 2
    assert "--kernels 'nothing*' matches none" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["list", "--arch", "sm70"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--arch" in err and "'sm70'" in err and "sm80" in err
    with pytest.raises(SystemExit):
        cli.main(["list", "--all", "--invalid"])


def test_generate_and_check(capsys, dirs, tmp_path):
    assert cli.main(["generate", "--check", *dirs]) == 1
    assert "missing: generated/sm80/" in capsys.readouterr().out
    assert cli.main(["generate", *dirs]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"generated {len(DEFAULTS)} variants into ")
    assert f"{len(DEFAULTS) + 1} file(s) written, 0 removed" in out
    assert cli.main(["generate", "--check", *dirs]) == 0
    assert "is up to date" in capsys.readouterr().out

    edited = tmp_path / "generated" / "sm80" / f"{DEFAULTS[0].name}.py"
    edited.write_text("# hand edit\n")
    assert cli.main(["generate", "--check", *dirs]) == 1
    out = capsys.readouterr().out
    assert f"differs: generated/sm80/{DEFAULTS[0].name}.py" in out
    assert "is out of date" in out
    assert cli.main(["generate", "--kernels", DEFAULTS[0].name, *dirs]) == 0
    assert "1 file(s) written" in capsys.readouterr().out  # the module; the manifest follows the disk
    assert cli.main(["generate", "--check", *dirs]) == 0


def test_generate_all_renders_the_alternatives_for_review(capsys, dirs, tmp_path, monkeypatch):
    from cutefa.model.committed import default_variants
    from cutefa.model.rules import valid_variants

    templates = dirs[dirs.index("--templates-dir") + 1]
    assert cli.main(["generate", "--all", "--templates-dir", templates]) == 2  # not into generated/
    assert "--all renders every valid variant" in capsys.readouterr().err

    # the committed set plus the measured alternatives, listed in tools/alternatives.py
    review = tmp_path / "review"
    listed = cli._all_variants("sm80")
    assert set(default_variants("sm80")) < set(listed) and all(s.arch == "sm80" for s in listed)
    argv = ["generate", "--all", "--arch", "sm80", "--templates-dir", templates]
    assert cli.main([*argv, "--out", str(review)]) == 0
    assert f"generated {len(listed)} variants into {review}" in capsys.readouterr().out
    assert sorted(p.stem for p in (review / "sm80").glob("*.py")) == sorted(s.name for s in listed)

    # an installed cutefa has no tools/: every valid variant of the grid
    monkeypatch.setattr(cli, "ALTERNATIVES_SCRIPT", tmp_path / "nowhere.py")
    grid = {s for d in ("fwd", "bwd") for s in (*valid_variants("sm80", d), *default_variants("sm80", d))}
    other = tmp_path / "other"
    assert cli.main([*argv, "--out", str(other)]) == 0
    assert "is not here: rendering every valid variant of the grid" in capsys.readouterr().err
    assert sorted(p.stem for p in (other / "sm80").glob("*.py")) == sorted(s.name for s in grid)


def test_show(capsys, dirs):
    assert cli.main(["show", "sm80_fwd_bf16_hd64_128x64_s1_w4_causal", "--source", *dirs]) == 0
    out = capsys.readouterr().out
    for line in (
        "tile_n          64",
        "smem_bytes      33792 (33.0 KiB)",
        "est_registers   224",
        "valid           yes",
        "in default set  yes",
        "(not generated)",
        "# Generated by cutefa from templates/fwd_sm80.py.j2 -- do not edit.",
        "THREADS = 128",
    ):
        assert line in out


def test_show_invalid(capsys):
    name = "cutefa_sm80_fwd_bf16_hd128_128x128_s1_w4"
    assert cli.main(["show", name]) == 0
    assert (
        "valid           no: would spill registers (estimated 384 > 255 per thread)"
        in capsys.readouterr().out
    )
    assert cli.main(["show", name, "--source"]) == 2
    assert "--source: cannot render" in capsys.readouterr().err
    assert cli.main(["show", "cutefa_sm80_fwd_bf16_hd128"]) == 2
    assert "NAME: not a cutefa variant name" in capsys.readouterr().err


def test_tune_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_local_target", lambda: None)
    assert cli.main(["tune", "--arch", "sm80"]) == 2
    assert "a CUDA GPU is required to tune" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--arch", "sm80", "--seqlens", "0"])
    assert exc.value.code == 2
    assert "not a comma-separated list of positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--arch", "sm80", "--rounds", "0"])
    assert exc.value.code == 2
    assert "'0' is not a positive integer" in capsys.readouterr().err


def test_tune_refuses_a_family_without_kernels(capsys, monkeypatch):
    from cutefa.model import committed

    monkeypatch.setattr(cli, "_local_target", lambda: "sm_90a")
    monkeypatch.setattr(committed, "default_variants", lambda arch, direction=None: [])
    assert cli.main(["tune", "--arch", "sm90"]) == 2
    assert "no sm90 fwd kernel exists yet" in capsys.readouterr().err


def test_tune_takes_e4m3_for_the_forward_only(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_local_target", lambda: "sm_90a")
    assert cli.main(["tune", "--arch", "sm90", "--direction", "bwd", "--dtype", "bf16,e4m3"]) == 2
    assert "there is no fp8 backward to tune" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--arch", "sm90", "--dtype", "fp32"])
    assert exc.value.code == 2
    assert "give fp16, bf16 and/or e4m3" in capsys.readouterr().err


def test_bench_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_local_target", lambda: None)
    assert cli.main(["bench", "--help"]) == 2
    assert "a CUDA GPU is required" in capsys.readouterr().err


def test_explain(capsys, monkeypatch):
    """cutefa explain asks dispatch through the API's explain (its checks on meta tensors)."""
    import torch

    from cutefa.api import attention

    calls = []
    monkeypatch.setattr(
        attention.dispatch, "explain_problem", lambda **kwargs: calls.append(kwargs) or "would run X"
    )
    assert cli.main(["explain", "--shape", "2,1024,4096,32,8,128", "--causal", "--gpu", "sm_90a"]) == 0
    assert capsys.readouterr().out == "would run X\n"
    assert calls == [
        {
            "target": "sm_90a",
            "gpu_name": None,
            "dtype": torch.bfloat16,
            "causal": True,
            "batch": 2,
            "seqlen_q": 1024,
            "seqlen_k": 4096,
            "heads_q": 32,
            "heads_kv": 8,
            "head_dim": 128,
            "v_centered": False,
            "local": False,
            "features": Features(),
            "total_q": None,
        }
    ]
    argv = ["explain", "--shape", "1,4096,4096,8,8,128", "--dtype", "e4m3", "--v-centered", "--gpu", "sm_90a"]
    assert cli.main(argv) == 0
    assert calls[-1]["dtype"] == torch.float8_e4m3fn and calls[-1]["v_centered"] is True


def test_explain_user_errors(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_local_target", lambda: None)
    assert cli.main(["explain", "--shape", "1,128,128,8,8,64"]) == 2
    assert "give --gpu" in capsys.readouterr().err
    assert cli.main(["explain", "--shape", "1,128,128,8,8,64", "--v-centered", "--gpu", "sm_90a"]) == 2
    assert "v_centered applies to e4m3" in capsys.readouterr().err
    for shape in ("1,2,3", "1,2,3,4,5,x", "0,128,128,8,8,64"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["explain", "--shape", shape, "--gpu", "sm_90a"])
        assert exit_info.value.code == 2
        assert "argument --shape" in capsys.readouterr().err


@dataclass
class _Result:
    spec: VariantSpec
    ok: bool
    seconds: float
    error: str | None = None
    path: str | None = None


def _fake_compile(monkeypatch, calls):
    def compile_variants(specs, *, target, jobs, progress):
        calls.append((list(specs), target, jobs))
        return [_Result(s, i != 0, 1.5, None if i else "boom") for i, s in enumerate(specs)]

    fake = types.ModuleType("cutefa.compile")
    fake.compile_variants = compile_variants
    monkeypatch.setitem(sys.modules, "cutefa.compile", fake)


def test_compile_plan_and_summary(capsys, monkeypatch):
    calls = []
    _fake_compile(monkeypatch, calls)
    planned = committed.default_variants("sm90") + committed.default_variants(
        "sm80"
    )  # every family sm_90a runs
    assert cli.main(["compile", "--target", "sm_90a", "--jobs", "3"]) == 1
    assert calls == [(planned, "sm_90a", 3)]
    captured = capsys.readouterr()
    assert f"{len(planned) - 1} compiled, 1 failed in " in captured.out
    assert _row(captured.out, planned[0].name) == [planned[0].name, "FAILED", "1.5"]
    assert _row(captured.out, planned[1].name) == [planned[1].name, "ok", "1.5"]
    assert "boom" in captured.err
    assert cli.main(["compile", "--arch", "sm80", "--kernels", "*hd64*"]) == 1
    assert calls[-1][1] == "sm_80" and all(s.head_dim == 64 for s in calls[-1][0])


def test_compile_leaves_out_what_the_target_cannot_hold(capsys, monkeypatch):
    from cutefa.model import committed
    from cutefa.model.rules import why_invalid, why_not_on

    calls = []
    _fake_compile(monkeypatch, calls)
    # FlashAttention-2's hd256 backward tile with Q double-buffered: 182 KiB
    big = VariantSpec("sm80", "bwd", "bf16", 256, 64, 64, 2, 8, dq_layout=DqLayout.TILE)
    assert why_invalid(big) is None
    assert why_not_on(big, "sm_80") is not None and why_not_on(big, "sm_90a") is None
    real = committed.default_variants
    with_big = lambda arch, direction=None: real(arch, direction) + [big] * (arch == "sm80")
    monkeypatch.setattr(committed, "default_variants", with_big)
    sm80 = committed.default_variants("sm80")
    cli.main(["compile", "--arch", "sm80"])
    assert calls[-1][1] == "sm_80"
    assert big not in calls[-1][0] and calls[-1][0] == [s for s in sm80 if s != big]
    assert "leaving out 1 variant(s) whose shared memory is over the 163 KiB" in capsys.readouterr().err
    cli.main(["compile", "--target", "sm_90a", "--arch", "sm80"])
    assert big in calls[-1][0]
    assert cli.main(["compile", "--target", "sm_80", "--kernels", big.name]) == 2
    assert "cannot run on --target sm_80: needs 182.0 KiB" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["compile"], "give --family"),
        (
            ["compile", "--arch", "sm90", "--target", "sm_100a"],
            "--family sm90 kernels cannot run on --target sm_100a",
        ),
        (["compile", "--family", "sm90,sm80"], "--family sm90,sm80: give --target"),
    ],
)
def test_compile_user_errors(capsys, argv, words):
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err


def test_compile_refuses_a_family_without_variants(capsys, monkeypatch):
    from cutefa.model import committed

    monkeypatch.setattr(committed, "default_variants", lambda arch, direction=None: [])
    assert cli.main(["compile", "--arch", "sm90"]) == 2
    assert "no sm90 variants yet" in capsys.readouterr().err


def test_compile_rejects_bad_jobs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compile", "--arch", "sm80", "--jobs", "0"])
    assert "argument --jobs: '0' is not a positive integer" in capsys.readouterr().err


def test_version(capsys):
    import cutefa

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cutefa {cutefa.__version__}"


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ("2,4096,4096,30,8,128", "multiple of k/v's heads"),
        ("2,4096,4096,32,8,100", "head_dim=100 is not supported"),
        ("1,1,1,70000,1,64", "heads_q=70000 is over"),
    ],
)
def test_explain_refuses_what_the_api_refuses(capsys, shape, message):
    """cutefa explain --shape runs the API's checks (on meta tensors): a one-line error, no traceback."""
    assert cli.main(["explain", "--shape", shape, "--gpu", "sm_90a"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_explain_a_varlen_call_with_a_window(capsys):
    """cutefa explain says a varlen call is one, and names the window and softcap it was asked about."""
    argv = ["explain", "--shape", "64,300,300,32,8,128", "--gpu", "sm_90a", "--causal", "--varlen", "--window", "256,0",
            "--softcap", "30"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("cutefa forward: varlen: 64 sequences, max_seqlen_q=300 max_seqlen_k=300")
    assert "sliding window softcap" in out and "_local_varlen_softcap_" in out
    assert cli.main([*argv[:-2], "--softcap", "-1"]) == 2
    assert "softcap must be finite and >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", "--shape", "1,8,8,4,4,64", "--gpu", "sm_90a", "--window", "3"])
    assert exc.value.code == 2 and "is not LEFT,RIGHT" in capsys.readouterr().err
