"""Pack selection on the CPU: ``cutefa compile`` by family, direction, dtype, head dim, mask, feature
and name glob, and ``--for-model`` on Hugging Face configs (tests/data/models/). The compiler is
stubbed: these tests check what is selected, not how it compiles."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from cutefa import cli, dispatch, pack, pack_build, selection, tuned_tables
from cutefa import compile as cc
from cutefa.model.committed import default_variants
from cutefa.model.defaults import default_spec
from cutefa.model.options import Mask, Scheduler
from cutefa.model.rules import why_not_on
from cutefa.model.spec import Features, VariantSpec

MODELS = Path(__file__).parent / "data" / "models"
TARGET = "sm_90a"
# What sm_90a runs: the sm90 and sm80 committed variants that its shared memory holds.
UNIVERSE = [s for f in ("sm90", "sm80") for s in default_variants(f) if why_not_on(s, TARGET) is None]


@pytest.fixture
def built(monkeypatch, tmp_path):
    """``compile --pack`` with the compiler replaced: records what would be built, writes a pack of
    dummy files (so the size line has something to measure)."""
    calls = []

    def build_pack(specs, *, target, pack_dir, jobs, progress):
        calls.append((list(specs), target))
        writer = pack.PackWriter(pack_dir, target)
        so = tmp_path / "kernel.so"
        so.write_bytes(b"x" * 1024)
        for s in specs:
            writer.add(
                s.name, s.arch, s.direction, so, fingerprint="f" * 64, function_name=s.name, runtime="cu12"
            )
        return [cc.CompileResult(s, True, 0.5, None, Path(pack_dir) / f"{s.name}.so") for s in specs]

    monkeypatch.setattr(pack_build, "build_pack", build_pack)
    return calls


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["compile", "--target", TARGET, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------------------------
# Selection by flag


FLAG_CASES = {
    "family": (["--family", "sm80"], lambda s: s.arch == "sm80"),
    "families": (["--family", "sm90", "--family", "sm80"], lambda s: True),
    "direction": (["--direction", "bwd"], lambda s: s.direction == "bwd"),
    "dtype": (["--dtype", "e4m3"], lambda s: s.dtype == "e4m3"),
    "dtypes": (["--dtype", "fp16,e4m3"], lambda s: s.dtype in ("fp16", "e4m3")),
    "head_dim": (["--head-dim", "64", "--head-dim", "192"], lambda s: s.head_dim in (64, 192)),
    "mask": (["--mask", "none"], lambda s: not s.causal),
    "combined": (
        [
            "--family",
            "sm90",
            "--direction",
            "fwd",
            "--dtype",
            "bf16",
            "--head-dim",
            "128",
            "--mask",
            "causal",
        ],
        lambda s: (s.arch, s.direction, s.dtype, s.head_dim, s.causal) == ("sm90", "fwd", "bf16", 128, True),
    ),
    "glob": (
        ["--kernels", "sm90_bwd_*hd64*"],
        lambda s: s.name.startswith("cutefa_sm90_bwd_") and "_hd64_" in s.name,
    ),
    "glob_and_flag": (
        ["--kernels", "*hd96*", "--direction", "fwd"],
        lambda s: s.head_dim == 96 and s.direction == "fwd",
    ),
}


@pytest.mark.parametrize("case", FLAG_CASES, ids=FLAG_CASES)
def test_each_flag_selects_exactly_its_variants(case, built, capsys, tmp_path):
    argv, keep = FLAG_CASES[case]
    expected = [s for s in UNIVERSE if keep(s)]
    assert 0 < len(expected) <= len(UNIVERSE)
    code, out, _ = run(capsys, *argv, "--pack", str(tmp_path / "p"))
    assert code == 0
    ((specs, target),) = built
    assert target == TARGET and specs == expected
    assert f"selected {len(expected)} kernel(s) for {TARGET}: " in out
    assert f"{len(expected)} compiled, 0 failed" in out
    assert (
        f"pack: {tmp_path / 'p'} (manifest.json): {len(expected)} kernel(s), " in out
        and " MiB on disk, built in " in out
    )


def test_selection_counts_split_the_universe():
    """The per-axis selections partition the target's committed set (each variant counted once)."""
    for axis, values in (
        ("families", ("sm90", "sm80")), ("directions", ("fwd", "bwd")), ("dtypes", ("fp16", "bf16", "e4m3")),
        ("head_dims", (64, 80, 96, 112, 128, 192, 256)), ("masks", (Mask.NONE, Mask.CAUSAL)),
    ):  # fmt: skip
        parts = [selection.select(UNIVERSE, selection.Selection(**{axis: (v,)})) for v in values]
        assert sum(map(len, parts)) == len(UNIVERSE), axis
        assert sorted(itertools.chain(*parts)) == sorted(UNIVERSE), axis


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--feature", "softcap"], "no kernel implements softcap yet"),
        (["--feature", "paged"], "no kernel implements paged_kv yet"),
        (["--feature", "varlen,alibi"], "no kernel implements varlen yet; no kernel implements alibi yet"),
        (["--mask", "local"], "no kernel implements the local mask yet"),
        (["--family", "sm80", "--dtype", "e4m3"], "--family sm80 --dtype e4m3 matches none of the"),
        (["--kernels", "sm80_fwd_nope*"], "--kernels sm80_fwd_nope* matches none of the"),
        (["--family", "sm100"], "--family sm100 kernels cannot run on --target sm_90a"),
    ],
)
def test_unimplemented_or_empty_selections_are_errors(argv, words, built, capsys):
    code, _, err = run(capsys, *argv)
    assert code == 2 and words in err
    assert built == []  # nothing compiled, no empty pack


