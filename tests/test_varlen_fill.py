"""The packed rows of no sequence (cutefa/kernels/common/varlen_fill.py) on the CPU: the fill's
grid arithmetic, every varlen forward module (16-bit sm80, sm90 on each scheduler, sm100, e4m3 sm90)
launching it from its ``__call__`` before its kernel and no dense module mentioning it (the committed
modules render as committed), the API allocating the outputs without any memset (the kernel's module
writes every row), and the fill kernel's SASS for sm_90a and sm_80 (``compile`` marker)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from cpu_support import pretend_h200, replace_in

import cutefa
from cutefa import codegen, dispatch, sass
from cutefa.api import feature_ops
from cutefa.api import fp8 as fp8_api
from cutefa.kernels.common import varlen_fill
from cutefa.model import committed
from cutefa.model.defaults import default_spec
from cutefa.model.options import Scheduler
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features, VariantSpec

VARLEN = Features(varlen=True)
LAUNCH = "varlen_fill.launch(mCuSeqlensQ, mSeqUsedQ, mO, mLSE, stream)"
IMPORT = "from cutefa.kernels.common import varlen_fill"
TEMPLATES = ("fwd_sm80.py.j2", "fwd_sm90.py.j2", "fwd_sm100.py.j2", "fwd_sm90_fp8.py.j2")


def _varlen_specs() -> list[VariantSpec]:
    sm90 = default_spec("sm90", "fwd", "bf16", 128).replace(features=VARLEN)
    specs = [
        default_spec("sm80", "fwd", "bf16", 128, causal=True).replace(features=VARLEN),
        default_spec("sm80", "fwd", "fp16", 192, head_dim_v=128).replace(features=VARLEN),
        *(sm90.replace(scheduler=scheduler) for scheduler in Scheduler),
        default_spec("sm90", "fwd", "fp16", 192, causal=True, head_dim_v=128).replace(features=VARLEN),
        default_spec("sm90", "fwd", "bf16", 64).replace(
            features=Features(varlen=True, softcap=True, sinks=True)
        ),
        default_spec("sm100", "fwd", "bf16", 128).replace(features=VARLEN),
        default_spec("sm100", "fwd", "bf16", 128).replace(features=VARLEN, cta_pair=True),
        default_spec("sm90", "fwd", "e4m3", 128, causal=True).replace(features=VARLEN),
        default_spec("sm90", "fwd", "e4m3", 64).replace(features=VARLEN),
    ]
    return [s for s in specs if why_invalid(s) is None]


SPECS = _varlen_specs()


# --- the grid ---------------------------------------------------------------------------------


def test_vector_shape_takes_16_byte_stores():
    assert varlen_fill.vector_shape(128, 2) == (8, 16)
    assert varlen_fill.vector_shape(80, 2) == (8, 10)  # every accepted head dim is a multiple of 8
    assert varlen_fill.vector_shape(256, 2) == (8, 32)
    assert varlen_fill.vector_shape(12, 2) == (4, 3)  # a row of no whole 16 bytes: smaller stores
    assert varlen_fill.pairs_per_slice(128, 2) == varlen_fill.SLICE_BYTES // 256


@pytest.mark.parametrize("batch", [1, 8, 100, 511, 512, 513, 4096])
@pytest.mark.parametrize(("total", "heads"), [(0, 16), (10, 1), (16384, 16), (1 << 20, 64)])
def test_slice_counts_bound_the_empty_case(batch, total, heads):
    """At least one CTA a gap; at most MAX_SLICES a gap, SEQUENCE_CTAS over the sequences' gaps
    together (one each past that many sequences): a call with no gap launches a bounded grid."""
    pairs = varlen_fill.pairs_per_slice(128, 2)
    seq, tail = varlen_fill.slice_counts(batch, total, heads, pairs)
    assert 1 <= seq <= varlen_fill.MAX_SLICES and 1 <= tail <= varlen_fill.MAX_SLICES
    assert batch * seq <= max(varlen_fill.SEQUENCE_CTAS, batch)
    # a slice is at most about SLICE_BYTES of out where every row is a gap's, until the caps
    assert tail == min(varlen_fill.MAX_SLICES, max(1, math.ceil(total * heads / pairs)))


def test_slice_counts_of_the_measured_problem():
    """8 x 2048 tokens, 16 heads, hd128 bf16 (64 MiB of out): 64 CTAs a sequence's gap, 128 on the
    tail (640 CTAs that read three lengths each and leave when there is no gap)."""
    assert varlen_fill.slice_counts(8, 8 * 2048, 16, varlen_fill.pairs_per_slice(128, 2)) == (64, 128)
    assert varlen_fill.slice_counts(1, 5, 2, varlen_fill.pairs_per_slice(64, 2)) == (1, 1)


# --- the modules ------------------------------------------------------------------------------


def _call_body(text: str) -> str:
    start = text.index("    def __call__(")
    return text[start : text.index("    @cute.kernel", start)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_varlen_modules_launch_the_fill_before_their_kernel(spec):
    text = codegen.render_source(spec)
    assert IMPORT in text.splitlines()
    body = _call_body(text)
    assert body.count(LAUNCH) == 1 and text.count("varlen_fill.launch(") == 1, spec.name
    assert body.index(LAUNCH) < body.index("self.kernel("), "the fill goes first, on the same stream"
    assert "kernels/common/varlen_fill.py" in text[: text.index(IMPORT)]  # the docstring says so


def test_sample_covers_the_forward_templates_and_schedulers():
    assert {codegen.template_name(s) for s in SPECS} == set(TEMPLATES)
    assert {s.options.scheduler for s in SPECS if s.arch == "sm90" and s.dtype != "e4m3"} == set(Scheduler)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_dense_twins_do_not_fill(spec):
    dense = spec.replace(features=Features(softcap=spec.features.softcap, sinks=spec.features.sinks))
    if why_invalid(dense) is not None:
        dense = dense.replace(scheduler=Scheduler.GRID)
    assert why_invalid(dense) is None, dense.name
    assert "varlen_fill" not in codegen.render_source(dense)


def test_committed_forward_modules_render_as_committed():
    """``cutefa generate --check`` for the forward templates: no dense module changed."""
    specs = [
        s
        for arch in ("sm80", "sm90", "sm100")
        for s in committed.default_variants(arch, "fwd")
        if codegen.template_name(s) in TEMPLATES
    ]
    assert {codegen.template_name(s) for s in specs} == set(TEMPLATES)
    assert codegen.check(specs, complete=False) == []
    assert not any("varlen_fill" in codegen.module_path(s).read_text() for s in specs)


# --- the API: no memset ----------------------------------------------------------------------


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled floating-point tensors: an output nobody writes stays NaN."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", filled)


def _fill_reference(cu_q, used_q, out, lse):
    """What the module's fill does (cutefa/kernels/common/varlen_fill.py), in torch."""
    no_one = torch.ones(out.shape[0], dtype=torch.bool)
    for b in range(cu_q.shape[0] - 1):
        no_one[int(cu_q[b]) : int(cu_q[b]) + int(used_q[b])] = False
    out[no_one] = 0
    lse[:, no_one] = -math.inf
    return no_one


