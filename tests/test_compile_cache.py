"""The compile cache: fingerprints, entry layout, the meta.json commit marker, locking, export + load.

Tests that run the CuTe DSL (marked ``compile``) do so in child processes, so this pytest process
never imports ``cutlass`` (whose target is fixed at import) and other tests keep a clean slate.
They compile ``tests/tiny_kernel.py`` (O = Q, LSE = 0) under real variant names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pack_support import commit_fake

from cutefa import compile as cc
from cutefa import ffi, identity, loader
from cutefa.model.options import DqLayout
from cutefa.model.spec import VariantSpec, parse_name

TINY = Path(__file__).with_name("tiny_kernel.py")
FP16 = parse_name("cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4")
BF16 = parse_name("cutefa_sm80_fwd_bf16_hd64_128x128_s1_w4")
BROKEN = parse_name("cutefa_sm80_fwd_fp16_hd128_128x64_s1_w4")


def tiny_source(spec: VariantSpec, *, broken: bool = False) -> str:
    text = TINY.read_text().replace(
        'SPEC_NAME = "cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4"', f"SPEC_NAME = {spec.name!r}"
    )
    if broken:
        text = text.replace(
            "batch, seqlen_q, heads_q, head_dim = mQ.shape", "undefined_name_in_kernel  # noqa"
        )
    return text


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of tiny kernel modules named after their variants; kernel_source_path reads it."""
    src = tmp_path / "src"
    src.mkdir()
    for spec in (FP16, BF16):
        (src / f"{spec.name}.py").write_text(tiny_source(spec))
    (src / f"{BROKEN.name}.py").write_text(tiny_source(BROKEN, broken=True))
    monkeypatch.setattr(cc, "kernel_source_path", lambda spec: src / f"{spec.name}.py")
    return src


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(root))
    monkeypatch.setattr(loader, "_KERNELS", {})
    return root


def child_env(cache: Path) -> dict[str, str]:
    """This environment with the test cache dir and no DSL target (each child picks its own)."""
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    return {**env, "CUTEFA_CACHE_DIR": str(cache)}


def run_script(body: str, sources: Path, cache: Path) -> dict:
    """Run ``body`` in a fresh interpreter with kernel sources redirected; it prints one JSON object."""
    prelude = f"""
        import json, sys
        from pathlib import Path
        import cutefa.compile as cc
        import cutefa.loader as loader
        from cutefa.model.spec import parse_name
        cc.kernel_source_path = lambda spec: Path({str(sources)!r}) / f"{{spec.name}}.py"
    """
    code = textwrap.dedent(prelude) + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=child_env(cache),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Paths, fingerprints, markers (no DSL)


