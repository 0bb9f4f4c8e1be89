"""What a kernel pack is trusted to do, on the CPU: a manifest names only plain files inside its pack
and a runtime flavour (never a library path), a kernel file is neither a symbolic link nor anything
but a regular file, the bytes checked are the bytes loaded, packs and rendered sources under the
cache dir are used only when they are yours and no one else can write them, and
``CUTEFA_TRUSTED_PACKS_ONLY=1`` searches only ``CUTEFA_KERNEL_PATH``.

The loads here are real (tiny shared objects built with the C compiler) where the point is what
gets loaded; elsewhere the loader is stubbed (tests/pack_support.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex

import pytest
from pack_support import (
    SPEC,
    TARGET,
    build_so,
    fake_compiler,
    stub_loader,
    use_path,
    write_pack,
)

from cutefa import compile as cc
from cutefa import ffi, identity, loader, pack


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty cache, no kernel path, JIT allowed, fresh memo tables, the loader stubbed."""
    return stub_loader(tmp_path, monkeypatch)


def edit_record(pack_dir, **fields) -> None:
    manifest = json.loads((pack_dir / pack.MANIFEST).read_text())
    manifest["kernels"][SPEC.name].update(fields)
    (pack_dir / pack.MANIFEST).write_text(json.dumps(manifest))


def refusals(fingerprint=None) -> list[str]:
    found, why = pack.find_kernel(SPEC.name, TARGET, fingerprint)
    assert found is None, f"the pack was used: {found}"
    return why


# ---------------------------------------------------------------------------------------------
# What a manifest may name


@pytest.mark.parametrize(
    "name", ["../elsewhere.so", "/etc/elsewhere.so", "sub/kernel.so", "..", ".", "", "a\\b.so", "x\0.so"]
)
def test_a_kernel_file_must_be_a_plain_name_inside_the_pack(env, tmp_path, monkeypatch, name):
    p = write_pack(tmp_path / "p", [SPEC])
    edit_record(p, file=name)
    use_path(monkeypatch, p)
    assert refusals() == [f"pack {p}: {SPEC.name}: file {name!r} is not a plain file name inside the pack"]


@pytest.mark.parametrize("runtime", ["/opt/evil", "../../../../tmp/evil", "cu12/../../x", "libc.so.6", ""])
def test_the_runtime_field_is_a_flavour_token_never_a_path(env, tmp_path, monkeypatch, runtime):
    p = write_pack(tmp_path / "p", [SPEC])
    edit_record(p, runtime=runtime)
    use_path(monkeypatch, p)
    (why,) = refusals()
    assert f"{SPEC.name}: runtime {runtime!r} is not a DSL runtime flavour (cu12, cu13, ...)" in why
    with pytest.raises(ValueError, match="is not one"):
        ffi.runtime_library(runtime)


def test_the_runtime_library_is_the_installed_dsls(tmp_path):
    """A flavour names a library of the installed DSL wheel only: a path in its place (absolute,
    or climbing out of the wheel) never becomes the library that is loaded."""
    evil = tmp_path / "evil"
    (evil / "lib").mkdir(parents=True)
    (evil / "lib" / "libcute_dsl_runtime.so").write_bytes(b"\x7fELF not the DSL's")
    installed = ffi.installed_runtimes()
    assert installed and all(identity.RUNTIME_FLAVOUR.fullmatch(f) for f in installed)
    for hostile in (str(evil), f"../../../../../../../..{evil}"):
        with pytest.raises(ValueError):
            ffi._runtime_for(hostile)
    assert ffi._runtime_for("cu12") in installed.values()


def test_a_function_name_must_be_an_identifier(env, tmp_path, monkeypatch):
    p = write_pack(tmp_path / "p", [SPEC])
    edit_record(p, function_name="x(void); system")
    use_path(monkeypatch, p)
    assert "function name 'x(void); system' is not an identifier" in refusals()[0]


# ---------------------------------------------------------------------------------------------
# What a kernel file may be


def test_a_symlinked_kernel_is_refused_even_with_the_right_checksum(env, tmp_path, monkeypatch):
    p = write_pack(tmp_path / "p", [SPEC])
    so = p / f"{SPEC.name}.so"
    outside = tmp_path / "outside.so"
    outside.write_bytes(so.read_bytes())  # the very bytes the manifest's sha256 names
    so.unlink()
    so.symlink_to(outside)
    use_path(monkeypatch, p)
    assert refusals() == [
        f"pack {p}: {SPEC.name}: {so} is a symbolic link; a kernel file must be a regular file"
    ]
    so.unlink()
    so.symlink_to(f"{SPEC.name}.copy")  # one that stays inside the pack is refused the same way
    (p / f"{SPEC.name}.copy").write_bytes(outside.read_bytes())
    assert "is a symbolic link" in refusals()[0]


