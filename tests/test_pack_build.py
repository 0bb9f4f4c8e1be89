"""Building kernel packs on the CPU: ``build_pack`` with the compiler stubbed, the ``compile --pack``
command, interrupted builds, and (marked ``compile``) real packs, built and then loaded through the
TVM-FFI C ABI in processes that never import the DSL. Reading and trusting packs: test_pack.py.

Fast tests stub the DSL (a "compile" writes a file) and the loader; the ``compile`` tests build
real kernels in child processes, so this pytest process never imports ``cutlass``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pack_support import OTHER, SPEC, TARGET, stub_loader, use_path, write_pack

from cutefa import cli, codegen, identity, pack, pack_build
from cutefa import compile as cc
from cutefa.model import committed, rules

TINY = Path(__file__).with_name("tiny_kernel.py")


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty cache, no kernel path, JIT allowed, fresh memo tables, the loader stubbed."""
    return stub_loader(tmp_path, monkeypatch)


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
    results = pack_build.build_pack([SPEC, OTHER], target=TARGET, pack_dir=out, progress=False)
    assert [r.ok for r in results] == [True, False]
    assert results[0].path == out / f"{SPEC.name}.so" and results[1].error == "RuntimeError: DSL said no"
    manifest = json.loads((out / pack.MANIFEST).read_text())
    assert set(manifest) == {"format", "target", "dsl_version", "abi", "cutefa_version", "updated", "kernels"}
    assert (manifest["format"], manifest["target"], manifest["dsl_version"]) == (
        pack.FORMAT,
        TARGET,
        identity.dsl_version(),
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
    pack_build.build_pack([OTHER], target=TARGET, pack_dir=out, progress=False)
    assert set(pack.read_pack(out).kernels) == {SPEC.name, OTHER.name}


def test_build_pack_refuses_a_pack_of_another_target_before_compiling(fake_compiler, tmp_path, monkeypatch):
    out = write_pack(tmp_path / "pack", [SPEC], target="sm_80")
    monkeypatch.setattr(cc, "_compile_all", lambda *a, **k: pytest.fail("must not compile"))
    with pytest.raises(pack.PackError, match="holds a pack for target sm_80; a pack has one target"):
        pack_build.build_pack([SPEC], target=TARGET, pack_dir=out, progress=False)
    write_pack(out, [SPEC], dsl_version="1.0")
    with pytest.raises(pack.PackError, match="built with nvidia-cutlass-dsl 1.0"):
        pack_build.build_pack([SPEC], target=TARGET, pack_dir=out, progress=False)


def test_compile_command_with_pack(monkeypatch, capsys, tmp_path):
    calls = []

    def build_pack(specs, *, target, pack_dir, jobs, progress):
        calls.append(([s.name for s in specs], target, pack_dir, jobs))
        return [cc.CompileResult(s, True, 0.5, None, pack_dir / f"{s.name}.so") for s in specs]

    monkeypatch.setattr(pack_build, "build_pack", build_pack)
    out = tmp_path / "p"
    assert (
        cli.main(["compile", "--target", TARGET, "--kernels", SPEC.name, "--pack", str(out), "--jobs", "2"])
        == 0
    )
    assert calls == [([SPEC.name], TARGET, out, 2)]
    text = capsys.readouterr().out
    assert "1 compiled, 0 failed" in text and f"pack: {out} (manifest.json)" in text

    # an exact name outside the default set (e.g. from a tuned table) is accepted as is
    defaults = committed.default_variants("sm80")
    extra = next(s for s in rules.valid_variants("sm80", "fwd") if s not in defaults)
    assert cli.main(["compile", "--target", TARGET, "--kernels", extra.name, "--pack", str(out)]) == 0
    assert calls[-1][0] == [extra.name]


def test_compile_command_reports_pack_conflicts(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "cache"))
    out = write_pack(tmp_path / "p", [SPEC], target="sm_80")
    assert cli.main(["compile", "--target", TARGET, "--kernels", SPEC.name, "--pack", str(out)]) == 2
    assert "holds a pack for target sm_80" in capsys.readouterr().err
    assert cli.main(["compile", "--target", TARGET, "--kernels", "sm80_fwd_nope*", "--pack", str(out)]) == 2