def test_bad_flag_values_are_refused(capsys):
    for argv, words in (
        (["--feature", "fancy"], "['fancy'] not accepted"),
        (["--head-dim", "72"], "['72'] not accepted: give 64, 80, 96, 112, 128, 192, 256"),
        (["--mask", "sliding"], "['sliding'] not accepted"),
        (["--direction", "sideways"], "['sideways'] not accepted"),
    ):
        with pytest.raises(SystemExit):
            cli.main(["compile", "--target", TARGET, *argv])
        assert words in capsys.readouterr().err


def test_a_feature_counts_once_a_kernel_implements_it():
    """The "no kernel yet" check reads the variants, not a list: a softcap variant is selectable."""
    plain = VariantSpec("sm90", "fwd", "bf16", 128, 128, 128, 2, 12, causal=True)
    capped = plain.replace(features=Features(softcap=True))
    chosen = selection.select([plain, capped], selection.Selection(features=("softcap",)))
    assert chosen == [capped]
    with pytest.raises(selection.SelectionError, match="no kernel implements softcap yet"):
        selection.select([plain], selection.Selection(features=("softcap",)))


def test_selection_rejects_unknown_values():
    with pytest.raises(selection.SelectionError, match="--family 'sm70' is not one of"):
        selection.Selection(families=("sm70",))
    with pytest.raises(selection.SelectionError, match="--head-dim 0 is not a positive head dim"):
        selection.Selection(head_dims=(0,))


# ---------------------------------------------------------------------------------------------
# config.json


def test_read_model_configs():
    llama = selection.read_model_config(MODELS / "llama3_8b.json")
    assert (llama.head_dim, llama.head_dim_v, llama.heads, llama.kv_heads, llama.dtype) == (
        128,
        128,
        32,
        8,
        "bf16",
    )
    assert (llama.sliding_window, llama.softcap, llama.alibi) == (None, None, False)
    mistral = selection.read_model_config(MODELS / "mistral_7b.json")
    assert (mistral.head_dim, mistral.sliding_window) == (128, 4096)
    qwen = selection.read_model_config(MODELS / "qwen2_7b.json")
    assert (qwen.head_dim, qwen.heads, qwen.kv_heads) == (128, 28, 4)  # 3584 / 28
    assert qwen.sliding_window is None  # use_sliding_window: false
    gemma2 = selection.read_model_config(MODELS / "gemma2_9b.json")
    assert (gemma2.head_dim, gemma2.heads, gemma2.kv_heads) == (256, 16, 8)  # head_dim, not 3584 / 16
    assert (gemma2.sliding_window, gemma2.softcap, gemma2.dtype, gemma2.torch_dtype) == (
        4096,
        50.0,
        None,
        "float32",
    )
    gemma3 = selection.read_model_config(MODELS / "gemma3_4b.json")  # text_config, dtype from the top level
    assert (gemma3.head_dim, gemma3.heads, gemma3.kv_heads, gemma3.dtype) == (256, 8, 4, "bf16")
    assert (gemma3.sliding_window, gemma3.softcap) == (1024, None)
    phi = selection.read_model_config(MODELS / "phi2.json")
    assert (phi.head_dim, phi.kv_heads, phi.dtype) == (80, 32, "fp16")


