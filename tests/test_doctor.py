"""``cutefa doctor`` on the CPU: the environment table, the packs on the search path and whether
each is used (or why not), and for a model's config.json the kernels it needs and where each would
come from (a pack, the cache, a JIT compile, or nowhere with CUTEFA_JIT=0); its errors are one line."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from cutefa import __version__, identity, pack
from cutefa import compile as cc
from cutefa.cli import main
from cutefa.selection import model_plan, read_model_config

TARGET = "sm_90a"
LLAMA = {
    "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "torch_dtype": "bfloat16", "max_position_embeddings": 8192,
}  # fmt: skip


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A cache dir of the test's own (trusted), no pack path, JIT on."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("CUTEFA_CACHE_DIR", str(cache))
    for name in ("CUTEFA_KERNEL_PATH", "CUTEFA_JIT", "CUTEFA_TRUSTED_PACKS_ONLY"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture
def config(home):
    path = home / "config.json"
    path.write_text(json.dumps(LLAMA))
    return path


def doctor(capsys, *args):
    code = main(["doctor", *args])
    out, err = capsys.readouterr()
    return code, out, err


def write_pack(path, kernels=(), **overrides):
    """A pack with a manifest and, per (name, fingerprint), a kernel file (never loaded here)."""
    path.mkdir(parents=True)
    records = {}
    for name, fingerprint in kernels:
        (path / f"{name}.so").write_bytes(b"not a kernel")
        records[name] = {
            "family": "sm90", "direction": "fwd", "file": f"{name}.so",
            "sha256": hashlib.sha256(b"not a kernel").hexdigest(), "fingerprint": fingerprint,
            "function_name": "kernel", "runtime": "cu12",
        }  # fmt: skip
    manifest = {
        "format": pack.FORMAT, "target": TARGET, "dsl_version": identity.dsl_version(), "abi": identity.ABI,
        "cutefa_version": __version__, "kernels": records, **overrides,
    }  # fmt: skip
    (path / pack.MANIFEST).write_text(json.dumps(manifest))
    return path


def row(out, first):
    """The status column of the table row that starts with ``first``."""
    (line,) = [line for line in out.splitlines() if line.startswith(first + " ")]
    return line[len(first) :].strip()


def test_the_environment_table(home, capsys):
    code, out, err = doctor(capsys)
    assert code == 0 and err == ""
    assert row(out, "cutefa").startswith(__version__)
    assert row(out, "nvidia-cutlass-dsl") == identity.dsl_version()
    assert "CPU build" in row(out, "torch") or "CUDA" in row(out, "torch")
    assert row(out, "cache dir") == f"{identity.cache_dir()}: trusted"
    assert row(out, "JIT compile").startswith("on")
    assert "does not exist (the default pack folder)" in row(out, str(home / "cache" / "packs"))


def test_packs_are_listed_with_whether_they_are_used(home, capsys, monkeypatch):
    good = write_pack(home / "packs" / "good")
    old = write_pack(home / "packs" / "old", dsl_version="0.0.1")
    (home / "packs" / "broken").mkdir()
    (home / "packs" / "broken" / pack.MANIFEST).write_text("{")
    monkeypatch.setenv("CUTEFA_KERNEL_PATH", str(home / "packs"))
    code, out, _ = doctor(capsys, "--target", TARGET)
    assert code == 0
    assert row(out, str(good)).endswith(f"used for {TARGET}")
    assert "NOT USED for sm_90a: built with nvidia-cutlass-dsl 0.0.1" in row(out, str(old))
    assert row(out, str(home / "packs" / "broken")).startswith("UNREADABLE")
    _, out, _ = doctor(capsys, "--target", "sm_80")
    assert "NOT USED for sm_80: built for target sm_90a" in row(out, str(good))


def test_a_pack_in_an_untrusted_cache_dir_is_not_used(home, capsys):
    shared = write_pack(home / "cache" / "packs" / TARGET)
    os.chmod(shared, 0o777)
    _, out, _ = doctor(capsys, "--target", TARGET)
    assert "NOT USED: not trusted" in row(out, str(shared))


def test_a_models_kernels_and_where_each_comes_from(home, config, capsys, monkeypatch):
    specs = model_plan(read_model_config(config), TARGET).specs
    assert len(specs) >= 2
    packed, cached = specs[0], specs[1]
    write_pack(home / "mine", [(packed.name, cc.fingerprint(packed, TARGET))])
    entry = cc._entry(cached, TARGET)
    entry.dir.mkdir(parents=True)
    entry.so_path.write_bytes(b"not a kernel")
    meta = {
        "fingerprint": entry.fingerprint,
        "sha256": "0" * 64,
        "runtime": "cu12",
        "function_name": "kernel",
    }
    entry.meta_path.write_text(json.dumps(meta))
    monkeypatch.setenv("CUTEFA_KERNEL_PATH", str(home / "mine"))
    code, out, _ = doctor(capsys, "--for-model", str(config), "--target", TARGET)
    assert code == 0
    assert "head_dim 128, 32 heads, 8 kv heads" in row(out, f"model {config}")
    assert row(out, packed.name) == f"packed: {home / 'mine'}"
    assert row(out, cached.name) == f"cached: {entry.dir}"
    for spec in specs[2:]:
        assert row(out, spec.name).startswith("compiled on first use (JIT)")
        assert f"cutefa compile --target {TARGET} --kernels {spec.name}" in row(out, spec.name)
    monkeypatch.setenv("CUTEFA_JIT", "0")
    _, out, _ = doctor(capsys, "--for-model", str(config), "--target", TARGET)
    assert row(out, specs[-1].name).startswith("UNAVAILABLE (CUTEFA_JIT=0)")


def test_a_stale_packed_kernel_is_not_counted(home, config, capsys, monkeypatch):
    spec = model_plan(read_model_config(config), TARGET).specs[0]
    write_pack(home / "stale", [(spec.name, "0" * 64)])
    monkeypatch.setenv("CUTEFA_KERNEL_PATH", str(home / "stale"))
    _, out, _ = doctor(capsys, "--for-model", str(config), "--target", TARGET)
    status = row(out, spec.name)
    assert status.startswith("compiled on first use") and "stale" in status


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("missing.json", None, "cannot read it"),
        ("bad.json", "{", "not valid JSON"),
        ("no_heads.json", '{"hidden_size": 4096}', "num_attention_heads"),
    ],
)
def test_a_bad_config_is_a_one_line_error_before_any_output(home, capsys, name, text, words):
    path = home / name
    if text is not None:
        path.write_text(text)
    code, out, err = doctor(capsys, "--for-model", str(path), "--target", TARGET)
    assert code == 2 and out == ""
    assert words in err and len(err.strip().splitlines()) == 1


def test_for_model_without_a_gpu_asks_for_a_target(config, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --for-model takes its target")
    code, out, err = doctor(capsys, "--for-model", str(config))
    assert code == 2 and out == "" and "give --target" in err and len(err.strip().splitlines()) == 1
