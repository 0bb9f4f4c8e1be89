"""Kernel packs on the CPU: manifest, search path, refusals, the JIT fallback and its switch, the
``compile --pack`` command, and (marked ``compile``) real packs loaded through the TVM-FFI C ABI in processes
that never import the DSL.

Fast tests use dummy ``.so`` files with real checksums and fingerprints and stub the loader; the
``compile`` tests build real kernels in child processes, so this pytest process never imports
``cutlass``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import timeit
from pathlib import Path

import pytest
import torch
from cpu_support import pretend_h200

import cutefa
from cutefa import cli, codegen, dispatch, ops, pack, space
from cutefa import compile as cc
from cutefa.spec import VariantSpec

TINY = Path(__file__).with_name("tiny_kernel.py")
TARGET = "sm_90a"
SPEC = next(s for s in space.default_variants("sm80") if s.direction == "fwd" and s.head_dim == 64)
OTHER = next(s for s in space.default_variants("sm80") if s.direction == "fwd" and s.head_dim == 128)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty cache, no kernel path, JIT allowed, fresh memo tables, the loader stubbed."""
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTEFA_KERNEL_PATH", raising=False)
    monkeypatch.delenv("CUTEFA_JIT", raising=False)
    monkeypatch.setattr(cc, "_KERNELS", {})
    monkeypatch.setattr(cc, "_ORIGINS", {})
    monkeypatch.setattr(pack, "_MANIFESTS", {})
    loads = []

    def load_library(path, function_name, runtime):
        loads.append((Path(path), function_name, runtime))
        return ("kernel", Path(path))

    monkeypatch.setattr(cc, "load_library", load_library)
    return loads


def write_pack(directory: Path, specs, *, target=TARGET, **overrides) -> Path:
    """A pack of dummy kernel files with true checksums and this cutefa's fingerprints."""
    directory.mkdir(parents=True, exist_ok=True)
    kernels = {}
    for spec in specs:
        data = f"not really an ELF: {spec.name}".encode()
        (directory / f"{spec.name}.so").write_bytes(data)
        kernels[spec.name] = {
            "family": spec.arch,
            "direction": spec.direction,
            "file": f"{spec.name}.so",
            "sha256": hashlib.sha256(data).hexdigest(),
            "fingerprint": cc.fingerprint(spec, target),
            "function_name": spec.name,
            "runtime": "cu12",
            "compile_seconds": 1.0,
        }
    manifest = {
        "format": pack.FORMAT,
        "target": target,
        "dsl_version": cc.dsl_version(),
        "abi": cc.ABI,
        "cutefa_version": "0.1.0",
        "updated": "2026-11-29T00:00:00+0000",
        "kernels": kernels,
    } | overrides
    (directory / pack.MANIFEST).write_text(json.dumps(manifest))
    return directory


def use_path(monkeypatch, *dirs: Path) -> None:
    monkeypatch.setenv("CUTEFA_KERNEL_PATH", os.pathsep.join(str(d) for d in dirs))


# ---------------------------------------------------------------------------------------------
# Sources and manifests


def test_committed_sources_are_read_from_codegens_folder():
    assert cc.GENERATED_DIR == codegen.GENERATED_DIR
    assert cc.kernel_source_path(SPEC) == codegen.module_path(SPEC)


