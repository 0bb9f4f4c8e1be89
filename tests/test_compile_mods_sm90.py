"""Mod kernels of the sm90 forward (WGMMA, warp-specialized, a user's score_mod/mask_mod fused)
compile on this CPU for sm_90a and keep the FlashAttention-3 design in SASS (HGMMA, UTMALDG,
USETMAXREG, SYNCS) without a spill, at the key blocks cutefa.mods.base picks: causal with a
relative-bias table read per score and document ids (64-key blocks), and softcap as a score_mod
with prefix-LM and a block mask's ranges (128-key blocks, MUFU.TANH)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cpu_support import compile_in_child
from test_mods_examples import document_mask, prefix_lm, relative_bias, softcap_mod

from cutefa import sass
from cutefa.mods import trace_mods
from cutefa.mods.base import mod_base
from cutefa.mods.variant import ModVariantSpec

TESTS = Path(__file__).resolve().parent


def sample_specs() -> list[ModVariantSpec]:
    doc = torch.zeros(2, 64, dtype=torch.int32)
    table = torch.zeros(4, 127)
    bias_docs = trace_mods(relative_bias(table, 64), document_mask(doc))
    capped = trace_mods(softcap_mod(), prefix_lm(16))
    return [
        ModVariantSpec(
            mod_base("sm_90a", "bf16", 128, True, reads_per_score=bias_docs.reads_per_score()), bias_docs
        ),
        ModVariantSpec(
            mod_base("sm_90a", "bf16", 128, False, reads_per_score=capped.reads_per_score()),
            capped,
            block_sparse=True,
        ),
    ]


_CHILD = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_compile_mods_sm90 import sample_specs
from cutefa import compile as cc
dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
found = {{}}
for spec in sample_specs():
    cc.compile_variant(spec, "sm_90a")
    found[spec.name] = str(sorted(dump.glob(f"*_{{spec.name}}Kernel_*.cubin"))[0])
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("mods_sm_90a")
    return compile_in_child(out, "sm_90a", _CHILD, TESTS)


@pytest.mark.compile
@pytest.mark.parametrize("index", [0, 1])
def test_sm90_mod_kernels_compile_without_spills(compiled, index):
    spec = sample_specs()[index]
    assert spec.arch == "sm90" and spec.tile_n == (64, 128)[index]
    report = sass.analyze(Path(compiled[spec.name]))
    assert report.missing("sm90") == [], f"{spec.name}: {report.summary()}"
    assert 0 < report.registers <= 255, f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    tanh = sum(report.forms_of("MUFU.TANH").values())
    assert (tanh > 0) == (index == 1), f"{spec.name}: {tanh} MUFU.TANH"
