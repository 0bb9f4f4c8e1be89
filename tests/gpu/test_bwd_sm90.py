"""The sm90-family (FlashAttention-3 design) backward on a Hopper GPU, variant by variant.

Each sm90 backward variant (the committed defaults and the measured alternatives of
tools/alternatives.py) is called directly (not through dispatch) with the calling
convention of cutefa/backward.py: O and the LSE come from the float32 reference forward, dq, dk and
dv are poisoned with NaN beforehand (an element the kernel does not write fails), and the grouped
heads of dk/dv are summed as backward.py does. Gradients are judged against float32 autograd of
the exact attention, with the tolerance of tests/gpu/test_bwd_sm80.py (at most 3x the error of
PyTorch's own attention on the same low-precision inputs). Shapes: ragged lengths (1, 17, 1000,
4097), seqlen_q != seqlen_k both ways, GQA and MQA; deterministic=1 must be bitwise reproducible.
An alternative (another Q/dO ring depth, the overlap schedule, the bulk dQ path, the dQ-writer
warp) does the same arithmetic in the same order as its default twin, so with deterministic=1
their gradients must be bitwise equal. (One
exception: the head-dim split's overlap (head dims 192/256; hd256's default has it) adds consumer
1's dK/dV columns over the two query halves in the other order, so where one of the pair has it and
the other not those columns must be close, the rest bitwise equal. And
at head dim 192 the default is the partition with dK/dV swapped onto WGMMA's M axis, 96 keys per
CTA, whose sums run in other orders than the head-dim split's (64 keys per CTA): across the two
partitions the gradients must be close; the swapped variants' own bitwise twin test is in
tests/gpu/test_bwd_sm90_swapkv.py.)

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_bwd_sm90.py``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from gpu_support import all_variants, alternatives
from gpu_support import hopper_skip_reason as _skip_reason
from gpu_support import load_sibling as _load

from cutefa.model.budgets_sm90 import sm90_bwd_dq_swapped, sm90_bwd_head_split, sm90_bwd_swapped
from cutefa.model.defaults import DEFAULT_BWD_TILES

bwd80 = _load("test_bwd_sm80")
reference = _load("reference")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

BACKWARDS = all_variants("sm90", "bwd")


def _default_twin(spec):
    """The default variant of spec's dtype, head dims and mask (its tile and default options): the
    one dispatch picks on sm_90a without a tuned table."""
    from cutefa.api import backward

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    return backward.choose_bwd("sm_90a", dtype, spec.head_dim, spec.causal, head_dim_v=spec.head_dim_v)


ALTERNATIVES = [s for s in BACKWARDS if _default_twin(s) != s]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): ragged lengths (1, 17, 1000, 4097), seqlen_q !=
# seqlen_k both ways, GQA and MQA; the first shapes of every sm90 backward test's list
COMMON_SHAPES = (
    (1, 1, 1, 2, 2),
    (2, 17, 17, 2, 2),
    (1, 1000, 1000, 2, 1),
    (1, 4097, 4097, 1, 1),
    (1, 17, 1000, 4, 2),
    (1, 1000, 17, 3, 3),
)
SHAPES = COMMON_SHAPES + ((2, 333, 257, 6, 2), (1, 128, 4097, 8, 1))


def run_kernel(kernel, spec, q, k, v, out, lse, dout, *, deterministic=False):
    """dq, dk, dv from one variant, allocated like cutefa/api/backward.py does (test_bwd_gqa's
    harness: NaN-poisoned outputs and workspaces)."""
    return _load("test_bwd_gqa").run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=deterministic)


def forward_ref(q, k, v, causal):
    out, lse = reference.attention_ref(q, k, v, causal=causal)
    return out.to(q.dtype), lse


def random_inputs(gen, spec, batch, seqlen_q, seqlen_k, heads_q, heads_kv):
    """q, k, v, dout (test_bwd_sm80.py's ``random_inputs`` in the variant's dtype and head dims: v
    and dout of its V head dim) and out, lse of the float32 reference forward (:func:`forward_ref`)."""
    dtype = bwd80.DTYPES[spec.dtype]
    q, k, v, dout = bwd80.random_inputs(
        gen, dtype, spec.head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim_v=spec.head_dim_v
    )
    out, lse = forward_ref(q, k, v, spec.causal)
    return q, k, v, dout, out, lse


def reference_grads(spec, q, k, v, dout):
    """(exact, base): the gradients of float32 autograd of the exact attention, and those of
    PyTorch's own attention on the same low-precision inputs."""
    scale = 1.0 / math.sqrt(spec.head_dim)
    fn = functools.partial(bwd80.attention, causal=spec.causal, scale=scale)
    exact = bwd80.grads(fn, q.float(), k.float(), v.float(), dout.float())
    base = bwd80.grads(fn, q, k, v, dout)
    return exact, base


