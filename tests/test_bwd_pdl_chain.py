"""The sm90 backward's launch chain: every kernel after the preprocess is launched as a programmatic
dependent (``use_pdl=pdl.supported()``), so that no launch gap separates it from its predecessor;
the preprocess, first of the chain, is launched plainly (the main kernel's loads wait for it).
Read from each rendered module's source (ast), for every sm90 backward variant."""

from __future__ import annotations

import ast

import pytest
from cpu_support import all_variants

from cutefa import codegen

BWD = all_variants("sm90", "bwd")


def _launches(source: str) -> dict[str, list[ast.Call]]:
    """Each ``self.<kernel>(...).launch(...)`` call of the module, by kernel name."""
    found: dict[str, list[ast.Call]] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "launch" or not isinstance(node.func.value, ast.Call):
            continue
        target = node.func.value.func
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            found.setdefault(target.attr, []).append(node)
    return found


def _pdl(call: ast.Call) -> bool:
    return any(k.arg == "use_pdl" and ast.unparse(k.value) == "pdl.supported()" for k in call.keywords)


@pytest.mark.parametrize("spec", BWD, ids=lambda s: s.name)
def test_kernels_after_the_preprocess_are_programmatic_dependents(spec):
    launches = _launches(codegen.render_source(spec))
    assert {"preprocess", "kernel", "postprocess"} <= set(launches), sorted(launches)
    for name, calls in launches.items():
        for call in calls:
            if name == "preprocess":
                assert not _pdl(call), f"{spec.name}: the preprocess is first of the chain"
            else:
                assert _pdl(call), f"{spec.name}: {name} launched at line {call.lineno} without use_pdl"