@pytest.fixture
def on_h200(monkeypatch):
    pretend_h200(monkeypatch)
    yield
    dispatch.clear_caches()


CU_Q = torch.tensor([0, 4, 4, 10], dtype=torch.int32)  # sequence 1 is empty; rows 10.. are a tail
CU_K = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
USED_Q = torch.tensor([3, 0, 6], dtype=torch.int32)  # row 3 is slack


def test_varlen_call_writes_no_memset(on_h200, nan_empty, monkeypatch):
    """The 16-bit call hands the kernel its outputs as allocated (NaN here: no zero_/fill_ of the
    whole tensors first); what the module writes is what the call returns."""
    seen = []

    def kernel(q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, max_q, *rest):
        seen.append((bool(out.isnan().all()), bool(lse.isnan().all()), out.shape, lse.shape))
        rows = ~_fill_reference(cu_q, used_q, out, lse)
        out[rows] = 1.0
        lse[:, rows] = 2.0

    replace_in(monkeypatch, [feature_ops], "get_kernel", lambda spec, target: kernel)
    q, k, v = (torch.randn(n, h, 64, dtype=torch.bfloat16) for n, h in ((13, 4), (12, 2), (12, 2)))
    out, lse = cutefa.flash_attn_varlen_func(
        q, k, v, CU_Q, CU_K, 6, 5, causal=True, seqused_q=USED_Q, return_lse=True
    )
    assert seen == [(True, True, (13, 4, 64), (4, 13))]
    no_one = torch.tensor([3, 10, 11, 12])
    assert (out[no_one] == 0).all() and torch.isneginf(lse[:, no_one]).all()
    assert not out.isnan().any() and not lse.isnan().any()


