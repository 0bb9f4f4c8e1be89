"""Kernel packs on the CPU: manifest, search path, refusals, and the loader's order (pack, cache, JIT)
with its switch. Building packs and the ``compile --pack`` command: test_pack_build.py.

These tests use dummy ``.so`` files with real checksums and fingerprints and stub the loader.
"""

from __future__ import annotations

import json
import logging

import pytest
from pack_support import OTHER, SPEC, TARGET, commit_fake, stub_loader, use_path, write_pack

from cutefa import codegen, ffi, identity, loader, pack
from cutefa import compile as cc
from cutefa.model.spec import VariantSpec


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty cache, no kernel path, JIT allowed, fresh memo tables, the loader stubbed."""
    return stub_loader(tmp_path, monkeypatch)


# ---------------------------------------------------------------------------------------------
# Sources and manifests


def test_committed_sources_are_read_from_codegens_folder():
    assert identity.GENERATED_DIR == codegen.GENERATED_DIR and identity.TEMPLATES_DIR == codegen.TEMPLATES_DIR
    assert cc.kernel_source_path(SPEC) == codegen.module_path(SPEC)


def test_read_pack_round_trip(tmp_path):
    path = write_pack(tmp_path / "p", [SPEC, OTHER])
    p = pack.read_pack(path)
    facts = (pack.FORMAT, TARGET, identity.dsl_version(), identity.ABI)
    assert (p.format, p.target, p.dsl_version, p.abi) == facts
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
    assert pack.search_dirs() == [identity.cache_dir() / "packs"]

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
        monkeypatch.setattr(identity, "dsl_version", lambda: "4.8.1")
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
    monkeypatch.setattr(loader, "_jit", lambda entry: pytest.fail("a packed kernel must not be compiled"))
    assert loader.get_kernel(SPEC, TARGET) == ("kernel", p / f"{SPEC.name}.so")
    assert env == [(p / f"{SPEC.name}.so", SPEC.name, "cu12")]
    assert loader.loaded_kernels() == {(SPEC.name, TARGET): f"pack {p}"}


def test_get_kernel_falls_back_to_the_cache(env, tmp_path, monkeypatch):
    entry = cc._entry(SPEC, TARGET)
    commit_fake(entry)
    monkeypatch.setenv("CUTEFA_JIT", "0")  # the cache is allowed with JIT off
    assert loader.get_kernel(SPEC, TARGET) == ("kernel", entry.so_path)
    assert loader.loaded_kernels()[(SPEC.name, TARGET)] == f"cache {entry.dir}"


def test_jit_off_names_the_variant_and_the_command(env, tmp_path, monkeypatch):
    tampered = write_pack(tmp_path / "p", [SPEC])
    (tampered / f"{SPEC.name}.so").write_bytes(b"changed")
    use_path(monkeypatch, tampered)
    monkeypatch.setenv("CUTEFA_JIT", "0")
    monkeypatch.setattr(loader, "_jit", lambda entry: pytest.fail("CUTEFA_JIT=0 must not compile"))
    with pytest.raises(loader.KernelUnavailableError) as info:
        loader.get_kernel(SPEC, TARGET)
    text = str(info.value)
    command = f"cutefa compile --target {TARGET} --kernels {SPEC.name} --pack {pack.default_pack_dir(TARGET)}"
    assert f"no compiled kernel {SPEC.name} for {TARGET}, and CUTEFA_JIT=0 forbids compiling" in text
    assert command in text
    assert f"Refused: pack {tampered}: {SPEC.name}: checksum mismatch" in text
    assert str(tampered) in text and str(identity.cache_dir()) in text


def test_a_missing_kernel_is_compiled_with_a_log_line(env, tmp_path, monkeypatch, caplog):
    stale = write_pack(tmp_path / "p", [SPEC], target="sm_80")
    use_path(monkeypatch, stale)
    built = []
    monkeypatch.setattr(loader, "_jit", lambda entry: built.append(entry.name) or "compiled")
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        assert loader.get_kernel(SPEC, TARGET) == "compiled"
    assert built == [SPEC.name]
    assert f"no kernel pack could serve it:\n  pack {stale}: built for target sm_80" in caplog.text
    assert f"{SPEC.name} for {TARGET} is in no kernel pack" in caplog.text
    assert "compiling it now (JIT)" in caplog.text and f"--kernels {SPEC.name} --pack" in caplog.text
    assert loader.loaded_kernels()[(SPEC.name, TARGET)].startswith("jit ")


@pytest.mark.parametrize("value", ["0", "false", "off", "no"])
def test_jit_switch_values(monkeypatch, value):
    monkeypatch.setenv("CUTEFA_JIT", value)
    assert not loader.jit_enabled()
    monkeypatch.setenv("CUTEFA_JIT", "1")
    assert loader.jit_enabled()
    monkeypatch.delenv("CUTEFA_JIT")
    assert loader.jit_enabled()


def test_packs_serve_when_the_sources_are_not_there(env, tmp_path, monkeypatch):
    p = write_pack(tmp_path / "p", [SPEC])
    use_path(monkeypatch, p)

    def no_source(spec):
        raise FileNotFoundError("no templates in this install")

    monkeypatch.setattr(cc, "kernel_source_path", no_source)
    assert loader.get_kernel(SPEC, TARGET) == ("kernel", p / f"{SPEC.name}.so")
    with pytest.raises(loader.KernelUnavailableError, match="cannot be compiled here: FileNotFoundError"):
        loader.get_kernel(OTHER, TARGET)


def test_family_that_does_not_run_on_the_target_is_an_error(env):
    sm90 = VariantSpec("sm90", "fwd", "bf16", 128, 128, 128, 2, 12)
    with pytest.raises(ValueError, match="family sm90 does not run on target 'sm_80'"):
        loader.get_kernel(sm90, "sm_80")


def test_runtime_flavour_falls_back_to_an_installed_one():
    installed = ffi._runtime_for("cu12")
    assert installed.name == "libcute_dsl_runtime.so" and installed.is_file()
    assert ffi._runtime_for("cu99").name == "libcute_dsl_runtime.so"
    with pytest.raises(RuntimeError, match="has no cu99/lib/libcute_dsl_runtime.so"):
        ffi.runtime_library("cu99")