def test_read_pack_round_trip(tmp_path):
    path = write_pack(tmp_path / "p", [SPEC, OTHER])
    p = pack.read_pack(path)
    assert (p.format, p.target, p.dsl_version, p.abi) == (pack.FORMAT, TARGET, cc.dsl_version(), cc.ABI)
    record = p.kernels[SPEC.name]
    assert (record.family, record.direction, record.file, record.runtime) == (
        "sm80",
        "fwd",
        f"{SPEC.name}.so",
        "cu12",
    )
    assert record.fingerprint == cc.fingerprint(SPEC, TARGET)
    assert pack.why_refused(p, TARGET) is None
    assert pack.verify_kernel(p, record, record.fingerprint) is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{not json", "is not valid JSON"),
        (json.dumps({"format": pack.FORMAT}), "does not follow the cutefa-pack/1 manifest format: KeyError"),
        (json.dumps([1, 2]), "does not follow"),
    ],
)
def test_read_pack_reports_malformed_manifests(tmp_path, text, words):
    (tmp_path / pack.MANIFEST).write_text(text)
    with pytest.raises(pack.PackError, match=words):
        pack.read_pack(tmp_path)
    with pytest.raises(pack.PackError, match="cannot read"):
        pack.read_pack(tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------------
# Search path and refusals


def test_search_order_kernel_path_then_cache_packs(env, tmp_path, monkeypatch):
    first = write_pack(tmp_path / "first", [SPEC])
    holder = tmp_path / "holder"  # a directory of packs, one level down
    write_pack(holder / "a", [OTHER])
    write_pack(holder / "b", [SPEC, OTHER])
    cached = write_pack(pack.default_pack_dir(TARGET), [SPEC, OTHER])
    assert pack.search_dirs() == [cc.cache_dir() / "packs"]

    use_path(monkeypatch, tmp_path / "missing", first, holder)
    assert pack.search_dirs()[:3] == [tmp_path / "missing", first, holder]
    found, refusals = pack.find_kernel(SPEC.name, TARGET, cc.fingerprint(SPEC, TARGET))
    assert (found.pack, found.path, refusals) == (first, first / f"{SPEC.name}.so", [])
    found, _ = pack.find_kernel(OTHER.name, TARGET, cc.fingerprint(OTHER, TARGET))
    assert found.pack == holder / "a"

    use_path(monkeypatch)
    found, _ = pack.find_kernel(OTHER.name, TARGET, cc.fingerprint(OTHER, TARGET))
    assert found.pack == cached  # <cache dir>/packs/<target> is searched with no setting at all
    assert pack.find_kernel("cutefa_sm80_fwd_bf16_hd96_64x64_s1_w4", TARGET, None) == (None, [])


REFUSALS = {
    "target": ({"target": "sm_80"}, "built for target sm_80, but this GPU needs sm_90a"),
    "dsl": ({"dsl_version": "4.0.0"}, "built with nvidia-cutlass-dsl 4.0.0, but 4.8.1 is installed"),
    "abi": ({"abi": "tvm-ffi-v0"}, "kernel calling convention 'tvm-ffi-v0'; this cutefa calls 'tvm-ffi-v1'"),
    "format": (
        {"format": "cutefa-pack/9"},
        "manifest format 'cutefa-pack/9'; this cutefa reads 'cutefa-pack/1'",
    ),
}


@pytest.mark.parametrize("case", REFUSALS, ids=REFUSALS)
def test_pack_mismatches_are_refused_with_the_reason(env, tmp_path, monkeypatch, case):
    overrides, words = REFUSALS[case]
    if case == "dsl":
        monkeypatch.setattr(cc, "dsl_version", lambda: "4.8.1")
    bad = write_pack(tmp_path / "bad", [SPEC], **overrides)
    use_path(monkeypatch, bad)
    found, refusals = pack.find_kernel(SPEC.name, TARGET, cc.fingerprint(SPEC, TARGET))
    assert found is None
    assert refusals == [f"pack {bad}: {words}"]


def test_tampered_missing_and_stale_kernels_are_refused(env, tmp_path, monkeypatch):
    good = cc.fingerprint(SPEC, TARGET)
    p = write_pack(tmp_path / "p", [SPEC])
    use_path(monkeypatch, p)
    so = p / f"{SPEC.name}.so"

    so.write_bytes(so.read_bytes() + b"!")  # tampered (or truncated) after packing
    found, refusals = pack.find_kernel(SPEC.name, TARGET, good)
    assert found is None
    assert f"{SPEC.name}: checksum mismatch: {SPEC.name}.so has sha256" in refusals[0]

    so.unlink()
    assert "cannot read" in pack.find_kernel(SPEC.name, TARGET, good)[1][0]

    write_pack(p, [SPEC])
    found, refusals = pack.find_kernel(SPEC.name, TARGET, "0" * 64)  # this cutefa's sources changed
    assert found is None and "stale: built from other kernel sources" in refusals[0]
    assert pack.find_kernel(SPEC.name, TARGET, None)[0] is not None  # no source here: not checked


def test_a_file_outside_the_pack_is_refused(env, tmp_path, monkeypatch):
    p = write_pack(tmp_path / "p", [SPEC])
    manifest = json.loads((p / pack.MANIFEST).read_text())
    manifest["kernels"][SPEC.name]["file"] = "../elsewhere.so"
    (p / pack.MANIFEST).write_text(json.dumps(manifest))
    use_path(monkeypatch, p)
    assert "is not a plain file name inside the pack" in pack.find_kernel(SPEC.name, TARGET, None)[1][0]


def test_a_later_pack_serves_when_an_earlier_one_is_refused(env, tmp_path, monkeypatch):
    old = write_pack(tmp_path / "old", [SPEC], target="sm_80")
    new = write_pack(tmp_path / "new", [SPEC])
    use_path(monkeypatch, old, new)
    found, refusals = pack.find_kernel(SPEC.name, TARGET, cc.fingerprint(SPEC, TARGET))
    assert found.pack == new and len(refusals) == 1


def test_rewritten_manifests_are_read_again(env, tmp_path, monkeypatch):
    p = write_pack(tmp_path / "p", [OTHER])
    use_path(monkeypatch, p)
    assert pack.find_kernel(SPEC.name, TARGET, None)[0] is None
    write_pack(p, [OTHER, SPEC], updated="later")  # another size: a new cache key
    assert pack.find_kernel(SPEC.name, TARGET, None)[0] is not None


# ---------------------------------------------------------------------------------------------
# get_kernel: pack, cache, JIT, CUTEFA_JIT=0


def test_get_kernel_prefers_a_pack_and_records_the_origin(env, tmp_path, monkeypatch):
    p = write_pack(tmp_path / "p", [SPEC])
    use_path(monkeypatch, p)
    monkeypatch.setattr(cc, "_jit", lambda entry: pytest.fail("a packed kernel must not be compiled"))
    assert cc.get_kernel(SPEC, TARGET) == ("kernel", p / f"{SPEC.name}.so")
    assert env == [(p / f"{SPEC.name}.so", SPEC.name, "cu12")]
    assert cc.loaded_kernels() == {(SPEC.name, TARGET): f"pack {p}"}


def commit_fake(entry: cc._Entry) -> None:
    entry.dir.mkdir(parents=True, exist_ok=True)
    entry.so_path.write_bytes(b"x")
    entry.meta_path.write_text(
        json.dumps({"fingerprint": entry.fingerprint, "function_name": entry.name, "runtime": "cu12"})
    )


def test_get_kernel_falls_back_to_the_cache(env, tmp_path, monkeypatch):
    entry = cc._entry(SPEC, TARGET)
    commit_fake(entry)
    monkeypatch.setenv("CUTEFA_JIT", "0")  # the cache is allowed with JIT off
    assert cc.get_kernel(SPEC, TARGET) == ("kernel", entry.so_path)
    assert cc.loaded_kernels()[(SPEC.name, TARGET)] == f"cache {entry.dir}"


def test_jit_off_names_the_variant_and_the_command(env, tmp_path, monkeypatch):
    tampered = write_pack(tmp_path / "p", [SPEC])
    (tampered / f"{SPEC.name}.so").write_bytes(b"changed")
    use_path(monkeypatch, tampered)
    monkeypatch.setenv("CUTEFA_JIT", "0")
    monkeypatch.setattr(cc, "_jit", lambda entry: pytest.fail("CUTEFA_JIT=0 must not compile"))
    with pytest.raises(cc.KernelUnavailableError) as info:
        cc.get_kernel(SPEC, TARGET)
    text = str(info.value)
    command = f"cutefa compile --target {TARGET} --kernels {SPEC.name} --pack {pack.default_pack_dir(TARGET)}"
    assert f"no compiled kernel {SPEC.name} for {TARGET}, and CUTEFA_JIT=0 forbids compiling" in text
    assert command in text
    assert f"Refused: pack {tampered}: {SPEC.name}: checksum mismatch" in text
    assert str(tampered) in text and str(cc.cache_dir()) in text


def test_a_missing_kernel_is_compiled_with_a_log_line(env, tmp_path, monkeypatch, caplog):
    stale = write_pack(tmp_path / "p", [SPEC], target="sm_80")
    use_path(monkeypatch, stale)
    built = []
    monkeypatch.setattr(cc, "_jit", lambda entry: built.append(entry.name) or "compiled")
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        assert cc.get_kernel(SPEC, TARGET) == "compiled"
    assert built == [SPEC.name]
    assert f"no kernel pack could serve it:\n  pack {stale}: built for target sm_80" in caplog.text
    assert f"{SPEC.name} for {TARGET} is in no kernel pack" in caplog.text
    assert "compiling it now (JIT)" in caplog.text and f"--kernels {SPEC.name} --pack" in caplog.text
    assert cc.loaded_kernels()[(SPEC.name, TARGET)].startswith("jit ")


@pytest.mark.parametrize("value", ["0", "false", "off", "no"])
def test_jit_switch_values(monkeypatch, value):
    monkeypatch.setenv("CUTEFA_JIT", value)
    assert not cc.jit_enabled()
    monkeypatch.setenv("CUTEFA_JIT", "1")
    assert cc.jit_enabled()
    monkeypatch.delenv("CUTEFA_JIT")
    assert cc.jit_enabled()


def test_packs_serve_when_the_sources_are_not_there(env, tmp_path, monkeypatch):
    p = write_pack(tmp_path / "p", [SPEC])
    use_path(monkeypatch, p)

    def no_source(spec):
        raise FileNotFoundError("no templates in this install")

    monkeypatch.setattr(cc, "kernel_source_path", no_source)
    assert cc.get_kernel(SPEC, TARGET) == ("kernel", p / f"{SPEC.name}.so")
    with pytest.raises(cc.KernelUnavailableError, match="cannot be compiled here: FileNotFoundError"):
        cc.get_kernel(OTHER, TARGET)


def test_family_that_does_not_run_on_the_target_is_an_error(env):
    sm90 = VariantSpec("sm90", "fwd", "bf16", 128, 128, 128, 2, 12)
    with pytest.raises(ValueError, match="family sm90 does not run on target 'sm_80'"):
        cc.get_kernel(sm90, "sm_80")


def test_runtime_flavour_falls_back_to_an_installed_one():
    installed = cc._runtime_for("cu12")
    assert installed.name == "libcute_dsl_runtime.so" and installed.is_file()
    assert cc._runtime_for("cu99").name == "libcute_dsl_runtime.so"
    with pytest.raises(RuntimeError, match="has no cu99/lib/libcute_dsl_runtime.so"):
        cc.runtime_library("cu99")


# ---------------------------------------------------------------------------------------------
# Writing packs (compiler stubbed) and the command


@pytest.fixture
def fake_compiler(env, monkeypatch):
    """compile_variants through the real cache code with the DSL replaced: 'compiles' write a file."""
    broken = {OTHER.name}

    def fake_compile(entry):
        if entry.name in broken:
            raise RuntimeError("DSL said no")
        return object()

    def fake_export(compiled, entry):
        entry.so_path.write_bytes(f"ELF of {entry.name}".encode())
        return Path("/x/nvidia_cutlass_dsl/cu12/lib/libcute_dsl_runtime.so")

    monkeypatch.setattr(cc, "can_compile_here", lambda target: True)
    monkeypatch.setattr(cc, "_compile", fake_compile)
    monkeypatch.setattr(cc, "_export", fake_export)
    return broken


def test_build_pack_writes_kernels_and_manifest_and_reports_failures(fake_compiler, tmp_path):
    out = tmp_path / "pack"
    results = pack.build_pack([SPEC, OTHER], target=TARGET, pack_dir=out, progress=False)
    assert [r.ok for r in results] == [True, False]
    assert results[0].path == out / f"{SPEC.name}.so" and results[1].error == "RuntimeError: DSL said no"
    manifest = json.loads((out / pack.MANIFEST).read_text())
    assert set(manifest) == {"format", "target", "dsl_version", "abi", "cutefa_version", "updated", "kernels"}
    assert (manifest["format"], manifest["target"], manifest["dsl_version"]) == (
        pack.FORMAT,
        TARGET,
        cc.dsl_version(),
    )
    record = manifest["kernels"][SPEC.name]
    assert record == {
        "family": "sm80",
        "direction": "fwd",
        "file": f"{SPEC.name}.so",
        "sha256": hashlib.sha256(f"ELF of {SPEC.name}".encode()).hexdigest(),
        "fingerprint": cc.fingerprint(SPEC, TARGET),
        "function_name": SPEC.name,
        "runtime": "cu12",
        "compile_seconds": record["compile_seconds"],
    }
    assert sorted(p.name for p in out.iterdir()) == sorted([".lock", pack.MANIFEST, f"{SPEC.name}.so"])

    fake_compiler.clear()  # the second variant now compiles: it is added, the first one is kept
    pack.build_pack([OTHER], target=TARGET, pack_dir=out, progress=False)
    assert set(pack.read_pack(out).kernels) == {SPEC.name, OTHER.name}


def test_build_pack_refuses_a_pack_of_another_target_before_compiling(fake_compiler, tmp_path, monkeypatch):
    out = write_pack(tmp_path / "pack", [SPEC], target="sm_80")
    monkeypatch.setattr(cc, "compile_variants", lambda *a, **k: pytest.fail("must not compile"))
    with pytest.raises(pack.PackError, match="holds a pack for target sm_80; a pack has one target"):
        pack.build_pack([SPEC], target=TARGET, pack_dir=out, progress=False)
    write_pack(out, [SPEC], dsl_version="1.0")
    with pytest.raises(pack.PackError, match="built with nvidia-cutlass-dsl 1.0"):
        pack.build_pack([SPEC], target=TARGET, pack_dir=out, progress=False)


def test_compile_command_with_pack(monkeypatch, capsys, tmp_path):
    calls = []

    def build_pack(specs, *, target, pack_dir, jobs, progress):
        calls.append(([s.name for s in specs], target, pack_dir, jobs))
        return [cc.CompileResult(s, True, 0.5, None, pack_dir / f"{s.name}.so") for s in specs]

    monkeypatch.setattr(pack, "build_pack", build_pack)
    out = tmp_path / "p"
    assert (
        cli.main(["compile", "--target", TARGET, "--kernels", SPEC.name, "--pack", str(out), "--jobs", "2"])
        == 0
    )
    assert calls == [([SPEC.name], TARGET, out, 2)]
    text = capsys.readouterr().out
    assert "1 compiled, 0 failed" in text and f"pack: {out} (manifest.json)" in text

    # an exact name outside the default set (e.g. from a tuned table) is accepted as is
    defaults = space.default_variants("sm80")
    extra = next(s for s in space.valid_variants("sm80", "fwd") if s not in defaults)
    assert cli.main(["compile", "--target", TARGET, "--kernels", extra.name, "--pack", str(out)]) == 0
    assert calls[-1][0] == [extra.name]


def test_compile_command_reports_pack_conflicts(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "cache"))
    out = write_pack(tmp_path / "p", [SPEC], target="sm_80")
    assert cli.main(["compile", "--target", TARGET, "--kernels", SPEC.name, "--pack", str(out)]) == 2
    assert "holds a pack for target sm_80" in capsys.readouterr().err
    assert cli.main(["compile", "--target", TARGET, "--kernels", "sm80_fwd_nope*", "--pack", str(out)]) == 2