def test_pack_writer_lists_each_kernel_as_it_is_added(env, tmp_path):
    so = tmp_path / "kernel.so"
    so.write_bytes(b"ELF")
    writer = pack.PackWriter(tmp_path / "p", TARGET)
    assert not (tmp_path / "p" / pack.MANIFEST).exists()  # nothing added, no manifest
    fp = cc.fingerprint(SPEC, TARGET)
    dest = writer.add(SPEC.name, "sm80", "fwd", so, fingerprint=fp, function_name=SPEC.name, runtime="cu12")
    assert dest == tmp_path / "p" / f"{SPEC.name}.so"
    assert set(pack.read_pack(tmp_path / "p").kernels) == {SPEC.name}  # usable after one kernel
    assert writer.holds(SPEC.name, fp) == dest and writer.holds(SPEC.name, "0" * 64) is None
    assert writer.holds(OTHER.name, fp) is None
    writer.add(OTHER.name, "sm80", "fwd", so, fingerprint="f" * 64, function_name=OTHER.name, runtime="cu12")
    assert set(pack.read_pack(tmp_path / "p").kernels) == {SPEC.name, OTHER.name}
    assert pack.size_on_disk(tmp_path / "p") == 2 * 3 + (tmp_path / "p" / pack.MANIFEST).stat().st_size
    dest.write_bytes(b"changed")
    assert writer.holds(SPEC.name, fp) is None  # a file that no longer matches its checksum


def test_an_interrupted_build_leaves_a_usable_pack_and_resumes(fake_compiler, tmp_path, monkeypatch):
    """Ctrl-C after the first kernel: the pack lists that kernel (and loads it); the same build run
    again keeps it without compiling and adds the rest."""
    fake_compiler.clear()
    out = tmp_path / "pack"
    compiled = []
    real_compile = cc._compile

    def compile_then_interrupt(entry):
        compiled.append(entry.name)
        if len(compiled) == 2:
            raise KeyboardInterrupt
        return real_compile(entry)

    monkeypatch.setattr(cc, "_compile", compile_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        pack_build.build_pack([SPEC, OTHER], target=TARGET, pack_dir=out, progress=False)
    assert set(pack.read_pack(out).kernels) == {SPEC.name}
    use_path(monkeypatch, out)
    assert pack.find_kernel(SPEC.name, TARGET, cc.fingerprint(SPEC, TARGET))[0].pack == out

    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "fresh-cache"))  # not even the cache has SPEC
    compiled.clear()
    monkeypatch.setattr(cc, "_compile", lambda entry: compiled.append(entry.name) or object())
    results = pack_build.build_pack([SPEC, OTHER], target=TARGET, pack_dir=out, progress=False)
    assert [r.ok for r in results] == [True, True] and compiled == [OTHER.name]
    assert results[0].seconds == 0.0 and results[0].path == out / f"{SPEC.name}.so"
    assert set(pack.read_pack(out).kernels) == {SPEC.name, OTHER.name}