def assert_grads_close(where, got, exact, base):
    """``got`` (dq, dk, dv): the shapes of ``exact``, finite, and relative errors at most 3x those of
    ``base`` (plus 1e-3); failures name ``where``."""
    for name, g, e, b in zip(("dq", "dk", "dv"), got, exact, base):
        assert g.shape == e.shape, f"{where} {name}"
        assert torch.isfinite(g).all(), f"{where} {name}: non-finite values (unwritten or NaN)"
        err, err_base = bwd80.rel(g, e), bwd80.rel(b, e)
        assert err <= 3 * err_base + 1e-3, f"{where} {name}: rel err {err:.3g} vs SDPA {err_base:.3g}"


def judge_grads(spec, where, got, q, k, v, dout):
    """:func:`assert_grads_close` against :func:`reference_grads` of these inputs."""
    assert_grads_close(where, got, *reference_grads(spec, q, k, v, dout))


def check_variant(spec, kernel, batch, sq, sk, hq, hkv, gen, *, deterministic=False):
    """One shape through :func:`run_kernel`, judged by :func:`judge_grads`."""
    q, k, v, dout, out, lse = random_inputs(gen, spec, batch, sq, sk, hq, hkv)
    got = run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=deterministic)
    where = f"{spec.name} b{batch} sq{sq} sk{sk} hq{hq} hkv{hkv} det{int(deterministic)}"
    judge_grads(spec, where, got, q, k, v, dout)


def check_shapes(spec, target, shapes, gen):
    """The variant's kernel for ``target`` through :func:`check_variant` at each of ``shapes``."""
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, target)
    for shape in shapes:
        check_variant(spec, kernel, *shape, gen)


def check_deterministic_split(spec, target, gen):
    """deterministic=1 with 32 (batch, head) pairs over 1000 keys, fewer dq_accum splits than key
    blocks (each CTA walks several key blocks into one split): judged by :func:`check_variant`; then
    :func:`check_deterministic`."""
    from cutefa.api.backward import dq_splits
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, target)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    assert dq_splits(True, 2, 16, 1000, spec.tile_n, sm_count) < math.ceil(1000 / spec.tile_n)
    check_variant(spec, kernel, 2, 1000, 1000, 16, 4, gen, deterministic=True)
    check_deterministic(spec, kernel, gen)


def check_deterministic(spec, kernel, gen):
    """deterministic=1 on 2048 queries (4 heads) over 2000 keys (2 heads): two runs bitwise equal,
    and within 1e-2 of the atomic mode."""
    q, k, v, dout, out, lse = random_inputs(gen, spec, 1, 2048, 2000, 4, 2)
    first = run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=True)
    second = run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=True)
    plain = run_kernel(kernel, spec, q, k, v, out, lse, dout)
    for name, a, b, c in zip(("dq", "dk", "dv"), first, second, plain):
        assert torch.isfinite(a).all(), f"{spec.name} {name}"
        assert torch.equal(a, b), f"{spec.name} {name} differs between two deterministic runs"
        assert bwd80.rel(a, c) < 1e-2, f"{spec.name} {name}"


@pytest.fixture(scope="module")
def target():
    from cutefa.dispatch import current_target

    return current_target()


@pytest.mark.parametrize("spec", BACKWARDS, ids=lambda s: s.name)
def test_variant_grads(gen, target, spec):
    check_shapes(spec, target, SHAPES, gen)


@pytest.mark.parametrize("spec", [s for s in BACKWARDS if s.causal], ids=lambda s: s.name)
def test_variant_deterministic(gen, target, spec):
    from cutefa.loader import get_kernel

    check_deterministic(spec, get_kernel(spec, target), gen)