# ---------------------------------------------------------------------------------------------
# Real packs (the CuTe DSL runs in child processes)


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("CUTE_DSL_ARCH", "CUTEFA_KERNEL_PATH", "CUTEFA_JIT")
    }
    return env | extra


def run_child(code: str, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=child_env(**env),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tiny_sources(directory: Path, specs) -> Path:
    """Copies of the tiny test kernel (O = Q, LSE = 0) named after real variants."""
    directory.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        text = TINY.read_text().replace(
            'SPEC_NAME = "cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4"', f"SPEC_NAME = {spec.name!r}"
        )
        if spec.persistent:  # a persistent variant's calling convention also takes its grid size
            text = text.replace(
                "softmax_scale: cutlass.Float32,\n", "softmax_scale: cutlass.Float32,\n        num_ctas: cutlass.Int32,\n"
            )
            assert "num_ctas" in text
        (directory / f"{spec.name}.py").write_text(text)
    return directory


@pytest.mark.compile
def test_tiny_pack_loads_without_the_dsl_or_the_tvm_ffi_package(tmp_path):
    src, out, cache = tmp_path / "src", tmp_path / "pack", tmp_path / "cache"
    redirect = f"cc.kernel_source_path = lambda spec: Path({str(src)!r}) / f'{{spec.name}}.py'"
    # The child builds a pack of two tiny kernels: one named like the variant the dispatcher picks
    # on an H200 for the call made below, and another one.
    built = run_child(
        f"""
        import json, sys
        from pathlib import Path
        import cutefa.compile as cc
        from cutefa import dispatch, pack
        from cutefa.spec import parse_name
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_pack import tiny_sources
        {redirect}
        chosen = dispatch.choose(target="sm_90a", dtype="bf16", head_dim=128, causal=True, seqlen_q=128,
                                 seqlen_k=128, batch=1, heads_q=16, heads_kv=16, gpu_name="NVIDIA H200").spec
        specs = [parse_name("cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4"), chosen]
        tiny_sources(Path({str(src)!r}), specs)
        results = pack.build_pack(specs, target="sm_90a", pack_dir=Path({str(out)!r}), jobs=2, progress=False)
        print(json.dumps({{"ok": [r.ok for r in results], "errors": [r.error for r in results],
                           "names": [s.name for s in specs], "cutlass": "cutlass" in sys.modules}}))
        """,
        CUTEFA_CACHE_DIR=str(cache),
    )
    names = built.pop("names")
    assert built == {"ok": [True, True], "errors": [None, None], "cutlass": False}  # compiled in children
    manifest = pack.read_pack(out)
    assert set(manifest.kernels) == set(names) and manifest.target == TARGET
    for record in manifest.kernels.values():
        data = (out / record.file).read_bytes()
        assert data[:4] == b"\x7fELF" and hashlib.sha256(data).hexdigest() == record.sha256

    # A fresh process with an empty cache and JIT off: the kernel comes from the pack, and running
    # attention through the public API reaches the kernel (which refuses CPU tensors) without the DSL.
    ran = run_child(
        f"""
        import json, sys
        from pathlib import Path
        import torch
        import cutefa
        import cutefa.compile as cc
        from cutefa import dispatch, ops
        {redirect}
        dispatch.device_target = lambda device=None: ("sm_90a", "NVIDIA H200")
        ops.DEVICE_TYPES = ("cuda", "cpu")
        torch.cuda.current_device = lambda: None
        q = torch.zeros(1, 128, 16, 128, dtype=torch.bfloat16)
        try:
            cutefa.flash_attn_func(q, q, q, causal=True)
            error = None
        except ValueError as exc:
            error = str(exc)
        fn = cc.get_kernel(cc.parse_name("cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4"), "sm_90a")
        odd = torch.zeros(1 + 4 * 2 * 64, dtype=torch.float16)[1:].view(1, 4, 2, 64)
        try:
            fn(odd, odd, odd, odd, torch.zeros(1, 2, 4), 0.1)
        except ValueError as exc:
            misaligned = str(exc)
        from cutefa import profile
        print(json.dumps({{"error": error, "misaligned": misaligned, "origins": list(cc.loaded_kernels().values()),
                           "cutlass": sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "iket")),
                           "tvm_ffi": "tvm_ffi" in sys.modules,
                           "phases": list(profile.totals())}}))
        """,
        CUTEFA_CACHE_DIR=str(tmp_path / "empty-cache"),
        CUTEFA_KERNEL_PATH=str(out),
        CUTEFA_JIT="0",
        CUTEFA_PROFILE="1",
    )
    assert ran["cutlass"] == [], "loading and calling a packed kernel must not import the DSL"
    assert ran["tvm_ffi"] is False, "kernels are called through libtvm_ffi.so with ctypes, not the tvm_ffi package"
    assert "Mismatched Tensor on argument #0" in ran["error"] and "device_type=cuda" in ran["error"]
    assert "Misaligned Tensor data on argument #0" in ran["misaligned"]
    assert ran["origins"] == [f"pack {out}", f"pack {out}"]
    loading = [
        "DSL runtime library (find, dlopen)",
        "kernel library (dlopen libtvm_ffi and the kernel)",
        "first kernel call",
    ]
    start = ran["phases"].index(loading[0])  # CUTEFA_PROFILE=1: the loading phases, in order
    assert [p.split(" (module")[0] for p in ran["phases"][start : start + 3]] == loading
    assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").rglob("*.so"))


@pytest.mark.compile
def test_real_variant_through_the_command(tmp_path):
    spec = SPEC
    out, cache = tmp_path / "pack", tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "cutefa", "compile", "--target", TARGET, "--kernels", spec.name, "--pack", str(out),
         "--jobs", "1"],
        capture_output=True, text=True, env=child_env(CUTEFA_CACHE_DIR=str(cache)), timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 compiled, 0 failed" in proc.stdout
    record = pack.read_pack(out).kernels[spec.name]
    assert (record.family, record.fingerprint) == ("sm80", cc.fingerprint(spec, TARGET))
    loaded = run_child(
        f"""
        import json, sys
        import cutefa.compile as cc
        fn = cc.get_kernel(cc.parse_name({spec.name!r}), "sm_90a")
        print(json.dumps({{"type": type(fn).__name__, "origins": list(cc.loaded_kernels().values()),
                           "cutlass": "cutlass" in sys.modules}}))
        """,
        CUTEFA_CACHE_DIR=str(tmp_path / "empty-cache"),
        CUTEFA_KERNEL_PATH=str(out),
        CUTEFA_JIT="0",
    )
    assert loaded == {"type": "Function", "origins": [f"pack {out}"], "cutlass": False}