def test_varlen_call_without_keys_still_fills_on_the_host(on_h200, nan_empty, monkeypatch):
    """No key anywhere: no kernel runs, so the call writes 0 / -inf itself (as before)."""
    replace_in(monkeypatch, [feature_ops], "get_kernel", lambda spec, target: pytest.fail("launched"))
    q = torch.randn(13, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(0, 2, 64, dtype=torch.bfloat16)
    zero = torch.zeros(4, dtype=torch.int32)
    out, lse = cutefa.flash_attn_varlen_func(q, k, v, CU_Q, zero, 6, 0, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_e4m3_varlen_call_writes_no_memset(on_h200, nan_empty, monkeypatch):
    seen = []

    def kernel(q, k, v, out, lse, qd, kd, vd, scale, cu_q, cu_k, used_q, used_k, max_q):
        seen.append((bool(out.isnan().all()), bool(lse.isnan().all())))
        rows = ~_fill_reference(cu_q, used_q, out, lse)
        out[rows] = 1.0
        lse[:, rows] = 2.0

    replace_in(monkeypatch, [fp8_api], "get_kernel", lambda spec, target: kernel)
    q, k, v = (torch.randn(n, h, 64).to(torch.float8_e4m3fn) for n, h in ((13, 4), (12, 2), (12, 2)))
    out, lse = fp8_api.fp8_varlen_forward(q, k, v, CU_Q, CU_K, 6, 5, seqused_q=USED_Q, return_lse=True)
    assert seen == [(True, True)]
    no_one = torch.tensor([3, 10, 11, 12])
    assert (out[no_one] == 0).all() and torch.isneginf(lse[:, no_one]).all()
    assert not out.isnan().any() and not lse.isnan().any()


# --- the backward -----------------------------------------------------------------------------

ZERO_LAUNCHES = [
    "varlen_fill.launch_zero(mCuSeqlensQ, mSeqUsedQ, mdQ, stream)",
    "varlen_fill.launch_zero(mCuSeqlensK, mSeqUsedK, mdK, stream)",
    "varlen_fill.launch_zero(mCuSeqlensK, mSeqUsedK, mdV, stream)",
]
BWD_SPECS = [
    s
    for s in (
        default_spec("sm80", "bwd", "bf16", 128).replace(features=VARLEN),
        default_spec("sm80", "bwd", "fp16", 64, causal=True).replace(features=VARLEN),
        default_spec("sm90", "bwd", "bf16", 128).replace(features=VARLEN),
        default_spec("sm90", "bwd", "bf16", 64, causal=True).replace(
            features=Features(varlen=True, softcap=True)
        ),
    )
    if why_invalid(s) is None
]


@pytest.mark.parametrize("spec", BWD_SPECS, ids=lambda s: s.name)
def test_varlen_backward_modules_zero_the_rows_of_no_sequence_first(spec):
    """dQ with q's lengths, dK and dV with k's, each once, before any kernel of the backward."""
    text = codegen.render_source(spec)
    assert IMPORT in text.splitlines()
    body = _call_body(text)
    for launch in ZERO_LAUNCHES:
        assert body.count(launch) == 1, (spec.name, launch)
        assert body.index(launch) < body.index("self.kernel("), spec.name
    assert text.count("varlen_fill.launch") == 3, spec.name
    dense = spec.replace(features=Features(softcap=spec.features.softcap))
    assert why_invalid(dense) is None and "varlen_fill" not in codegen.render_source(dense)


def test_backward_sample_covers_both_templates():
    assert {codegen.template_name(s) for s in BWD_SPECS} == {"bwd_sm80.py.j2", "bwd_sm90.py.j2"}


class _Props:
    multi_processor_count = 132
    regs_per_multiprocessor = 65536
    shared_memory_per_multiprocessor = 228 * 1024


def _zero_reference(cu, used, grad):
    no_one = torch.ones(grad.shape[0], dtype=torch.bool)
    for b in range(cu.shape[0] - 1):
        no_one[int(cu[b]) : int(cu[b]) + int(used[b])] = False
    grad[no_one] = 0
    return no_one


def test_varlen_backward_writes_no_memset(on_h200, nan_empty, monkeypatch):
    """The backward hands the kernel dq, dk, dv as allocated (NaN here: no zeros, no zero_): the
    module zeroes the rows of no sequence itself; what it writes is what autograd returns."""
    from cutefa.api import backward, dense, feature_bwd

    seen = []

    def fwd(q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, max_q, *rest):
        rows = ~_fill_reference(cu_q, used_q, out, lse)
        out[rows] = 1.0
        lse[:, rows] = 2.0

    def bwd(q, k, v, out, dout, lse, dlse, dq, dk, dv, *rest):
        cu_q, cu_k, used_q, used_k = [
            t for t in rest if isinstance(t, torch.Tensor) and t.dtype == torch.int32
        ][:4]
        seen.append(tuple(bool(g.isnan().all()) for g in (dq, dk, dv)))
        for g, cu, used in ((dq, cu_q, used_q), (dk, cu_k, used_k), (dv, cu_k, used_k)):
            rows = ~_zero_reference(cu, used, g)
            g[rows] = 1.0

    def get_kernel(spec, target):
        return fwd if spec.direction == "fwd" else bwd

    replace_in(monkeypatch, (dense, feature_ops, backward, feature_bwd), "get_kernel", get_kernel)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Props())
    q, k, v = (
        torch.randn(n, h, 64, dtype=torch.bfloat16).requires_grad_() for n, h in ((13, 4), (14, 4), (14, 4))
    )
    out = cutefa.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 6, 5, causal=True, seqused_q=USED_Q)
    out.float().sum().backward()
    assert seen == [(True, True, True)]
    for g in (q.grad, k.grad, v.grad):
        assert not g.isnan().any()
    assert (q.grad[torch.tensor([3, 10, 11, 12])] == 0).all() and (k.grad[12:] == 0).all()
    assert (q.grad[:3] == 1).all() and (k.grad[:12] == 1).all() and (v.grad[:12] == 1).all()


