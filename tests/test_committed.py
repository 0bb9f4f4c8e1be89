"""The committed set (generated/) is exactly what dispatch can run: every variant the forward, the
fp8 block and centered-v paths and the backward choose, on every target, dtype, head dim, mask and
seqlen bucket, with the committed tuned tables and without them (the heuristic), is committed; and
every committed variant is such a choice or named by a committed tuned table."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from cutefa import dispatch, tuned_tables
from cutefa.api.backward import choose_bwd
from cutefa.api.descales import block_choice
from cutefa.model import committed, rules
from cutefa.model.defaults import default_config, small_smem_configs
from cutefa.model.options import Mask, Quant
from cutefa.model.spec import (
    ARCHS,
    COMMITTED_HEAD_DIMS,
    DIRECTIONS,
    DTYPES,
    HEAD_DIM_V_PAIRS,
    TARGETS,
    parse_name,
)

# one seqlen_k in every bucket dispatch distinguishes (powers of two up to 65536, then the last one)
SEQLENS = [1 << i for i in range(17)] + [tuned_tables.MAX_SEQLEN_BUCKET + 1]
COMMITTED = {s for arch in ARCHS for s in committed.default_variants(arch)}


def _choices() -> dict:
    """Every variant dispatch returns for the problems it distinguishes -> one problem that gets it."""
    found: dict = {}
    for target, dtype, head_dim, causal in itertools.product(
        TARGETS, DTYPES, COMMITTED_HEAD_DIMS, (False, True)
    ):
        for v_centered, seqlen_k in itertools.product(
            (False, True) if dtype == "e4m3" else (False,), SEQLENS
        ):
            problem = (target, dtype, head_dim, causal, v_centered, seqlen_k)
            try:
                choice = dispatch.choose(
                    target=target, dtype=dtype, head_dim=head_dim, causal=causal, seqlen_q=seqlen_k,
                    seqlen_k=seqlen_k, batch=1, heads_q=1, heads_kv=1, v_centered=v_centered,
                )  # fmt: skip
            except NotImplementedError:
                continue
            found.setdefault(choice.spec, ("fwd", *problem))
            if dtype == "e4m3":
                try:
                    found.setdefault(block_choice(choice).spec, ("block", *problem))
                except NotImplementedError:  # the family has no block quantization
                    assert not hasattr(choice.spec.options, "quant"), choice.spec.name
    # the backward of every committed head dim, and of each pair with a V head dim of its own
    head_dims = [(d, d) for d in COMMITTED_HEAD_DIMS] + list(HEAD_DIM_V_PAIRS)
    for target, dtype, (head_dim, head_dim_v), causal in itertools.product(
        TARGETS, (torch.float16, torch.bfloat16), head_dims, (False, True)
    ):
        for seqlen_k in (None, *SEQLENS):
            try:
                spec = choose_bwd(target, dtype, head_dim, causal, seqlen_k=seqlen_k, head_dim_v=head_dim_v)
            except NotImplementedError:
                continue
            found.setdefault(spec, ("bwd", target, dtype, head_dim, head_dim_v, causal, seqlen_k))
    return found


@pytest.fixture(scope="module")
def reached() -> dict[str, dict]:
    """Dispatch's choices with the committed tuned tables and with none (the heuristic alone)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CUTEFA_TUNED_DIR", raising=False)
        dispatch.clear_caches()
        with_tables = _choices()
        mp.setattr(tuned_tables, "TUNED_DIR", Path(__file__).resolve().parent / "no_tuned_tables_here")
        dispatch.clear_caches()
        heuristic = _choices()
    dispatch.clear_caches()
    return {"tables": with_tables, "heuristic": heuristic}


@pytest.mark.parametrize("tables", ["tables", "heuristic"])
def test_every_dispatch_choice_is_committed(reached, tables):
    missing = {spec.name: problem for spec, problem in reached[tables].items() if spec not in COMMITTED}
    assert not missing, f"dispatch runs variants generated/ lacks: {missing}"


def test_every_committed_variant_is_dispatched_or_tuned(reached):
    chosen = set(reached["tables"]) | set(reached["heuristic"])
    extra = COMMITTED - chosen - set(committed.tuned_variants())
    assert not extra, f"committed but never dispatched: {sorted(s.name for s in extra)}"
    # the kinds of choice are all there: heuristic defaults, the tables' picks, the small-shared-memory
    # tiles of sm_86/sm_89, the block and the centered-v variants, the backward (of a V head dim of
    # its own too: the sm90 one on Hopper, the sm80 one elsewhere)
    assert any(s.options == default_config(s.arch, s.direction, s.dtype, s.head_dim).options for s in chosen)
    assert {s for s in chosen if getattr(s.options, "quant", Quant.TENSOR) is Quant.BLOCK} == set(
        committed.fp8_block_specs("sm90")
    )
    assert any(getattr(s.options, "v_mean", False) for s in reached["tables"])
    separate_v = {s for s in chosen if s.head_dim_v != s.head_dim}
    assert separate_v == set(committed.separate_v_bwd_specs("sm90") + committed.separate_v_bwd_specs("sm80"))
    assert {s.arch for s in separate_v} == {"sm90", "sm80"} and {s.direction for s in separate_v} == {"bwd"}
    small = {
        c.spec(s.arch, s.direction, s.dtype, s.head_dim, mask=s.mask)
        for s in chosen for c in small_smem_configs(s.arch, s.direction, s.dtype, s.head_dim)
    }  # fmt: skip
    assert small and small <= chosen


