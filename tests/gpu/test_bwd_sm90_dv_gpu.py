"""The sm90 backward of q/k of head dim 192 against v of 128 (DeepSeek's prefill) on a Hopper GPU:
templates/bwd_sm90_swapkv.py.j2's swapped-dK/dV partition (96 keys per CTA, 48 per consumer) with
its own dQ staging (DqPath.BULK_STAGED), V, dO and dV^T 128 columns wide and two dO stages.

Each committed variant (bf16 and fp16, causal and not) called directly with the calling convention
of cutefa/api/backward.py (tests/gpu/test_bwd_gqa.py's harness: dq, dk, dv and every workspace
NaN-poisoned beforehand, so an element the kernel does not write fails), O and the LSE from the
float32 reference forward, v and dO of 128 columns; gradients judged against float32 autograd of
the exact attention, at most 3x the error of the same attention in the input dtype (+1e-3): lengths
1, 17, 1000, 4097, seqlen_q != seqlen_k both ways, MHA, GQA and MQA (the kernel's fp32 dK/dV
workspace, dV's chunk after dK's), the partition's edges (a key past consumer 0's 48, one short of
and one past a 96-key block, a query past a 64-row block), long query loops over few key blocks
(the two dO stages refilled every block); deterministic=1 bitwise repeatable, also with each CTA
walking several key blocks; the same gradients (close) as head dim 192's kernel on v and dO padded
with zero columns. Through the public API: flash_attn_func with v of 128 and .backward() runs this
backward (dispatch logged), NaN-poisoned views as inputs and NaN-filled allocations, the dLSE term,
deterministic mode; a packed batch runs the sm80 backward (the swapped template takes none).

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_bwd_sm90_dv_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import hopper_skip_reason
from gpu_support import load_sibling as _load

from cutefa.model.defaults import default_spec

bwd80 = _load("test_bwd_sm80")
bwd90 = _load("test_bwd_sm90")
dv_api = _load("test_head_dim_v_gpu")
vl = _load("test_varlen")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(hopper_skip_reason() is not None, reason=str(hopper_skip_reason())),
]

D, DV = 192, 128
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SPECS = [
    default_spec("sm90", "bwd", dt, D, causal=c, head_dim_v=DV)
    for dt in ("bf16", "fp16")
    for c in (False, True)
]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): hd192's on this partition (ragged lengths, its
# edges, long query loops that refill both dO stages many times, the causal launch order's chunks)
SHAPES = _load("test_bwd_sm90_swapkv").SHAPES


@pytest.fixture(scope="module")
def target():
    from cutefa.dispatch import current_target

    return current_target()


def test_the_variants_are_the_dispatched_defaults(target):
    from cutefa.api import backward

    for spec in SPECS:
        assert spec.name.startswith(f"cutefa_sm90_bwd_{spec.dtype}_hd192v128_64x96_s2_w12"), spec.name
        for seqlen_k in (None, 8192):
            chosen = backward.choose_bwd(
                target, TORCH_DTYPES[spec.dtype], D, spec.causal, seqlen_k=seqlen_k, head_dim_v=DV
            )  # fmt: skip
            assert chosen == spec, chosen.name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_grads_against_float32(gen, target, spec):
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, target)
    for batch, sq, sk, hq, hkv in SHAPES:
        for deterministic in (False, True):
            q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, batch, sq, sk, hq, hkv)
            assert v.shape[-1] == dout.shape[-1] == out.shape[-1] == DV and q.shape[-1] == D
            got = bwd90.run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=deterministic)
            assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
            where = f"{spec.name} b{batch} sq{sq} sk{sk} hq{hq} hkv{hkv} det{int(deterministic)}"
            bwd90.judge_grads(spec, where, got, q, k, v, dout)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_deterministic_is_bitwise_repeatable(gen, target, spec):
    """deterministic=1: two runs bitwise equal and close to the atomic mode (GQA 4/2 over 2000 keys),
    and with fewer dQ splits than key blocks (32 (batch, head) pairs over 1000 keys)."""
    bwd90.check_deterministic_split(spec, target, gen)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_matches_head_dim_192_on_zero_padded_v(gen, target, spec):
    """v and dO padded with 64 zero columns through hd192's own default (the same partition and tile,
    one dO stage): a zero column adds nothing to dP = dO V^T or to D = rowsum(dO * O), so dq, dk and
    dV's first 128 columns must be close (their sums run in other orders: D's over other lanes) and
    the padded kernel's last 64 columns of dV zero."""
    from cutefa.loader import get_kernel

    twin = default_spec("sm90", "bwd", spec.dtype, D, causal=spec.causal)
    kernel, twin_kernel = get_kernel(spec, target), get_kernel(twin, target)
    for batch, sq, sk, hq, hkv in ((2, 1000, 777, 4, 2), (1, 65, 49, 2, 2), (1, 4097, 200, 4, 2)):
        q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, batch, sq, sk, hq, hkv)
        pad = lambda t: torch.nn.functional.pad(t, (0, D - DV))
        mine = bwd90.run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=True)
        ref = bwd90.run_kernel(twin_kernel, twin, q, k, pad(v), pad(out), lse, pad(dout), deterministic=True)
        where = f"{spec.name} b{batch} sq{sq} sk{sk} hq{hq} hkv{hkv}"
        assert (ref[2][..., DV:] == 0).all(), f"{where}: the padded kernel's dV pad columns"
        for name, a, b in zip(("dq", "dk", "dv"), mine, (ref[0], ref[1], ref[2][..., :DV])):
            assert torch.isfinite(a).all(), f"{where} {name}"
            assert bwd80.rel(a, b) < 1e-2, f"{where} {name} vs {twin.name}"