# --- SASS -------------------------------------------------------------------------------------

FILL_KERNEL = "kernel_cutlass_fill_rows_"
COMPILED = {
    "sm_90a": default_spec("sm90", "fwd", "bf16", 128).replace(features=VARLEN),
    "sm_80": default_spec("sm80", "fwd", "fp16", 64, causal=True).replace(features=VARLEN),
}


def _resources(cubin) -> dict[str, tuple[int, int]]:
    """(registers, local bytes) of each kernel of ``cubin`` by its name."""
    text = sass._cuobjdump(cubin, "-res-usage")
    found = re.findall(r"Function (\S+):\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    return {name: (int(reg), int(stack) + int(local)) for name, reg, stack, local in found}


@pytest.mark.compile
@pytest.mark.parametrize("target", list(COMPILED))
def test_fill_kernel_sass(target, tmp_path):
    """The module's cubin holds the fill beside the attention kernel: 16-byte stores of out (one
    STG.E.128 in its loop), one 4-byte store of lse, three length loads and one more, no local
    memory, few registers."""
    spec = COMPILED[target]
    cubin = sass.dump_cubins([spec], target, tmp_path)[spec.name]
    sections = sass.kernel_sections(sass.disassemble(cubin))
    fill = [text for name, text in sections.items() if name.startswith(FILL_KERNEL)]
    assert len(fill) == 1 and len(sections) == 2, list(sections)
    forms = sass.opcode_forms(fill[0])
    memory = {f: n for f, n in forms.items() if f.split(".")[0] in ("LDG", "STG", "LDL", "STL", "LDS", "STS")}
    assert memory == {"STG.E.128": 1, "STG.E": 1, "LDG.E": 4}, memory
    (registers, local) = next(v for name, v in _resources(cubin).items() if name.startswith(FILL_KERNEL))
    assert local == 0 and registers <= 40, (registers, local)
    assert sass.kernel_text(sass.disassemble(cubin), "kernel")  # the attention kernel is still one