# ---------------------------------------------------------------------------------------------
# The eager call path (CPU stand-in for the kernel)


class FakeKernel:
    """Writes attention into out and lse like the real kernel and, like its TVM-FFI entry, refuses
    (ValueError, before writing anything) inconsistent shapes, tensors of another dtype or device,
    and misaligned ones."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.calls = []

    def __call__(self, q, k, v, out, lse, scale):
        if v.shape != k.shape or out.shape != q.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise ValueError("Mismatched Shape on argument")
        for t in (q, k, v, out):
            if t.dtype != self.dtype or t.device != q.device:
                raise ValueError("Mismatched Tensor on argument")
            if t.data_ptr() % 16 or any(s % (16 // t.element_size()) for s in t.stride()[:-1]):
                raise ValueError("Misaligned Tensor data on argument")
        self.calls.append((q, k, v, out, lse, scale))
        group = q.shape[2] // k.shape[2]
        kk, vv = k.float().repeat_interleave(group, 2), v.float().repeat_interleave(group, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
        out.copy_(torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv).to(out.dtype))
        lse.copy_(torch.logsumexp(s, -1))


@pytest.fixture
def fake_gpu(monkeypatch):
    """Plans on CPU tensors: CPU accepted, an H200 pretended, kernels replaced by FakeKernel."""
    kernels = {}
    validations = []
    real_validate = ops.validate_inputs

    def get_kernel(spec, target):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
        return kernels.setdefault(spec.name, FakeKernel(dtype))

    def validate(*args, **kwargs):
        validations.append(args[0].shape)
        return real_validate(*args, **kwargs)

    pretend_h200(monkeypatch, ops, get_kernel=get_kernel, validate_inputs=validate, _PLANS={})
    return kernels, validations


def qkv(batch=1, sq=8, sk=8, hq=4, hkv=2, d=64, dtype=None):
    dtype = dtype or torch.bfloat16
    return tuple(torch.randn(batch, s, h, d, dtype=dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def test_second_call_takes_the_plan_without_validation(fake_gpu):
    kernels, validations = fake_gpu
    q, k, v = qkv()
    first = cutefa.flash_attn_func(q, k, v, causal=True)
    assert len(ops._PLANS) == 1 and validations == [q.shape]
    (kernel,) = kernels.values()
    second = cutefa.flash_attn_func(q, k, v, causal=True)
    assert validations == [q.shape] and len(kernel.calls) == 2  # no validation on the plan's way
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    assert second.is_contiguous() and second.shape == q.shape and second.dtype == q.dtype

    out, lse = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    _, lse2 = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, first) and lse.shape == (1, 4, 8) and lse.dtype == torch.float32
    assert lse.data_ptr() != lse2.data_ptr() and torch.equal(lse, lse2)  # a fresh lse when it is returned
    cutefa.flash_attn_func(q, k, v, causal=True)
    lses = [
        call[4] for call in kernel.calls
    ]  # first call (validating way), plan, plan (lse), plan (lse), plan
    assert lses[1].data_ptr() == lses[4].data_ptr()  # an unwanted lse goes to one scratch buffer
    assert lses[1].data_ptr() not in (lses[0].data_ptr(), lse.data_ptr(), lse2.data_ptr())
    assert validations == [q.shape]


def test_other_signatures_get_their_own_plans(fake_gpu):
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k, v, causal=True)
    cutefa.flash_attn_func(q, k, v, causal=False)
    cutefa.flash_attn_func(q, k, v, causal=True, softmax_scale=0.5)
    cutefa.flash_attn_func(*qkv(sq=9))
    cutefa.flash_attn_func(*qkv(dtype=torch.float16))
    assert len(ops._PLANS) == 5


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"causal": 1}, TypeError, "causal must be a bool; got 1"),
        (
            {"softmax_scale": True},
            TypeError,
            "softmax_scale must be a positive finite float or None; got True",
        ),
        ({"softmax_scale": [0.1]}, TypeError, "softmax_scale must be a positive finite float or None"),
        ({"deterministic": "yes"}, TypeError, "deterministic must be a bool; got 'yes'"),
    ],
)
def test_a_plan_never_accepts_what_validation_refuses(fake_gpu, kwargs, error, words):
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k, v, causal=True, softmax_scale=1.0)
    cutefa.flash_attn_func(q, k, v, causal=True, softmax_scale=1.0)
    call = {"causal": True, "softmax_scale": 1.0} | kwargs
    with pytest.raises(error, match=words):
        cutefa.flash_attn_func(q, k, v, **call)


def test_refused_tensors_take_the_validating_way(fake_gpu):
    _, validations = fake_gpu
    q, k, v = qkv()
    expect = cutefa.flash_attn_func(q, k, v)
    odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)  # misaligned pointer
    assert torch.equal(cutefa.flash_attn_func(odd, k, v), expect)  # copied aligned by the slow path
    assert len(validations) == 2
    with pytest.raises(TypeError, match="q, k and v must have one dtype"):
        cutefa.flash_attn_func(q, k.half(), v)
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        cutefa.flash_attn_func(q, k, v[:, :4])


def test_no_plan_for_launchless_problems_or_tracked_gradients(fake_gpu):
    q, k, v = qkv(sk=0)
    out = cutefa.flash_attn_func(q, k, v)
    assert (out == 0).all() and not ops._PLANS
    empty = qkv(batch=0)
    assert cutefa.flash_attn_func(*empty).shape == empty[0].shape and not ops._PLANS
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k.requires_grad_(), v)  # the custom op, for autograd
    assert not ops._PLANS
    with torch.no_grad():
        cutefa.flash_attn_func(q, k, v)
    assert len(ops._PLANS) == 1


def test_plans_and_scratch_are_bounded(fake_gpu, monkeypatch):
    monkeypatch.setattr(ops, "MAX_PLANS", 2)
    monkeypatch.setattr(ops, "MAX_SCRATCH_ELEMENTS", 4 * 9)
    monkeypatch.setattr(ops, "_SCRATCH", {})
    for sq in (8, 9, 10):
        q, k, v = qkv(sq=sq)
        cutefa.flash_attn_func(q, k, v)  # makes the plan
        cutefa.flash_attn_func(q, k, v)  # runs it
        cutefa.flash_attn_func(q, k, v)
    assert [key[0][1] for key in ops._PLANS] == [9, 10]  # the oldest plan went
    kernels, _ = fake_gpu
    (kernel,) = kernels.values()
    lse = [call[4].data_ptr() for call in kernel.calls]
    assert lse[1] == lse[2] == lse[4] == lse[5]  # lse of 4 x 8 and 4 x 9 rows: one scratch buffer
    assert [b.numel() for b in ops._SCRATCH[torch.device("cpu")]] == [4 * 9]
    assert lse[7] != lse[8]  # 4 x 10 rows: more than the scratch limit, allocated per call


def test_plan_logs_each_run(fake_gpu, caplog):
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k, v)
    try:
        dispatch.set_logging(True)
        with caplog.at_level(logging.INFO, logger="cutefa"):
            cutefa.flash_attn_func(q, k, v)
    finally:
        dispatch.set_logging(False)
    assert (
        "cutefa: ran cutefa_" in caplog.text
        and "for q=(1, 8, 4, 64) k=(1, 8, 2, 64) causal=False" in caplog.text
    )


def test_call_path_host_overhead_is_small(fake_gpu):
    """Pure Python cost of a planned call with a no-op kernel (the GPU adds the launch itself)."""
    q, k, v = qkv(d=128, sq=128, sk=128, hq=16, hkv=16)
    cutefa.flash_attn_func(q, k, v, causal=True)
    (key,) = ops._PLANS
    ops._PLANS[key] = ops._make_plan(ops._choose(q, k, True), lambda *args: None, q, k, True, 0.1)
    n = 2000
    seconds = min(timeit.repeat(lambda: cutefa.flash_attn_func(q, k, v, causal=True), number=n, repeat=5)) / n
    assert seconds < 20e-6, f"{seconds * 1e6:.1f} us per planned call on the host"


def test_clearing_dispatch_caches_drops_the_plans(fake_gpu):
    cutefa.flash_attn_func(*qkv())
    assert ops._PLANS
    dispatch.clear_caches()
    assert not ops._PLANS