def test_tuned_tables_name_committed_valid_variants():
    tables = sorted(committed.TUNED_DIR.glob("*.json"))
    assert tables
    for path in tables:
        raw = json.loads(path.read_text())
        for entry in raw["entries"]:
            spec = parse_name(entry["variant"])
            assert spec in COMMITTED, (path.name, spec.name)
            assert rules.why_invalid(spec) is None, (path.name, spec.name)
            assert (spec.arch, spec.direction) == (raw["arch"], raw.get("direction", "fwd")), (
                path.name,
                spec.name,
            )
    assert set(committed.tuned_variants()) <= COMMITTED


def test_committed_set_is_valid_sorted_and_small():
    for arch in ARCHS:
        variants = committed.default_variants(arch)
        assert variants == sorted(set(variants)), arch
        assert variants == sorted(
            committed.default_variants(arch, "fwd") + committed.default_variants(arch, "bwd")
        )
        for spec in variants:
            assert rules.why_invalid(spec) is None, spec.name
            assert any(rules.why_not_on(spec, t) is None for t in TARGETS), spec.name
    # the defaults (every family, direction, dtype and head dim it has, the tuned head dims too, both
    # masks) are all in it
    defaults = {
        config.spec(arch, direction, dtype, hd, mask=mask)
        for arch, direction, dtype, hd in itertools.product(ARCHS, DIRECTIONS, DTYPES, COMMITTED_HEAD_DIMS)
        if (config := default_config(arch, direction, dtype, hd)) is not None
        for mask in (Mask.NONE, Mask.CAUSAL)
    }
    assert defaults <= COMMITTED
    assert len(COMMITTED) < 2 * len(defaults)  # the defaults, the tables' picks and a few fallbacks


def test_fitting_variant_finds_the_small_tiles():
    """On the 99 KiB GPUs (sm_86, sm_89) an sm80 default that does not fit falls back to the largest
    committed tile like it that does; hd192 and hd256 have no backward tile there."""
    for target in ("sm_86", "sm_89"):
        for direction, hd in (("fwd", 256), ("bwd", 64), ("bwd", 96), ("bwd", 128)):
            spec = default_config("sm80", direction, "bf16", hd).spec("sm80", direction, "bf16", hd)
            assert rules.why_not_on(spec, target) is not None, spec.name
            (small,) = small_smem_configs("sm80", direction, "bf16", hd)
            assert rules.fitting_variant(spec, target) == small.spec("sm80", direction, "bf16", hd)
        for hd in (192, 256):
            spec = default_config("sm80", "bwd", "fp16", hd).spec("sm80", "bwd", "fp16", hd, mask=Mask.CAUSAL)
            assert rules.fitting_variant(spec, target) is None
    spec = default_config("sm80", "fwd", "bf16", 128).spec("sm80", "fwd", "bf16", 128)
    assert rules.fitting_variant(spec, "sm_86") == spec  # 97 KiB: the default fits


@pytest.mark.parametrize(("gpu_name", "model"), [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200")])
def test_dispatch_takes_the_table_of_the_gpu_it_runs_on(monkeypatch, gpu_name, model):
    """The committed tables of the H100 and the H200: a problem on either GPU takes the entry of its
    own GPU's table, forward (its reason names the file) and backward (the entry's variant)."""
    monkeypatch.delenv("CUTEFA_TUNED_DIR", raising=False)
    dispatch.clear_caches()
    try:
        fwd = dispatch.choose(
            target="sm_90a", dtype=torch.bfloat16, head_dim=128, causal=False, seqlen_q=16384, seqlen_k=16384,
            batch=1, heads_q=16, heads_kv=16, gpu_name=gpu_name,
        )  # fmt: skip
        assert f"tuned table sm90_{model}.json" in fwd.reason, fwd.reason
        raw = json.loads((committed.TUNED_DIR / f"sm90_bwd_{model}.json").read_text())
        # causal at 1k keys: the two GPUs' tables name different variants there
        rows = [e for e in raw["entries"] if (e["dtype"], e["head_dim"], e["causal"]) == ("bf16", 128, True)]
        entry = min(
            (e for e in rows if e["max_seqlen_k"] is None or e["max_seqlen_k"] >= 1024),
            key=lambda e: e["max_seqlen_k"] or 1 << 30,
        )
        bwd = choose_bwd("sm_90a", torch.bfloat16, 128, True, seqlen_k=1024, gpu_name=gpu_name)
        assert bwd.name == entry["variant"]
    finally:
        dispatch.clear_caches()
