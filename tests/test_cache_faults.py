"""The compile cache and packs under damage and disk faults, on the CPU: durable commits (the kernel
and its folder fsynced before the commit marker), damaged entries quarantined and rebuilt (or
reported with the exact command when the JIT is off) without the damaged file ever reaching the
dynamic loader, a source that fails falling through to the next, a full disk leaving no temporary
file, a read-only cache running kernels from a private folder with one warning, ``cutefa tune``
tables written atomically outside the package, and printed commands shell-quoted.

The DSL's compile is replaced by a stand-in whose export writes a real object file: the cache's
link, commit, check and load steps run for real (tests/pack_support.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pack_support import (
    OTHER,
    SPEC,
    TARGET,
    build_so,
    fake_compiler,
    files_under,
    full_disk,
    read_only,
    use_path,
    write_pack,
)

from cutefa import cache, identity, loader, pack, pack_build, tune
from cutefa import compile as cc
from cutefa.model import committed

THIRD = next(s for s in committed.default_variants("sm80") if s.direction == "fwd" and s.head_dim == 96)


@pytest.fixture
def compiled(tmp_path, monkeypatch):
    """The names compiled so far, with the stand-in compiler and an empty cache."""
    return fake_compiler(tmp_path, monkeypatch)


@pytest.fixture
def loads(monkeypatch):
    """The sha256 of every file the dynamic loader opens as a library, in order."""
    seen = []
    real = ctypes.PyDLL

    def pydll(name, *args, **kwargs):
        with open(name, "rb") as f:
            seen.append(hashlib.sha256(f.read()).hexdigest())
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "PyDLL", pydll)
    return seen


def built_entry() -> cache.Entry:
    """SPEC compiled into the cache through the JIT, loaded and run once; the memo forgotten."""
    loader.get_kernel(SPEC, TARGET)()
    entry = cc._entry(SPEC, TARGET)
    assert entry.read_meta() is not None
    loader._KERNELS.clear()
    loader._ORIGINS.clear()
    return entry


# ---------------------------------------------------------------------------------------------
# Commits


def test_the_kernel_and_its_folder_are_fsynced_before_the_marker(compiled, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    entry = built_entry()
    kernel = next(i for i, p in enumerate(synced) if Path(p).name.startswith(".kernel."))
    meta = next(i for i, p in enumerate(synced) if Path(p).name.startswith(".meta.json."))
    folder = [i for i, p in enumerate(synced) if p == str(entry.dir)]
    assert kernel < folder[0] < meta < folder[1]  # kernel, folder (its rename), meta, folder
    meta_json = json.loads(entry.meta_path.read_text())
    assert meta_json["sha256"] == hashlib.sha256(entry.so_path.read_bytes()).hexdigest()
    assert sorted(p.name for p in entry.dir.iterdir()) == [".lock", "kernel.so", "meta.json"]
    for path in (entry.dir, entry.so_path, entry.meta_path):
        assert not path.stat().st_mode & 0o022  # never group- or world-writable


# ---------------------------------------------------------------------------------------------
# Damaged entries


def _truncate(entry: cache.Entry) -> None:
    data = entry.so_path.read_bytes()
    entry.so_path.write_bytes(data[: len(data) // 2])


def _empty(entry: cache.Entry) -> None:
    entry.so_path.write_bytes(b"")


def _garbage_with_its_checksum(entry: cache.Entry) -> None:
    """Bytes that are no shared object, recorded as the entry's checksum: only loading finds out."""
    garbage = b"\x7fELF" + os.urandom(4096)
    entry.so_path.write_bytes(garbage)
    meta = json.loads(entry.meta_path.read_text())
    entry.meta_path.write_text(json.dumps(meta | {"sha256": hashlib.sha256(garbage).hexdigest()}))


DAMAGE = {"truncated": _truncate, "empty": _empty, "garbage": _garbage_with_its_checksum}


