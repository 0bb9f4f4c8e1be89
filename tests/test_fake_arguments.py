"""The sample arguments a kernel is compiled with (a template's ``fake_arguments`` or the shared
one in cutefa/compile.py) give each tensor stride its own symbol: the compiled signature binds
equal symbols to equal values, so a tensor whose strides share one symbol is refused at call time
for every real layout whose strides differ (an append call into the decode kernel once failed
every call this way). Checked on the sample of kernels that covers every template
(tools/sass_reference.py) and on feature variants; no compile, no GPU."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from cutefa import codegen
from cutefa.compile import _fake_arguments
from cutefa.model import policy_decode, policy_mla
from cutefa.model.feature_sets import feature_variants
from cutefa.model.spec import parse_name

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import cutlass
from cutlass import cute
from sass_reference import SAMPLE


def _specs():
    specs = [parse_name(s.name) for s in SAMPLE]
    specs += [policy_decode.decode_spec("bf16", 128, 4, paged=paged) for paged in (False, True)]
    specs.append(policy_mla.mla_spec("bf16", 64))
    for arch, direction in (
        ("sm80", "fwd"),
        ("sm80", "bwd"),
        ("sm90", "fwd"),
        ("sm90", "bwd"),
        ("sm100", "fwd"),
    ):
        found = [s for s in feature_variants(arch, direction) if s.head_dim == 128 and s.dtype == "bf16"]
        specs += found[:3] + [s for s in found if s.features.varlen][:1]
    return list(dict.fromkeys(specs))


@pytest.mark.parametrize("spec", _specs(), ids=lambda s: s.name)
def test_every_tensor_stride_is_its_own_symbol(spec):
    module = types.ModuleType(spec.name)
    exec(compile(codegen.render_source(spec), spec.name, "exec"), module.__dict__)  # noqa: S102 (our own rendered kernel)
    make = getattr(module, "fake_arguments", _fake_arguments)
    args = make(parse_name(getattr(module, "FAKE_SPEC_NAME", spec.name)), cutlass, cute)
    tensors = [a for a in args if hasattr(a, "stride") and hasattr(a, "shape")]
    assert tensors, f"{spec.name}: no tensor among the sample arguments"
    for i, t in enumerate(tensors):
        symbolic = [s for s in t.stride if not isinstance(s, int)]
        assert len({id(s) for s in symbolic}) == len(symbolic), (
            f"{spec.name}: tensor argument {i} (shape {t.shape}) has strides {t.stride} sharing a symbol"
        )