def test_a_kernel_that_is_not_a_regular_file_is_refused(env, tmp_path, monkeypatch):
    p = write_pack(tmp_path / "p", [SPEC])
    so = p / f"{SPEC.name}.so"
    so.unlink()
    os.mkfifo(so)  # opening a fifo to read would block: it is refused without waiting
    use_path(monkeypatch, p)
    assert refusals() == [f"pack {p}: {SPEC.name}: {so} is not a regular file"]


def test_the_bytes_checked_are_the_bytes_loaded(tmp_path, monkeypatch):
    """The kernel file is replaced right after its checksum passed: the library loaded is still the
    one that was checked (loaded through the descriptor it was hashed from), not the new file."""
    fake_compiler(tmp_path, monkeypatch)
    p = write_pack(tmp_path / "p", [SPEC])
    good = build_so(p / f"{SPEC.name}.so", SPEC.name, rc=0)
    edit_record(p, sha256=hashlib.sha256(good.read_bytes()).hexdigest())
    swapped = build_so(tmp_path / "swapped.so", SPEC.name, rc=-1)  # a kernel that fails every call
    use_path(monkeypatch, p)
    monkeypatch.setenv("CUTEFA_JIT", "0")
    real_load = loader.load_library

    def swap_then_load(*args):
        os.replace(swapped, good)  # after the checks, before the load: the path now names another file
        return real_load(*args)

    monkeypatch.setattr(loader, "load_library", swap_then_load)
    fn = loader.get_kernel(SPEC, TARGET)
    assert loader.loaded_kernels()[(SPEC.name, TARGET)] == f"pack {p}"
    fn()  # the checked kernel returns 0; the swapped one would raise


def test_a_descriptor_number_used_for_another_library_is_not_reused(tmp_path):
    """The dynamic loader knows a library by the name it was opened with: a library loaded as
    /proc/self/fd/N whose descriptor was closed must not be returned for the next file held as N."""
    import ctypes

    first = build_so(tmp_path / "first.so", "k", rc=-1)
    fd = os.open(first, os.O_RDONLY)
    ctypes.CDLL(f"/proc/self/fd/{fd}")  # some other code loads a library this way, then closes it
    os.close(fd)
    second = identity.KernelFile(build_so(tmp_path / "second.so", "k", rc=0))
    os.dup2(second.fd, fd)  # the checked copy now held under the freed number
    os.close(second.fd)
    second.fd = fd
    ffi.load(second, "k")()  # the second file's entry (returns 0), not the first one's


def test_a_loaded_kernel_is_immune_to_its_file_being_rewritten(tmp_path, monkeypatch):
    """Rewriting or truncating a loaded kernel file in place (``cp`` over it) would make the mapped
    library fault (SIGBUS): the library is loaded from a sealed in-memory copy of the checked bytes."""
    monkeypatch.setattr(ffi, "_LIBRARIES", {})
    monkeypatch.setattr(ffi, "_DIGESTS", {})
    so = build_so(tmp_path / "k.so", "k", rc=0)
    kernel = identity.KernelFile(so)
    fn = ffi.load(kernel, "k")
    so.write_bytes(b"")  # truncated in place: same inode
    fn()
    assert os.readlink(f"/proc/self/fd/{kernel.fd}").startswith("/memfd:cutefa:k.so")
    with pytest.raises(OSError):
        os.write(kernel.fd, b"x")  # sealed


# ---------------------------------------------------------------------------------------------
# Packs and sources under the cache dir: yours, and writable by no one else


@pytest.fixture
def cached_pack(env):
    """A pack in <cache dir>/packs/<target>, found with no setting."""
    p = write_pack(pack.default_pack_dir(TARGET), [SPEC])
    for path in (identity.cache_dir(), p.parent, p, p / pack.MANIFEST, p / f"{SPEC.name}.so"):
        path.chmod(0o644 if path.is_file() else 0o755)
    assert pack.find_kernel(SPEC.name, TARGET, None)[0].pack == p
    return p