def test_model_config_windows_and_mla(tmp_path):
    def read(**config):
        path = tmp_path / "config.json"
        path.write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32, **config}))
        return selection.read_model_config(path)

    assert (
        read(sliding_window=4096, max_position_embeddings=4096).sliding_window is None
    )  # covers the context
    assert read(sliding_window=512, layer_types=["full_attention"] * 4).sliding_window is None
    assert read(sliding_window=512, layer_types=["sliding_attention", "full_attention"]).sliding_window == 512
    assert read(sliding_window=None).sliding_window is None
    mla = read(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_key_value_heads=32)
    assert (mla.head_dim, mla.head_dim_v) == (192, 128)
    assert read(alibi=True).alibi and read(attn_config={"alibi": True}).alibi


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"hidden_size": 4096}, "num_attention_heads is None, not a positive integer"),
        ({"hidden_size": 4100, "num_attention_heads": 32}, "hidden_size 4100 is not a multiple of"),
        (
            {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 5},
            "32 heads do not divide into 5",
        ),
        ([1, 2], "not a config.json object"),
    ],
)
def test_model_config_errors_name_the_field(tmp_path, config, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(selection.SelectionError, match=words):
        selection.read_model_config(path)
    with pytest.raises(selection.SelectionError, match="cannot read it"):
        selection.read_model_config(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------
# What a model needs


def dispatch_picks(target: str, dtype: str, head_dim: int, causal: bool) -> set[VariantSpec]:
    """What dispatch chooses for the forward at every seqlen bucket, on every GPU with a table."""
    gpus = [None] + sorted({t.gpu for t in tuned_tables.tuned_tables() if t.target == target})
    return {
        dispatch.choose(target=target, dtype=dtype, head_dim=head_dim, causal=causal, seqlen_q=n, seqlen_k=n,
                        batch=1, heads_q=8, heads_kv=8, gpu_name=gpu).spec
        for n in [2**i for i in range(18)] for gpu in gpus
    }  # fmt: skip


def table_entries(
    arch: str, direction: str, target: str, dtype: str, head_dim: int, causal: bool
) -> set[str]:
    return {
        e.variant
        for t in tuned_tables.tuned_tables()
        if (t.arch, t.direction, t.target) == (arch, direction, target)
        for e in t.entries
        if (e.dtype, e.head_dim, e.causal) == (dtype, head_dim, causal)
    }


def test_llama_needs_the_causal_bf16_hd128_kernels_dispatch_can_pick():
    plan = selection.model_plan(selection.read_model_config(MODELS / "llama3_8b.json"), TARGET)
    names = {s.name for s in plan.specs}
    assert plan.notes == ()
    dense = [s for s in plan.specs if not s.features.any]
    assert {(s.arch, s.dtype, s.head_dim, s.causal) for s in dense} == {("sm90", "bf16", 128, True)}
    assert {s.direction for s in dense} == {"fwd", "bwd"}
    # padded and packed batches: the varlen forward and backward of the sm90 family
    packed = {(s.arch, s.direction) for s in plan.specs if s.features.any}
    assert packed == {("sm90", "fwd"), ("sm90", "bwd")}
    assert all(s.features == Features(varlen=True) and s.causal for s in plan.specs if s.features.any)
    for direction in ("fwd", "bwd"):  # every tuned entry
        entries = table_entries("sm90", direction, TARGET, "bf16", 128, True)
        assert entries and entries <= names
    assert dispatch_picks(TARGET, "bf16", 128, True) <= set(plan.specs)
    for direction in ("fwd", "bwd"):  # and the defaults
        assert default_spec("sm90", direction, "bf16", 128, causal=True) in plan.specs
    tables = table_entries("sm90", "fwd", TARGET, "bf16", 128, True) | table_entries(
        "sm90", "bwd", TARGET, "bf16", 128, True
    )
    assert len(dense) - len(tables) <= 2  # at most the two defaults beyond the tables


def test_a_model_on_an_older_target_gets_that_targets_kernels():
    plan = selection.model_plan(selection.read_model_config(MODELS / "llama3_8b.json"), "sm_80")
    assert {s.arch for s in plan.specs} == {"sm80"} and {s.direction for s in plan.specs} == {"fwd", "bwd"}
    assert {s.features for s in plan.specs} == {Features(), Features(varlen=True)}
    assert dispatch_picks("sm_80", "bf16", 128, True) <= set(plan.specs)
    assert all(why_not_on(s, "sm_80") is None for s in plan.specs)


def test_mistral_and_qwen_need_what_llama_needs_with_their_notes():
    llama = selection.model_plan(selection.read_model_config(MODELS / "llama3_8b.json"), TARGET)
    mistral = selection.model_plan(selection.read_model_config(MODELS / "mistral_7b.json"), TARGET)
    qwen = selection.model_plan(selection.read_model_config(MODELS / "qwen2_7b.json"), TARGET)
    assert llama.specs == qwen.specs  # GQA ratios are runtime arguments
    # Mistral: Llama's kernels and its sliding window's, dense and packed
    windowed = set(mistral.specs) - set(llama.specs)
    assert set(llama.specs) < set(mistral.specs) and windowed
    assert {(s.mask, s.features) for s in windowed} == {
        (Mask.LOCAL, Features()),
        (Mask.LOCAL, Features(varlen=True)),
    }
    assert {(s.arch, s.direction) for s in windowed} == {("sm90", "fwd"), ("sm90", "bwd")}
    assert mistral.notes == () and qwen.notes == ()


def test_gemma2_gets_hd256_kernels_and_a_note_per_gap():
    plan = selection.model_plan(selection.read_model_config(MODELS / "gemma2_9b.json"), TARGET)
    dense = [s for s in plan.specs if s.mask is not Mask.LOCAL and not s.features.any]
    assert {(s.arch, s.dtype, s.head_dim, s.causal) for s in dense} == {("sm90", "bf16", 256, True)}
    assert {s.direction for s in plan.specs} == {"fwd", "bwd"}
    assert dispatch_picks(TARGET, "bf16", 256, True) <= set(plan.specs)
    # its softcap on every layer, its window on the local ones, dense and packed
    featured = {(s.mask, s.features) for s in plan.specs if s not in dense}
    assert featured == {
        (mask, Features(softcap=True, varlen=varlen))
        for mask in (Mask.CAUSAL, Mask.LOCAL)
        for varlen in (False, True)
    }
    text = "\n".join(plan.notes)
    assert len(plan.notes) == 1
    assert "torch_dtype float32" in text and "selecting bf16" in text
    assert "final_logit" not in text  # the LM head's cap, not attention's


def test_model_selection_takes_the_other_flags():
    model = selection.read_model_config(MODELS / "llama3_8b.json")
    fwd = selection.model_plan(model, TARGET, selection.Selection(directions=("fwd",)))
    assert {s.direction for s in fwd.specs} == {"fwd"} and set(fwd.specs) < set(
        selection.model_plan(model, TARGET).specs
    )
    both = selection.model_plan(model, TARGET, selection.Selection(masks=(Mask.NONE, Mask.CAUSAL)))
    assert {s.causal for s in both.specs} == {True, False}
    assert dispatch_picks(TARGET, "bf16", 128, False) <= set(both.specs)
    fp16 = selection.model_plan(model, TARGET, selection.Selection(dtypes=("fp16",)))
    assert {s.dtype for s in fp16.specs} == {"fp16"}
    sm80 = selection.model_plan(model, TARGET, selection.Selection(families=("sm80",)))
    assert {s.arch for s in sm80.specs} == {"sm80"}
    with pytest.raises(selection.SelectionError, match="--head-dim 64 keeps none of its"):
        selection.model_plan(model, TARGET, selection.Selection(head_dims=(64,)))
    with pytest.raises(selection.SelectionError, match="--feature softcap keeps none of its"):
        selection.model_plan(model, TARGET, selection.Selection(features=("softcap",)))
    with pytest.raises(selection.SelectionError, match="no kernel implements paged_kv yet"):
        selection.model_plan(model, TARGET, selection.Selection(features=("paged_kv",)))
    packed = selection.model_plan(model, TARGET, selection.Selection(features=("varlen",)))
    assert packed.specs and all(s.features.varlen for s in packed.specs)


def test_for_model_command_prints_the_selection_and_the_warnings(built, capsys, tmp_path):
    out_dir = tmp_path / "p"
    code, out, err = run(capsys, "--for-model", str(MODELS / "mistral_7b.json"), "--pack", str(out_dir))
    assert code == 0
    ((specs, _),) = built
    expected = selection.model_plan(selection.read_model_config(MODELS / "mistral_7b.json"), TARGET).specs
    assert tuple(specs) == expected
    fwd = sum(s.direction == "fwd" for s in specs)
    assert (
        f"model {MODELS / 'mistral_7b.json'}: head_dim 128, 32 heads, 8 kv heads, torch_dtype bfloat16" in out
    )
    assert all(s.arch == "sm90" for s in specs)  # the sm90 backward takes the window and packed batches
    assert f"selected {len(specs)} kernel(s) for {TARGET}: {fwd} sm90 fwd, {len(specs) - fwd} sm90 bwd" in out
    assert err.count("warning: ") == 0
    assert f"{len(specs)} kernel(s), " in out and len(pack.read_pack(out_dir).kernels) == len(specs)


def _deepseek_config(tmp_path, v_head_dim=128):
    path = tmp_path / "config.json"  # DeepSeek-V3's attention (MLA): q/k 128 + 64, v 128
    config = {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": v_head_dim, "torch_dtype": "bfloat16"}  # fmt: skip
    path.write_text(json.dumps(config))
    return selection.read_model_config(path)


def test_a_separate_v_head_dim_selects_the_kernels_of_the_pair(tmp_path):
    """DeepSeek's (192, 128): per direction the default that dispatch runs for the pair (v of 128,
    never an hd192 kernel that would compute v at 192): on Hopper the sm90 forward and backward, and
    for packed batches the sm90 forward and the sm80 backward (the swapped sm90 backward takes no
    packed batch); elsewhere the sm80 ones."""
    model = _deepseek_config(tmp_path)
    plan = selection.model_plan(model, TARGET)
    assert plan.notes == () and all(s.head_dim == 192 and s.head_dim_v == 128 for s in plan.specs)
    causal = {"causal": True, "head_dim_v": 128}
    bwd = default_spec("sm90", "bwd", "bf16", 192, **causal)
    fwd = default_spec("sm90", "fwd", "bf16", 192, **causal)
    packed_bwd = default_spec("sm80", "bwd", "bf16", 192, **causal).replace(features=Features(varlen=True))
    packed = fwd.replace(features=Features(varlen=True))
    uneven = packed.replace(scheduler=Scheduler.LPT)  # what an uneven packed batch runs
    assert set(plan.specs) == {bwd, fwd, packed, uneven, packed_bwd}
    assert bwd in default_variants("sm90")  # committed
    sm80 = selection.model_plan(model, "sm_80")
    assert {(s.arch, s.direction) for s in sm80.specs} == {("sm80", "fwd"), ("sm80", "bwd")}


def test_a_v_head_dim_no_kernel_pairs_is_a_need_no_kernel_covers(tmp_path):
    with pytest.raises(
        selection.SelectionError,
        match=r"v head dim 96 != q/k head dim 192: no kernel implements it \(.*\(192, 128\)",
    ):
        selection.model_plan(_deepseek_config(tmp_path, v_head_dim=96), TARGET)


def test_for_model_with_nothing_selectable_is_an_error(built, capsys, tmp_path):
    config = json.loads((MODELS / "phi2.json").read_text())
    config["hidden_size"] = 32 * 84  # head dim 84: not a multiple of 8
    (tmp_path / "hd84.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "--for-model", str(tmp_path / "hd84.json"))
    assert code == 2 and "nothing to build for" in err and "head_dim 84: no kernel covers it" in err
    code, _, err = run(capsys, "--for-model", str(MODELS / "llama3_8b.json"), "--feature", "paged")
    assert code == 2 and "no kernel implements paged_kv yet" in err
    assert cli.main(["compile", "--for-model", str(MODELS / "llama3_8b.json")]) == 2
    assert "--for-model: give --target" in capsys.readouterr().err
    assert built == []


def test_a_models_pack_holds_what_its_packed_batches_run():
    """Packed batches (even and uneven, short and long) dispatch to kernels the model's plan holds:
    the tuned tables' packed forms and the default's LPT form (dispatch._packed_table_candidate)."""
    import torch

    from cutefa import dispatch
    from cutefa.model.spec import Features

    llama = selection.model_plan(selection.read_model_config(MODELS / "llama3_8b.json"), "sm_90a")
    for seqlen in (1000, 2048, 8192):
        for total_q in (8 * seqlen, seqlen):  # even, uneven
            choice = dispatch.choose(
                target="sm_90a", dtype=torch.bfloat16, causal=True, head_dim=128, seqlen_q=seqlen, seqlen_k=seqlen,
                batch=8, heads_q=32, heads_kv=8, gpu_name="NVIDIA H200", features=Features(varlen=True),
                total_q=total_q,
            )  # fmt: skip
            assert choice.spec in llama.specs, choice.spec.name
