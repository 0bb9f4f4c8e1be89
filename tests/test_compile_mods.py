"""Mod kernels (the sm80 forward with a user's score_mod/mask_mod fused) compile on this CPU for
sm_80 and keep the FlashAttention-2 design in SASS (HMMA, LDSM, LDGSTS, MUFU.EX2; MUFU.TANH for the
softcap written as a score_mod), registers within 255 and (almost) no spills; a second trace of the same mods
finds the first compile's cache entry (no recompile)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cpu_support import compile_in_child
from test_mods_examples import document_mask, prefix_lm, relative_bias, softcap_mod

from cutefa import sass
from cutefa.mods import trace_mods
from cutefa.mods.api import mod_base
from cutefa.mods.variant import ModVariantSpec

TESTS = Path(__file__).resolve().parent
# SassReport.spills (STL + LDL instructions + stack and local bytes) each sample may have: the
# relative-bias forward spills one register (one STL, one LDL, 8 bytes of stack)
SPILLS = (10, 0, 0, 0)


def sample_specs() -> list[ModVariantSpec]:
    """Forward and backward of two pairs of mods: causal with a relative-bias table and document
    masking (two captured tensors, every block), and softcap as a score_mod with prefix-LM (with a
    block mask's ranges)."""
    doc = torch.zeros(2, 64, dtype=torch.int32)
    table = torch.zeros(4, 127)
    bias_docs = trace_mods(relative_bias(table, 64), document_mask(doc))
    capped = trace_mods(softcap_mod(), prefix_lm(16))
    bwd = mod_base("sm_80", "bf16", 128, causal=False, direction="bwd")
    return [
        ModVariantSpec(mod_base("sm_80", "bf16", 128, causal=True), bias_docs),
        ModVariantSpec(mod_base("sm_80", "bf16", 128, causal=False), capped, block_sparse=True),
        ModVariantSpec(bwd.replace(causal=True), bias_docs),
        ModVariantSpec(bwd, capped, block_sparse=True),
    ]


_CHILD = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_compile_mods import sample_specs
from cutefa import compile as cc
dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
found = {{}}
for spec in sample_specs():
    cc.compile_variant(spec, "sm_80")
    found[spec.name] = str(sorted(dump.glob(f"*_{{spec.name}}Kernel_*.cubin"))[0])
again = sample_specs()[0]  # the same mods traced again (new closures, new tensors)
start = time.perf_counter()
path = cc.compile_variant(again, "sm_80")
found["again"] = [cc._entry(again, "sm_80").committed(), time.perf_counter() - start, str(path)]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("mods_sm_80")
    return compile_in_child(out, "sm_80", _CHILD, TESTS)


@pytest.mark.compile
@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_mod_kernels_compile_for_sm80(compiled, index):
    spec = sample_specs()[index]
    report = sass.analyze(Path(compiled[spec.name]))
    assert report.missing("sm80") == [], f"{spec.name}: {report.summary()}"
    assert 0 < report.registers <= 255, f"{spec.name}: {report.summary()}"
    # The relative-bias forward reads a table per score on top of the dense kernel's 230 registers.
    assert report.spills <= SPILLS[index], f"{spec.name} spills: {report.summary()}"
    tanh = sum(report.forms_of("MUFU.TANH").values())
    assert (tanh > 0) == (index in (1, 3)), f"{spec.name}: {tanh} MUFU.TANH"


@pytest.mark.compile
def test_the_same_mods_do_not_recompile(compiled):
    committed, seconds, path = compiled["again"]
    assert committed and path.endswith("kernel.so")
    assert seconds < 2.0, f"the second trace of the same mods took {seconds:.1f} s (a recompile?)"