@pytest.mark.parametrize("where", ["pack folder", "manifest", "kernel file", "packs folder"])
def test_a_cache_pack_that_others_can_write_is_refused_with_the_reason(cached_pack, monkeypatch, where):
    path = {
        "pack folder": cached_pack,
        "manifest": cached_pack / pack.MANIFEST,
        "kernel file": cached_pack / f"{SPEC.name}.so",
        "packs folder": cached_pack.parent,
    }[where]
    path.chmod(path.stat().st_mode | 0o020)
    (why,) = refusals()
    fix = shlex.join(["chmod", "go-w", str(path)])
    assert f"not trusted: {path} is writable by its group (mode " in why and fix in why
    use_path(monkeypatch, cached_pack)  # named in CUTEFA_KERNEL_PATH: the user chose it
    assert pack.find_kernel(SPEC.name, TARGET, None)[0].pack == cached_pack


def test_a_cache_pack_of_another_user_is_refused(cached_pack, monkeypatch):
    monkeypatch.setattr(identity, "trusted_owners", lambda: {4242})
    (why,) = refusals()
    assert f"{identity.cache_dir()} belongs to user id {os.geteuid()}, not to you" in why


def test_an_untrusted_cache_dir_is_not_used_and_the_warning_names_it(cached_pack, monkeypatch, caplog):
    root = identity.cache_dir()
    root.chmod(0o777)
    (why,) = refusals()
    assert why.startswith(
        f"packs under {root / 'packs'}: not used: {root} is writable by its group and others"
    )
    monkeypatch.setattr(loader, "_jit", lambda entry: "compiled")
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        assert loader.get_kernel(SPEC, TARGET) == "compiled"  # not the cache's pack, nor its entries
    assert f"not using the kernel cache {root}: {root} is writable by its group and others" in caplog.text
    assert caplog.text.count("not using the kernel cache") == 1


def test_what_cutefa_writes_is_trusted_under_a_permissive_umask(env, tmp_path):
    """Folders and files cutefa creates are never group-writable, even with umask 002 (a common
    default), so its own cache passes the rule it enforces."""
    so = build_so(tmp_path / "k.so", SPEC.name)
    old = os.umask(0o002)
    try:
        writer = pack.PackWriter(pack.default_pack_dir(TARGET), TARGET)
        fp = cc.fingerprint(SPEC, TARGET)
        writer.add(SPEC.name, "sm80", "fwd", so, fingerprint=fp, function_name=SPEC.name, runtime="cu12")
    finally:
        os.umask(old)
    assert pack.find_kernel(SPEC.name, TARGET, fp)[0].pack == pack.default_pack_dir(TARGET)
    for path in identity.cache_dir().rglob("*"):
        assert not path.stat().st_mode & 0o022, path


def test_rendered_sources_others_can_write_are_not_imported(env, caplog):
    """A kernel module rendered into <cache dir>/sources is imported when compiled: one in a folder
    others can write is not used; it is rendered into a private folder instead, with a warning."""
    from cutefa import codegen
    from cutefa.model.rules import valid_variants

    spec = next(s for s in valid_variants("sm80", "fwd") if not codegen.module_path(s).is_file())
    cached = cc.kernel_source_path(spec)
    assert cached.is_relative_to(identity.cache_dir())
    cached.parent.chmod(0o777)
    cached.write_text("raise SystemExit('not the rendered module')\n")
    with caplog.at_level(logging.WARNING, logger="cutefa"):
        private = cc.kernel_source_path(spec)
    assert not private.is_relative_to(identity.cache_dir())
    assert private.read_text() == codegen.render_source(spec)
    assert f"not using the kernel cache {identity.cache_dir()}: {cached.parent} is writable" in caplog.text


# ---------------------------------------------------------------------------------------------
# CUTEFA_TRUSTED_PACKS_ONLY


def test_trusted_packs_only_searches_the_kernel_path(cached_pack, tmp_path, monkeypatch):
    monkeypatch.setenv("CUTEFA_TRUSTED_PACKS_ONLY", "1")
    assert pack.search_dirs() == []
    assert pack.find_kernel(SPEC.name, TARGET, None) == (None, [])  # the cache's pack is not searched
    mine = write_pack(tmp_path / "mine", [SPEC])
    use_path(monkeypatch, mine)
    assert pack.search_dirs() == [mine]
    assert pack.find_kernel(SPEC.name, TARGET, None)[0].pack == mine
    command = shlex.split(loader.build_command(SPEC.name, TARGET))
    assert command[-2:] == ["--pack", "DIR"]  # the default pack would not be searched