def _ran_backwards(monkeypatch) -> list:
    """The choices dispatch logs from here on (runs are reported only while logging is on)."""
    from cutefa import dispatch

    ran = []
    log_run = dispatch.log_run

    def logged(choice, *args):
        ran.append(choice)
        log_run(choice, *args)

    monkeypatch.setattr(dispatch, "log_run", logged)
    monkeypatch.setattr(dispatch, "_LOG_RUNS", True)
    return ran


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", dv_api.BWD_SHAPES, ids=lambda s: "b{}_sq{}_sk{}_hq{}_hkv{}".format(*s))
def test_through_the_api(gen, monkeypatch, shape, causal, deterministic):
    """flash_attn_func(q, k, v of 128, return_lse=True) and autograd on a loss of out and lse: the
    sm90 backward ran; NaN-poisoned input views, NaN-filled allocations; lengths 1, 17, 1000, MHA and
    GQA 8/2; gradients within 3x the bf16 reference's error of float32's."""
    dtype = torch.bfloat16
    ran = _ran_backwards(monkeypatch)
    q, k, v = dv_api.dense_inputs(gen, shape, dtype)
    batch, sq, sk, hq, _ = shape
    dout = dv_api.poisoned(torch.randn(batch, sq, hq, DV, generator=gen, device="cuda").to(dtype))
    rows = torch.arange(sq, device="cuda")
    has_key = rows + sk - sq >= 0 if causal else rows >= 0  # (a row of no key has lse -inf, no slope)
    dlse = torch.randn(batch, hq, sq, generator=gen, device="cuda") * has_key
    got = dv_api._dense_grads(q, k, v, dout, dlse, causal, deterministic=deterministic)
    (spec,) = [c.spec for c in ran if c.spec.direction == "bwd"]
    assert spec == default_spec("sm90", "bwd", "bf16", D, causal=causal, head_dim_v=DV), spec.name
    exact = dv_api._reference_grads(q, k, v, dout, dlse, causal, torch.float32)
    base = dv_api._reference_grads(q, k, v, dout, dlse, causal, dtype)
    vl.judge_grads(f"{spec.name} {shape} det{int(deterministic)}", got, exact, base)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_packed_batch_runs_the_sm80_backward(gen, monkeypatch, causal):
    """flash_attn_varlen_func with v of 128 on Hopper: the swapped sm90 template takes no packed
    batch, so the sm80 backward runs (rows of no sequence get zero gradients)."""
    ran = _ran_backwards(monkeypatch)
    p = dv_api.packed_inputs(gen, torch.bfloat16, 4, 2)
    vl.check_varlen_grads(f"varlen causal={causal}", p, gen, causal=causal)
    backwards = [c.spec for c in ran if c.spec.direction == "bwd"]
    assert backwards and all(s.arch == "sm80" and s.features.varlen and s.head_dim_v == DV for s in backwards)