def test_dispatch_picks_sm90_backward(gen, target, monkeypatch):
    """On a Hopper GPU the API's backward runs the sm90 family for the head dims it has tiles for,
    and where the tuned backward table has an entry for the problem, that entry (else the default).
    Checked on the production path: a backward through cutefa.flash_attn_func, whose variant choice
    passes seqlen_k and the GPU's name so that the table is consulted; the variant that ran is taken
    from its run log."""
    import cutefa
    from cutefa import dispatch

    ran = []
    log_run = dispatch.log_run

    def logged(choice, *args):
        ran.append(choice)
        log_run(choice, *args)

    monkeypatch.setattr(dispatch, "log_run", logged)
    monkeypatch.setattr(dispatch, "_LOG_RUNS", True)  # runs are reported only while logging is on
    gpu_name = dispatch.device_target(torch.device("cuda"))[1]
    seqlen, tuned_picks = 1000, 0
    for head_dim in (64, 96, 128, 192, 256):
        shape = (1, seqlen, 2, head_dim)
        q, k, v = (
            torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)
        )
        ran.clear()
        cutefa.flash_attn_func(q, k, v, causal=True).backward(torch.ones_like(q))
        (spec,) = [c.spec for c in ran if c.spec.direction == "bwd"]
        assert spec.arch == ("sm90" if head_dim in DEFAULT_BWD_TILES["sm90"] else "sm80"), spec.name
        tuned = dispatch.tuned_backward(
            "sm90", target=target, dtype=torch.bfloat16, head_dim=head_dim, causal=True, seqlen_k=seqlen,
            gpu_name=gpu_name,
        )  # fmt: skip
        if tuned is not None and tuned[0] is not None:
            assert spec == tuned[0], f"hd{head_dim}: ran {spec.name}, the tuned table names {tuned[0].name}"
            tuned_picks += spec != _default_twin(spec)
        else:  # no entry (or an unusable one): the default
            assert spec == _default_twin(spec), spec.name
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), spec.name
    # The committed H200 table (used on every sm_90a GPU) picks an alternative for at least one of
    # these problems (hd128): the table was consulted, not only the defaults.
    assert tuned_picks > 0, "no problem here ran a tuned pick other than its default"


def test_every_alternative_is_exercised():
    """The alternatives are part of BACKWARDS (so test_variant_grads runs each of them)."""
    assert ALTERNATIVES and all(_default_twin(s) in BACKWARDS for s in ALTERNATIVES)
    alts = alternatives()
    tables = (alts.SM90_BWD_ALTERNATIVES, alts.SM90_FP16_BWD_ALTERNATIVES)  # each entry: causal and not
    assert len(ALTERNATIVES) == sum(2 * len(entries) for table in tables for entries in table.values())


@pytest.mark.parametrize("spec", ALTERNATIVES, ids=lambda s: s.name)
def test_alternative_matches_default_bitwise(gen, target, spec):
    from cutefa.loader import get_kernel

    twin = _default_twin(spec)
    q, k, v, dout, out, lse = random_inputs(gen, spec, 2, 1000, 777, 4, 2)
    mine = run_kernel(get_kernel(spec, target), spec, q, k, v, out, lse, dout, deterministic=True)
    ref = run_kernel(get_kernel(twin, target), twin, q, k, v, out, lse, dout, deterministic=True)
    reordered = sm90_bwd_head_split(spec) and spec.options.overlap != twin.options.overlap
    half = spec.head_dim // 2
    for name, a, b in zip(("dq", "dk", "dv"), mine, ref):
        assert torch.isfinite(a).all(), f"{spec.name} {name}"
        # Other sums, so close rather than bitwise: the hd192 partitions against each other (64 or 96
        # keys per CTA) and the swapped one's other dQ paths (BULK_STAGED's bitwise twin test is in
        # test_bwd_sm90_swapkv.py); 80 query rows per step with dQ transposed.
        if sm90_bwd_swapped(spec) or sm90_bwd_swapped(twin) or sm90_bwd_dq_swapped(spec):
            assert bwd80.rel(a, b) < 1e-2, f"{spec.name} {name} vs {twin.name}"
        elif reordered and name != "dq":  # consumer 1's columns: its own queries first, then consumer 0's
            assert torch.equal(a[..., :half], b[..., :half]), f"{spec.name} {name} differs from {twin.name}"
            assert bwd80.rel(a[..., half:], b[..., half:]) < 1e-2, f"{spec.name} {name} vs {twin.name}"
        else:
            assert torch.equal(a, b), f"{spec.name} {name} differs from {twin.name}"