def test_cache_dir_from_env_or_home(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "x"))
    assert identity.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("CUTEFA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert identity.cache_dir() == tmp_path / ".cache" / "cutefa"


def test_fingerprint_tracks_source_target_dsl_and_building_blocks(sources, cache, monkeypatch):
    base = cc.fingerprint(FP16, "sm_80")
    assert base == cc.fingerprint(FP16, "sm_80") and len(base) == 64
    assert cc.fingerprint(FP16, "sm_90a") != base

    path = sources / f"{FP16.name}.py"
    path.write_text(path.read_text() + "# a comment changes the fingerprint\n")
    edited = cc.fingerprint(FP16, "sm_80")
    assert edited != base

    monkeypatch.setattr(identity.importlib.metadata, "version", lambda dist: "99.0")
    other_dsl = cc.fingerprint(FP16, "sm_80")
    assert other_dsl != edited

    monkeypatch.setattr(identity, "building_blocks_digest", lambda source: "other building blocks")
    assert cc.fingerprint(FP16, "sm_80") not in (base, edited, other_dsl)


def _generated(name: str) -> str:
    """The module text of variant ``name`` (committed or not), rendered from the templates."""
    from cutefa import codegen

    return codegen.render_source(parse_name(name))


def _rel(files) -> set[str]:
    return {p.relative_to(identity.KERNELS_DIR).as_posix() for p in files}


def test_building_blocks_are_the_kernels_imports():
    """A kernel's building blocks: the cutefa/kernels files its imports reach, through theirs."""
    bwd = _rel(identity.kernel_closure(_generated("cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_dqbulk")))
    # direct (sm90 parts, bwd_parts, bwd_dq, bwd_dq_bulk, bwd_pre_post and descriptors, sm80's row
    # helpers, softmax), the package's __init__, and through them (bwd_dq -> bwd_dq_writer, bwd_dq and
    # bwd_dq_bulk -> common/reduce, softmax -> common/exp2, and the inline PTX helpers of reduce, exp2
    # and descriptors -> common/ptx), common/pdl (the launches of the backward's chain) and, through
    # it and sm80's row helpers, common/target
    assert bwd == {
        "sm90/__init__.py", "sm90/parts.py", "sm90/bwd_parts.py", "sm90/descriptors.py", "sm80/bwd_parts.py",
        "sm90/bwd_dq.py", "sm90/bwd_dq_bulk.py", "sm90/bwd_dq_writer.py", "sm90/bwd_pre_post.py",
        "sm90/bwd_dkv.py", "common/softmax.py", "common/exp2.py", "common/reduce.py", "common/ptx.py",
        "common/pdl.py", "common/target.py",
    }  # fmt: skip
    fwd80 = _rel(identity.kernel_closure(_generated("cutefa_sm80_fwd_bf16_hd128_128x64_s2_w8")))
    assert "sm80/parts.py" in fwd80 and "common/mask.py" in fwd80
    assert not fwd80 & {"sm90/parts.py", "sm90/bwd_parts.py", "sm80/bwd_parts.py", "sm100/parts.py"}
    assert len(identity.building_blocks_digest(_generated("cutefa_sm80_fwd_bf16_hd128_128x64_s2_w8"))) == 64


def test_building_blocks_every_generated_module_resolves():
    """Every committed kernel module's kernel imports resolve to files (no whole-tree fallback)."""
    modules = sorted((Path(cc.__file__).resolve().parent.parent / "generated").glob("*/*.py"))
    assert modules
    for path in modules:
        files = identity.kernel_closure(path.read_text())
        assert files, path.name


def test_building_block_edits_reach_only_their_importers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Editing a building block changes the fingerprints of the kernels that import it (directly or
    not) and leaves the others' alone; an import that names no file falls back to every file."""
    import shutil

    kernels = tmp_path / "kernels"
    shutil.copytree(identity.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(identity, "KERNELS_DIR", kernels)
    monkeypatch.setattr(identity, "dsl_version", lambda: "4.8.1")
    fwd80 = _generated("cutefa_sm80_fwd_bf16_hd128_128x64_s2_w8")
    bwd90 = _generated("cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_dqbulk")

    def prints():
        for fn in (identity.files_digest, identity._file_imports):
            fn.cache_clear()
        return identity.fingerprint(fwd80, "sm_90a"), identity.fingerprint(bwd90, "sm_90a")

    base80, base90 = prints()
    (kernels / "sm90" / "bwd_parts.py").write_text(
        (kernels / "sm90" / "bwd_parts.py").read_text() + "# edit\n"
    )
    after80, after90 = prints()
    assert after80 == base80 and after90 != base90
    (kernels / "common" / "reduce.py").write_text((kernels / "common" / "reduce.py").read_text() + "# edit\n")
    again80, again90 = prints()
    assert again80 == base80 and again90 != after90  # reduce.py reaches bwd90 through sm90/bwd_dq
    (kernels / "common" / "exp2.py").write_text((kernels / "common" / "exp2.py").read_text() + "# edit\n")
    last80, last90 = prints()
    assert last80 != base80 and last90 != again90  # exp2.py reaches both through softmax.py

    missing = fwd80.replace(
        "from cutefa.kernels.sm80 import parts",
        "from cutefa.kernels.sm80 import parts\nfrom cutefa.kernels.nowhere import x",
    )
    assert missing != fwd80
    assert identity.kernel_closure(missing) is None
    everything = tuple(sorted(identity.KERNELS_DIR.rglob("*.py")))
    assert identity.building_blocks_digest(missing) == identity.files_digest(everything, identity.KERNELS_DIR)


def test_entry_layout(sources, cache):
    entry = cc._entry(FP16, "sm_80")
    fp = cc.fingerprint(FP16, "sm_80")
    assert entry.dir == cache / "sm_80" / f"{FP16.name}-{fp[:16]}"
    assert entry.so_path == entry.dir / "kernel.so"
    assert entry.meta_path == entry.dir / "meta.json"
    assert entry.source == sources / f"{FP16.name}.py"


def test_entry_rejects_unknown_target_and_family_mismatch(sources, cache):
    with pytest.raises(ValueError, match="unknown compile target 'sm_75'"):
        cc._entry(FP16, "sm_75")
    sm90 = VariantSpec("sm90", "fwd", "bf16", 128, 128, 128, 2, 12)
    with pytest.raises(ValueError, match="family sm90 does not run on target 'sm_80'"):
        cc._entry(sm90, "sm_80")


def test_prepare_refuses_a_target_whose_shared_memory_is_too_small(sources, cache):
    big = VariantSpec("sm80", "bwd", "bf16", 256, 64, 64, 2, 8, dq_layout=DqLayout.TILE)  # 182 KiB
    with pytest.raises(ValueError, match="cannot run on target 'sm_80': needs 182.0 KiB of shared memory, over "):
        loader._prepare(big, "sm_80")


def test_meta_marker_semantics(sources, cache):
    entry = cc._entry(FP16, "sm_80")
    assert entry.read_meta() is None  # nothing there
    entry.dir.mkdir(parents=True)
    entry.so_path.write_bytes(b"x")
    assert entry.read_meta() is None  # kernel.so without meta.json is not committed
    entry.meta_path.write_text("{not json")
    assert entry.read_meta() is None
    good = {"fingerprint": entry.fingerprint, "sha256": "0" * 64, "function_name": entry.name, "runtime": "cu12"}
    entry.meta_path.write_text(json.dumps(good | {"fingerprint": "0" * 64}))
    assert entry.read_meta() is None  # meta of another fingerprint
    for bad in ({"sha256": None}, {"runtime": "../../evil"}, {"function_name": "x; rm"}):
        entry.meta_path.write_text(json.dumps(good | bad))
        assert entry.read_meta() is None  # no checksum recorded, a runtime or name that is not a token
    entry.meta_path.write_text(json.dumps(good))
    assert entry.read_meta() == good
    assert entry.committed() is None  # committed, but kernel.so fails the recorded checksum
    entry.so_path.unlink()
    assert entry.read_meta() is None  # meta without its kernel.so is not committed either


def test_build_skips_committed_entry_and_force_drops_the_marker_first(sources, cache, monkeypatch):
    entry = cc._entry(FP16, "sm_80")
    commit_fake(entry)

    def no_compile(e):
        raise AssertionError("a committed entry must not be recompiled")

    monkeypatch.setattr(cc, "_compile", no_compile)
    assert cc._build(entry) is None

    def failing_compile(e):
        assert not e.meta_path.exists(), "the marker must be gone while rebuilding"
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(cc, "_compile", failing_compile)
    with pytest.raises(RuntimeError, match="compiler exploded"):
        cc._build(entry, force=True)
    assert entry.read_meta() is None  # a failed forced rebuild leaves nothing committed


def test_commit_writes_meta_last_with_its_facts(sources, cache):
    entry = cc._entry(FP16, "sm_80")
    entry.dir.mkdir(parents=True)
    entry.so_path.write_bytes(b"x")
    cc._commit(entry, Path("/somewhere/nvidia_cutlass_dsl/cu12/lib/libcute_dsl_runtime.so"), 1.25)
    meta = entry.read_meta()
    assert meta["name"] == meta["function_name"] == FP16.name
    assert (meta["target"], meta["runtime"], meta["compile_seconds"]) == ("sm_80", "cu12", 1.25)
    assert meta["dsl_version"] == identity.importlib.metadata.version("nvidia-cutlass-dsl")
    assert [p.name for p in entry.dir.iterdir() if p.name.endswith(".tmp")] == []


def test_no_linker_keeps_the_kernel_in_memory(sources, cache, monkeypatch, caplog):
    compiled = object()
    monkeypatch.setattr(cc, "_compile", lambda entry: compiled)
    monkeypatch.setattr(cc.shutil, "which", lambda name: None)
    monkeypatch.setattr(cc, "can_compile_here", lambda target: True)
    with caplog.at_level("WARNING", logger="cutefa"):
        assert loader.get_kernel(FP16, "sm_80") is compiled
    assert "no gcc/cc found" in caplog.text
    assert cc._entry(FP16, "sm_80").read_meta() is None
    assert cc.compile_variant(FP16, "sm_80") is None


def test_get_kernel_is_memoized(sources, cache, monkeypatch):
    calls = []
    monkeypatch.setattr(
        loader, "_prepare", lambda spec, target: calls.append((spec.name, target)) or object()
    )
    first = loader.get_kernel(FP16, "sm_80")
    assert loader.get_kernel(FP16, "sm_80") is first
    assert loader.get_kernel(FP16, "sm_90a") is not first
    assert calls == [(FP16.name, "sm_80"), (FP16.name, "sm_90a")]


def test_compile_here_only_for_the_dsl_target(monkeypatch):
    monkeypatch.delitem(sys.modules, "cutlass", raising=False)
    assert cc.dsl_target() is None
    assert cc.can_compile_here("sm_90a")  # not imported yet: the first compile picks the target
    monkeypatch.setitem(sys.modules, "cutlass", object())
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    assert cc.can_compile_here("sm_80") and not cc.can_compile_here("sm_90a")
    monkeypatch.delenv("CUTE_DSL_ARCH")
    assert not cc.can_compile_here("sm_80")  # imported with an auto-detected arch: use a child
    with pytest.raises(RuntimeError, match="compiles for auto-detected, not sm_80"):
        cc._import_dsl("sm_80")


def test_compile_variants_reports_each_failure_and_continues(sources, cache, monkeypatch):
    """In-process path with the DSL stubbed: a compile error and a render error fail only their variant."""
    unrenderable = parse_name("cutefa_sm80_fwd_bf16_hd256_128x64_s1_w8")
    real_source = cc.kernel_source_path

    def source(spec):
        if spec == unrenderable:
            raise ValueError("template exploded")
        return real_source(spec)

    def fake_compile(entry):
        if entry.name == BROKEN.name:
            raise RuntimeError("DSL said no")
        return object()

    def fake_export(compiled, entry):
        entry.so_path.write_bytes(b"x")
        return Path("/x/nvidia_cutlass_dsl/cu12/lib/libcute_dsl_runtime.so")

    monkeypatch.setattr(cc, "kernel_source_path", source)
    monkeypatch.setattr(cc, "can_compile_here", lambda target: True)
    monkeypatch.setattr(cc, "_compile", fake_compile)
    monkeypatch.setattr(cc, "_export", fake_export)
    results = cc.compile_variants([FP16, BROKEN, unrenderable, BF16], target="sm_80", progress=False)
    assert [r.spec for r in results] == [FP16, BROKEN, unrenderable, BF16]
    assert [r.ok for r in results] == [True, False, False, True]
    assert results[1].error == "RuntimeError: DSL said no" and results[1].path is None
    assert results[2].error == "ValueError: template exploded"
    for r in (results[0], results[3]):
        assert r.error is None and r.path == cc._entry(r.spec, "sm_80").so_path and r.seconds >= 0


# ---------------------------------------------------------------------------------------------
# Variants not committed to generated/: rendered on demand into the cache


def _uncommitted(arch: str = "sm80") -> VariantSpec:
    """A valid variant whose module generated/ does not hold (a measured alternative or any other)."""
    from cutefa.model.rules import valid_variants

    return next(
        s for s in valid_variants(arch, "fwd")
        if not (identity.GENERATED_DIR / s.arch / f"{s.name}.py").is_file()
    )  # fmt: skip


def test_an_uncommitted_variant_is_rendered_once_into_the_cache(cache, monkeypatch):
    from cutefa import codegen

    spec = _uncommitted()
    path = cc.kernel_source_path(spec)
    assert path == cache / "sources" / identity.render_digest()[:16] / "sm80" / f"{spec.name}.py"
    assert path.read_text() == codegen.render_source(spec)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind

    monkeypatch.setattr(codegen, "render_source", lambda spec: pytest.fail("rendered again"))
    assert cc.kernel_source_path(spec) == path  # found by name and render digest, not re-rendered
    entry = cc._entry(spec, "sm_80")
    assert entry.source == path and entry.fingerprint == identity.fingerprint(path.read_text(), "sm_80")
    assert cc.fingerprint(spec, "sm_80") == entry.fingerprint


def test_a_committed_variant_is_read_from_generated(cache):
    from cutefa.model.committed import default_variants

    spec = default_variants("sm80")[0]
    assert cc.kernel_source_path(spec) == identity.GENERATED_DIR / "sm80" / f"{spec.name}.py"
    assert not (cache / "sources").exists()


def test_the_render_digest_follows_templates_and_the_modules_that_render(tmp_path, monkeypatch):
    import shutil

    base = identity.render_digest()
    templates = tmp_path / "templates"
    shutil.copytree(identity.TEMPLATES_DIR, templates)
    monkeypatch.setattr(identity, "TEMPLATES_DIR", templates)
    identity.render_digest.cache_clear()
    try:
        assert identity.render_digest() == base  # same files, same digest
        edited = templates / "fwd_sm80.py.j2"
        edited.write_text(edited.read_text() + "# an edit\n")
        identity.files_digest.cache_clear()
        identity.render_digest.cache_clear()
        assert identity.render_digest() != base
    finally:
        identity.render_digest.cache_clear()
    root = identity.PACKAGE_DIR
    found = identity.imported_files((root / "codegen.py").read_text(), "cutefa", "cutefa", root)
    rendering = identity._closure(found, "cutefa", root, stop=root / "__init__.py")
    names = {p.relative_to(root).as_posix() for p in rendering}
    assert "model/spec.py" in names and "__init__.py" in names
    assert not names & {"compile.py", "pack.py", "cli.py", "selection.py", "dispatch.py"}  # none renders


def test_compiling_an_uncommitted_variant_compiles_its_rendered_module(cache, monkeypatch, capsys):
    """compile_variants and ``cutefa compile --kernels NAME`` take a variant generated/ does not
    hold: its module is rendered into the cache and compiled from there (the DSL stubbed)."""
    from cutefa import cli

    spec = _uncommitted()
    compiled = []

    def fake_compile(entry):
        compiled.append(entry.source)
        return object()

    def fake_export(obj, entry):
        entry.so_path.write_bytes(b"x")
        return Path("/x/nvidia_cutlass_dsl/cu12/lib/libcute_dsl_runtime.so")

    monkeypatch.setattr(cc, "can_compile_here", lambda target: True)
    monkeypatch.setattr(cc, "_compile", fake_compile)
    monkeypatch.setattr(cc, "_export", fake_export)
    (result,) = cc.compile_variants([spec], target="sm_80", progress=False)
    rendered = cache / "sources" / identity.render_digest()[:16] / "sm80" / f"{spec.name}.py"
    assert result.ok and compiled == [rendered] and result.path == cc._entry(spec, "sm_80").so_path
    assert cli.main(["compile", "--target", "sm_80", "--kernels", spec.name, "--jobs", "1"]) == 0
    assert "1 compiled, 0 failed" in capsys.readouterr().out
    assert compiled == [rendered]  # the second time, the cache entry was already committed


def test_an_invalid_variant_is_not_rendered(cache):
    from cutefa.model.committed import candidates
    from cutefa.model.rules import why_invalid

    spec = next(s for s in candidates("sm80", "fwd") if why_invalid(s))
    with pytest.raises(ValueError, match=f"cannot render {spec.name}"):
        cc.kernel_source_path(spec)
    assert not any((cache / "sources").rglob("*.py")) if (cache / "sources").exists() else True


# ---------------------------------------------------------------------------------------------
# Real compiles with the CuTe DSL on this CPU (in child processes)


@pytest.mark.compile
def test_sm80_compile_export_link_and_tvm_ffi_load(sources, cache):
    built = run_script(
        """
        import os
        spec = parse_name("cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4")
        path = cc.compile_variant(spec, "sm_80")
        print(json.dumps({"path": str(path), "arch": os.environ["CUTE_DSL_ARCH"]}))
        """,
        sources,
        cache,
    )
    assert built["arch"] == "sm_80"  # compiled in that process, which the first compile set up
    so = Path(built["path"])
    entry = cc._entry(FP16, "sm_80")
    assert so == entry.so_path and so.read_bytes()[:4] == b"\x7fELF"
    meta = entry.read_meta()
    assert meta["target"] == "sm_80" and meta["function_name"] == FP16.name
    assert sorted(p.name for p in entry.dir.iterdir()) == [".lock", "kernel.so", "meta.json"]
    assert ffi.runtime_library(meta["runtime"]).is_file()

    loaded = run_script(
        """
        import time, torch
        spec = parse_name("cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4")
        start = time.perf_counter()
        fn = loader.get_kernel(spec, "sm_80")
        seconds = time.perf_counter() - start
        q = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
        try:
            fn(q, q, q, q, torch.zeros(1, 2, 4), 0.125)
            error = None
        except Exception as exc:
            error = str(exc)
        print(json.dumps({"type": type(fn).__name__, "cutlass": "cutlass" in sys.modules,
                          "seconds": seconds, "error": error}))
        """,
        sources,
        cache,
    )
    assert loaded["cutlass"] is False, "loading a cached kernel must not import the DSL"
    assert loaded["type"] == "Function"  # a tvm_ffi.Function from kernel.so
    # the TVM-FFI entry checks its arguments: CPU tensors are refused (and there is no GPU to run on)
    assert "device_type=cuda" in loaded["error"]


@pytest.mark.compile
def test_other_target_compiles_in_a_child_process(sources, cache):
    out = run_script(
        """
        import os
        spec = parse_name("cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4")
        cc.compile_variant(spec, "sm_80")  # this process's DSL is now set up for sm_80
        path = cc.compile_variant(spec, "sm_90a")
        print(json.dumps({"path": str(path), "arch": os.environ["CUTE_DSL_ARCH"]}))
        """,
        sources,
        cache,
    )
    assert out["arch"] == "sm_80"
    entry = cc._entry(FP16, "sm_90a")
    assert Path(out["path"]) == entry.so_path
    assert entry.read_meta()["target"] == "sm_90a"
    assert cc._entry(FP16, "sm_80").read_meta()["target"] == "sm_80"


@pytest.mark.compile
def test_concurrent_compiles_of_one_entry_leave_one_valid_entry(sources, cache):
    code = textwrap.dedent(
        f"""
        import json
        from pathlib import Path
        import cutefa.compile as cc
        from cutefa.model.spec import parse_name
        cc.kernel_source_path = lambda spec: Path({str(sources)!r}) / f"{{spec.name}}.py"
        compiles = []
        real = cc._compile
        cc._compile = lambda entry: compiles.append(entry.name) or real(entry)
        path = cc.compile_variant(parse_name({FP16.name!r}), "sm_80")
        print(json.dumps({{"path": str(path), "compiled": len(compiles)}}))
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(cache),
        )
        for _ in range(2)
    ]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    entry = cc._entry(FP16, "sm_80")
    assert {o["path"] for o in outs} == {str(entry.so_path)}
    assert sorted(o["compiled"] for o in outs) == [0, 1], "exactly one process compiles; the other reuses it"
    assert sorted(p.name for p in entry.dir.iterdir()) == [".lock", "kernel.so", "meta.json"]
    assert entry.read_meta() is not None
    assert [p.name for p in (cache / "sm_80").iterdir()] == [entry.dir.name]


@pytest.mark.compile
def test_compile_variants_in_parallel_processes_survive_a_broken_variant(sources, cache):
    start = time.perf_counter()
    results = cc.compile_variants([FP16, BROKEN, BF16], target="sm_80", jobs=2, progress=False)
    assert [r.ok for r in results] == [True, False, True]
    assert "undefined_name_in_kernel" in results[1].error and results[1].path is None
    for r in (results[0], results[2]):
        assert r.path == cc._entry(r.spec, "sm_80").so_path and r.path.is_file()
        assert 0 < r.seconds < time.perf_counter() - start
    again = cc.compile_variants([FP16], target="sm_80", jobs=2, progress=False)
    assert again[0].ok and again[0].path == results[0].path
