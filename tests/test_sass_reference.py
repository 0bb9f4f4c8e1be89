"""A sample of dispatchable default kernels, one or more per template, compiles in this tree to the
SASS recorded in tests/data/sass_reference.json, instruction for instruction (tools/sass_reference.py
made the file and names the tree it was recorded from). The SASS is compared normalized: without
addresses and without the kernel's symbol name, so a variant renamed with the same code compares
equal. On a difference the test prints the opcode forms whose counts changed.

The compile tests (one per sample variant, 5-15 s each on two cores, under two minutes for the
sample) can be sampled by name (``-k sm90_bwd``). A kernel change that is meant: re-record with
``python tools/sass_reference.py --write`` once the benchmark shows no loss."""

from __future__ import annotations

from pathlib import Path

import pytest
from cpu_support import load_tool

from cutefa import codegen
from cutefa.model.options import options_class
from cutefa.model.rules import why_invalid
from cutefa.model.spec import ARCHS, DIRECTIONS, DTYPES, parse_name

tool = load_tool("sass_reference")
REFERENCE = tool.load_reference()
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "cutefa" / "templates"


def test_reference_holds_the_sample():
    assert list(REFERENCE["variants"]) == [s.name for s in tool.SAMPLE]
    for sample in tool.SAMPLE:
        record = REFERENCE["variants"][sample.name]
        assert record["target"] == sample.target
        assert record["instructions"] == sum(record["opcodes"].values()) > 0
        assert len(record["sha256"]) == len(record["encoding_sha256"]) == 64
    assert REFERENCE["commit"] and REFERENCE["dsl_version"]


def test_sample_is_committed_and_named_as_today():
    """Each sample is a committed variant, or a valid feature variant (rendered on demand: the
    decode kernels, packed sequences...), under today's name."""
    for sample in tool.SAMPLE:
        spec = parse_name(sample.name)
        assert spec.name == sample.name
        committed = codegen.module_path(spec).is_file()
        assert committed or (spec.features.any and why_invalid(spec) is None), (
            f"{sample.name} is neither in the committed set nor a valid feature variant"
        )
        assert spec.runs_on(sample.target)


def test_sample_covers_every_template_and_option_record():
    specs = [parse_name(s.name) for s in tool.SAMPLE]
    templates = {p.name for p in TEMPLATES_DIR.glob("*.py.j2")}
    assert templates and {codegen.template_name(spec) for spec in specs} == templates
    records = set()
    for arch in ARCHS:
        for direction in DIRECTIONS:
            for dtype in DTYPES:
                records.add(options_class(arch, direction, dtype))
    assert {type(spec.options) for spec in specs} == records


# A few lines in the shape ``cuobjdump -sass`` prints (two encoding words per instruction).
_SASS = """
\tcode for sm_90a
\t\tFunction : kernel_cutlass_kernel_{name}Kernel_object_at__tensor_0
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*{a0}*/                   MOV R1, c[0x0][0x28] ;                   /* 0x00000a0000017a02 */
                                                                            /* 0x000fe40000000f00 */
        /*{a1}*/              @!P0 BRA 0x{target} ;                         /* 0x0000000000008947 */
                                                                            /* 0x000fea0003800000 */
        /*{a2}*/                   {last} ;                                 /* 0x000000000000794d */
                                                                            /* 0x000fea0003800000 */
"""


def _sass(
    name="cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp",
    addresses=("0000", "0010", "0020"),
    last="EXIT",
    target="20",
):
    a0, a1, a2 = addresses
    return _SASS.format(name=name, a0=a0, a1=a1, a2=a2, last=last, target=target)


def test_normalize_drops_addresses_encodings_and_the_name():
    one = tool.normalize(_sass(), "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp")
    renamed = tool.normalize(
        _sass(name="cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_xx", addresses=("1000", "1010", "1020")),
        "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_xx",
    )
    assert one.text == renamed.text and one.encodings == renamed.encodings
    assert one.count == 3 and one.opcodes == {"MOV": 1, "BRA": 1, "EXIT": 1}
    assert "ov_pp" not in one.text and "0x000fe40000000f00" not in one.text
    assert "0x00000a0000017a02 0x000fe40000000f00" in one.encodings


def test_normalize_keeps_every_instruction_difference():
    base = tool.normalize(_sass(), "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp").record()
    for changed in (_sass(last="RET.ABS"), _sass(target="30")):
        other = tool.normalize(changed, "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp").record()
        assert other["sha256"] != base["sha256"]
    with pytest.raises(ValueError, match="no instructions"):
        tool.normalize("\tcode for sm_90a\n", "x")


def test_mismatch_names_the_opcodes_that_changed():
    expected = {
        "sha256": "a",
        "encoding_sha256": "b",
        "instructions": 3,
        "registers": 40,
        "opcodes": {"MOV": 1, "BRA": 1, "EXIT": 1},
    }
    assert tool.mismatch("v", expected, dict(expected)) is None
    assert "encodings" in tool.mismatch("v", expected, {**expected, "encoding_sha256": "c"})
    found = {**expected, "sha256": "c", "instructions": 4, "opcodes": {"MOV": 2, "BRA": 1, "EXIT": 1}}
    report = tool.mismatch("v", expected, found)
    assert "3 -> 4 instructions" in report and "MOV: 1 -> 2" in report and "BRA" not in report


@pytest.mark.compile
@pytest.mark.parametrize("sample", tool.SAMPLE, ids=lambda s: s.name)
def test_same_sass_as_reference(sample, tmp_path):
    found, _, _ = tool.compile_sample(sample, tmp_path)
    assert found["compiled_as"] == sample.name
    problem = tool.mismatch(sample.name, REFERENCE["variants"][sample.name], found)
    assert problem is None, problem