@pytest.mark.parametrize("damage", DAMAGE, ids=DAMAGE)
def test_a_damaged_entry_is_quarantined_and_rebuilt(compiled, loads, caplog, damage):
    entry = built_entry()
    good = hashlib.sha256(entry.so_path.read_bytes()).hexdigest()
    DAMAGE[damage](entry)
    damaged = hashlib.sha256(entry.so_path.read_bytes()).hexdigest()
    loads.clear()
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        loader.get_kernel(SPEC, TARGET)()  # rebuilt, loaded and run: no crash
    assert compiled == [SPEC.name, SPEC.name]
    assert loader.loaded_kernels()[(SPEC.name, TARGET)] == f"jit {entry.root}"
    reason = "kernel.so fails its checksum" if damage != "garbage" else "kernel.so cannot be loaded"
    assert f"cache entry {entry.dir}: {reason}" in caplog.text
    (moved,) = (entry.root / "quarantine" / TARGET).iterdir()
    assert moved.name.startswith(entry.dir.name + ".") and f"moved to {moved}" in caplog.text
    assert hashlib.sha256((moved / "kernel.so").read_bytes()).hexdigest() == damaged
    if damage != "garbage":  # the checksum is checked first: damaged bytes never reach the loader
        assert damaged not in loads
    assert entry.committed() is not None and json.loads(entry.meta_path.read_text())["sha256"] == good


def test_a_truncated_kernel_never_crashes_a_fresh_process(compiled, tmp_path):
    """Half a kernel.so mapped by the dynamic loader can raise SIGBUS: a fresh process meeting one
    in the cache rebuilds it and runs."""
    entry = built_entry()
    _truncate(entry)
    code = f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import pytest
        from pack_support import SPEC, TARGET, fake_compiler
        from pathlib import Path
        from cutefa import loader
        fake_compiler(Path({str(tmp_path)!r}), pytest.MonkeyPatch())
        loader.get_kernel(SPEC, TARGET)()
        print(loader.loaded_kernels()[(SPEC.name, TARGET)])
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"jit {entry.root}" and "fails its checksum" in proc.stderr


def test_with_the_jit_off_a_damaged_entry_is_reported_with_the_command(compiled, monkeypatch):
    entry = built_entry()
    _truncate(entry)
    monkeypatch.setenv("CUTEFA_JIT", "0")
    with pytest.raises(loader.KernelUnavailableError) as info:
        loader.get_kernel(SPEC, TARGET)
    text = str(info.value)
    command = ["cutefa", "compile", "--target", TARGET, "--kernels", SPEC.name, "--pack"]
    line = next(line for line in text.splitlines() if line.strip().startswith("cutefa compile"))
    assert shlex.split(line)[:-1] == command
    assert f"Refused: cache {entry.dir}: kernel.so fails its checksum" in text
    assert compiled == [SPEC.name]  # nothing compiled with the JIT off


# ---------------------------------------------------------------------------------------------
# A source that fails falls through to the next


def test_a_pack_kernel_that_does_not_load_falls_through(compiled, tmp_path, monkeypatch, caplog):
    broken = write_pack(tmp_path / "broken", [SPEC])  # passes every check, but is no shared object
    good = write_pack(tmp_path / "good", [SPEC])
    so = build_so(good / f"{SPEC.name}.so", SPEC.name)
    manifest = json.loads((good / pack.MANIFEST).read_text())
    manifest["kernels"][SPEC.name]["sha256"] = hashlib.sha256(so.read_bytes()).hexdigest()
    (good / pack.MANIFEST).write_text(json.dumps(manifest))
    use_path(monkeypatch, broken, good)
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        loader.get_kernel(SPEC, TARGET)()
    assert loader.loaded_kernels()[(SPEC.name, TARGET)] == f"pack {good}"
    assert f"pack {broken}: {SPEC.name}: cannot be loaded: {broken / (SPEC.name + '.so')}" in caplog.text

    loader._KERNELS.clear()
    use_path(monkeypatch, broken)  # no other pack: the JIT serves it, with the reason logged
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        loader.get_kernel(SPEC, TARGET)()
    assert loader.loaded_kernels()[(SPEC.name, TARGET)].startswith("jit ")
    assert compiled == [SPEC.name]


# ---------------------------------------------------------------------------------------------
# Full disks and read-only caches