def test_an_interrupt_cancels_the_queued_compiles(env, tmp_path, monkeypatch):
    """Builds in child processes: an interrupt while they run terminates the running children and
    starts none of the queued ones."""
    import signal
    import threading
    import time

    started = []

    def build_isolated(entry, force, stop=None, running=None):
        if stop.is_set():
            return False, 0.0, "cancelled"
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(proc)
        running.add(proc)
        try:
            proc.wait()
        finally:
            running.discard(proc)
        return False, 0.0, "terminated"

    monkeypatch.setattr(cc, "_build_isolated", build_isolated)
    monkeypatch.setattr(cc, "can_compile_here", lambda target: False)
    specs = [s for s in committed.default_variants("sm80") if s.direction == "fwd"][:8]
    entries = {i: cc._entry(s, TARGET) for i, s in enumerate(specs)}

    def interrupt_soon():
        while len(started) < 2:
            time.sleep(0.05)
        # Ctrl-C, to this process only (not to the children), delivered to the main thread: a
        # process-directed signal may land on another thread and leave the main thread's wait
        # uninterrupted
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Python's own SIGINT handler, unblocked, for the test: a run of the whole suite once lost the
    # interrupt (something earlier in it left another handler or mask; not an in-process compile or
    # kernel load, which leave both the Python and the C-level handler and the mask as they were)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # and not blocked here
    start = time.perf_counter()
    threading.Thread(target=interrupt_soon, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in cc._run_in_processes(entries, False, 2):
                pass
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert time.perf_counter() - start < 20  # not the 4 x 60 s the queue holds
    assert len(started) == 2  # the two running when interrupted; none of the six queued
    assert all(proc.poll() is not None for proc in started)  # and those are gone


def test_the_command_reports_an_interrupted_pack(env, tmp_path, monkeypatch, capsys):
    out = tmp_path / "p"

    def build_pack(specs, *, target, pack_dir, jobs, progress):
        write_pack(pack_dir, specs[:1])
        raise KeyboardInterrupt

    monkeypatch.setattr(pack_build, "build_pack", build_pack)
    argv = ["compile", "--target", TARGET, "--family", "sm80", "--head-dim", "64", "--pack", str(out)]
    code = cli.main(argv)
    assert code == 130
    err = capsys.readouterr().err
    assert "interrupted after " in err and f"the pack {out}: 1 kernel(s), " in err
    assert "usable as is; run the same command again to build the rest" in err


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
        if cc.takes_sm_count(spec):  # a persistent variant's calling convention also takes its grid size
            text = text.replace(
                "softmax_scale: cutlass.Float32,\n",
                "softmax_scale: cutlass.Float32,\n        num_ctas: cutlass.Int32,\n",
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
        from cutefa import dispatch, pack, pack_build
        from cutefa.model.spec import parse_name
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_pack_build import tiny_sources
        {redirect}
        chosen = dispatch.choose(target="sm_90a", dtype="bf16", head_dim=128, causal=True, seqlen_q=128,
                                 seqlen_k=128, batch=1, heads_q=16, heads_kv=16, gpu_name="NVIDIA H200").spec
        specs = [parse_name("cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4"), chosen]
        tiny_sources(Path({str(src)!r}), specs)
        results = pack_build.build_pack(specs, target="sm_90a", pack_dir=Path({str(out)!r}), jobs=2, progress=False)
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
        import cutefa.loader as loader
        from cutefa import dispatch
        from cutefa.api import validate
        {redirect}
        dispatch.device_target = lambda device=None: ("sm_90a", "NVIDIA H200")
        validate.DEVICE_TYPES = ("cuda", "cpu")
        torch.cuda.current_device = lambda: None
        q = torch.zeros(1, 128, 16, 128, dtype=torch.bfloat16)
        try:
            cutefa.flash_attn_func(q, q, q, causal=True)
            error = None
        except ValueError as exc:
            error = str(exc)
        fn = loader.get_kernel(cc.parse_name("cutefa_sm80_fwd_fp16_hd64_128x128_s1_w4"), "sm_90a")
        odd = torch.zeros(1 + 4 * 2 * 64, dtype=torch.float16)[1:].view(1, 4, 2, 64)
        try:
            fn(odd, odd, odd, odd, torch.zeros(1, 2, 4), 0.1)
        except ValueError as exc:
            misaligned = str(exc)
        from cutefa import profile
        print(json.dumps({{"error": error, "misaligned": misaligned, "origins": list(loader.loaded_kernels().values()),
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
    assert ran["tvm_ffi"] is False, (
        "kernels are called through libtvm_ffi.so with ctypes, not the tvm_ffi package"
    )
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
        import cutefa.loader as loader
        fn = loader.get_kernel(cc.parse_name({spec.name!r}), "sm_90a")
        print(json.dumps({{"type": type(fn).__name__, "origins": list(loader.loaded_kernels().values()),
                           "cutlass": "cutlass" in sys.modules}}))
        """,
        CUTEFA_CACHE_DIR=str(tmp_path / "empty-cache"),
        CUTEFA_KERNEL_PATH=str(out),
        CUTEFA_JIT="0",
    )
    assert loaded == {"type": "Function", "origins": [f"pack {out}"], "cutlass": False}


@pytest.mark.compile
def test_an_uncommitted_variant_renders_on_demand_and_packs(tmp_path, monkeypatch):
    """A valid variant generated/ does not hold: the command renders its module into the cache,
    compiles it from there (in a child process) and packs it; a process with another empty cache
    loads it from the pack, after rendering its source only to check the fingerprint."""
    from cutefa.model.rules import valid_variants

    spec = next(
        s for s in valid_variants("sm80", "fwd")
        if s.head_dim == 64 and not codegen.module_path(s).is_file()
    )  # fmt: skip
    out, cache = tmp_path / "pack", tmp_path / "cache"
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(cache))
    proc = subprocess.run(
        [sys.executable, "-m", "cutefa", "compile", "--target", TARGET, "--kernels", spec.name, "--pack", str(out),
         "--jobs", "2"],
        capture_output=True, text=True, env=child_env(CUTEFA_CACHE_DIR=str(cache)), timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "selected 1 kernel(s) for sm_90a: 1 sm80 fwd" in proc.stdout and "1 compiled, 0 failed" in proc.stdout
    )
    rendered = cache / "sources" / identity.render_digest()[:16] / "sm80" / f"{spec.name}.py"
    assert rendered.read_text() == codegen.render_source(spec)
    record = pack.read_pack(out).kernels[spec.name]
    assert (
        record.fingerprint
        == cc.fingerprint(spec, TARGET)
        == identity.fingerprint(rendered.read_text(), TARGET)
    )
    loaded = run_child(
        f"""
        import json, sys
        import cutefa.compile as cc
        import cutefa.loader as loader
        fn = loader.get_kernel(cc.parse_name({spec.name!r}), "sm_90a")
        print(json.dumps({{"type": type(fn).__name__, "origins": list(loader.loaded_kernels().values()),
                           "cutlass": "cutlass" in sys.modules}}))
        """,
        CUTEFA_CACHE_DIR=str(tmp_path / "empty-cache"),
        CUTEFA_KERNEL_PATH=str(out),
        CUTEFA_JIT="0",
    )
    assert loaded == {"type": "Function", "origins": [f"pack {out}"], "cutlass": False}