def test_a_full_disk_leaves_no_temporary_file_and_the_kernel_runs_from_memory(compiled, monkeypatch, caplog):
    root = identity.cache_dir()
    failed = full_disk(monkeypatch, root)
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        assert loader.get_kernel(SPEC, TARGET)() == "ran from memory"
    assert failed and Path(failed[0]).name.startswith(".meta.json.")  # the commit marker's write failed
    entry = cc._entry(SPEC, TARGET)
    assert entry.read_meta() is None
    assert files_under(root) == [f"{TARGET}/{entry.dir.name}/.lock"]  # no temp file, no stray kernel.so
    assert (
        caplog.text.count(f"not using the kernel cache {root}: cannot write it: No space left on device") == 1
    )


def test_a_full_disk_while_packing_keeps_the_pack_as_it_was(compiled, tmp_path, monkeypatch):
    out = tmp_path / "pack"
    (first,) = pack_build.build_pack([SPEC], target=TARGET, pack_dir=out, progress=False)
    before = (out / pack.MANIFEST).read_text()
    full_disk(monkeypatch, out)
    (second,) = pack_build.build_pack([OTHER], target=TARGET, pack_dir=out, progress=False)
    assert first.ok and not second.ok
    assert "not added to the pack: OSError: [Errno 28] No space left on device" in second.error
    assert (out / pack.MANIFEST).read_text() == before
    assert files_under(out) == sorted([".lock", pack.MANIFEST, f"{SPEC.name}.so"])


def test_a_read_only_cache_runs_kernels_from_a_private_folder_with_one_warning(compiled, monkeypatch, caplog):
    entry = built_entry()  # one entry was committed before the cache became read-only
    root = identity.cache_dir()
    read_only(monkeypatch, root)
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        loader.get_kernel(SPEC, TARGET)()  # the committed entry still serves
        for spec in (OTHER, THIRD):  # new ones are built elsewhere and run
            loader.get_kernel(spec, TARGET)()
    origins = loader.loaded_kernels()
    assert origins[(SPEC.name, TARGET)] == f"cache {entry.dir}"
    for spec in (OTHER, THIRD):
        where = Path(origins[(spec.name, TARGET)].removeprefix("jit "))
        assert where == identity.private_dir("cache") and not where.is_relative_to(root)
    assert (
        caplog.text.count(f"not using the kernel cache {root}: cannot write it: Read-only file system") == 1
    )
    assert compiled == [SPEC.name, OTHER.name, THIRD.name]


def test_a_damaged_entry_in_a_read_only_cache_is_rebuilt_elsewhere(compiled, monkeypatch, caplog):
    entry = built_entry()
    _truncate(entry)
    read_only(monkeypatch, identity.cache_dir())
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        loader.get_kernel(SPEC, TARGET)()
    assert "left in place (the cache cannot be written)" in caplog.text
    assert loader.loaded_kernels()[(SPEC.name, TARGET)] == f"jit {identity.private_dir('cache')}"


# ---------------------------------------------------------------------------------------------
# cutefa tune's table, printed commands


TABLE = {"arch": "sm90", "direction": "bwd", "gpu": "H100", "target": "sm_90a", "entries": []}


def test_tune_tables_go_outside_the_package_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTEFA_TUNED_DIR", raising=False)
    package = Path(tune.__file__).resolve().parent
    assert tune.default_table_dir() == tmp_path / "cache" / "tuned"
    path = tune.write_table(TABLE)
    assert path == tmp_path / "cache" / "tuned" / "sm90_bwd_h100.json" and not path.is_relative_to(package)
    assert json.loads(path.read_text()) == TABLE
    monkeypatch.setenv("CUTEFA_TUNED_DIR", str(tmp_path / "mine"))  # where dispatch looks first
    assert tune.write_table(TABLE).parent == tmp_path / "mine"
    out = tmp_path / "out"
    assert tune.write_table(TABLE, out) == out / "sm90_bwd_h100.json"

    full_disk(monkeypatch, out)
    with pytest.raises(OSError, match="No space left on device"):
        tune.write_table(TABLE | {"entries": [1]}, out)
    assert json.loads((out / "sm90_bwd_h100.json").read_text()) == TABLE  # the old table, whole
    assert files_under(out) == ["sm90_bwd_h100.json"]


def test_printed_commands_are_shell_quoted():
    where = "/tmp/my packs/it's here"
    text = loader.build_command(SPEC.name, TARGET, where)
    assert shlex.split(text) == [
        "cutefa", "compile", "--target", TARGET, "--kernels", SPEC.name, "--pack", where,
    ]  # fmt: skip
