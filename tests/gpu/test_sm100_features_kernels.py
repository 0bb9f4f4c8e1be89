"""The 16-bit sm100 forward's feature kernels (templates/fwd_sm100.py.j2: packed variable-length
batches, the local window, softcap, ALiBi, sinks; each alone and combined; a CTA pair with varlen)
called directly with the calling convention of cutefa/api/features.py, against the float32
reference computed sequence by sequence (tests/gpu/reference.py).

These kernels are compiled and SASS-checked on a CPU only (tests/test_compile_sm100_features.py);
this file is their first run. It skips unless the GPU runs the sm100 family (compute capability
10.x). Outputs are NaN-filled before each call, so an element the kernel does not write fails; in a
packed batch the rows of no sequence (a span's slack past its ``seqused``, the packed tail) must
be 0 with lse -inf: the attention kernel never writes them, the module's fill kernel
(cutefa/kernels/common/varlen_fill.py) does. The kernel does read keys past a sequence's end (its TMA
boxes start at the sequence's first row and run on into the next sequence's rows, or the slack) and
weighs them by exactly 0: the slack rows of q and k hold NaN here (a query row past the end is
never stored, a key past the end is masked to -inf before anything uses it), those of v large
finite values (0 times a non-finite value would be NaN). A row that attends no key (an empty
window, a sequence without keys) must be exactly 0 with lse -inf (the sink with sinks).

Bars: the output within twice the output dtype's epsilon times max |v| (P is rounded to the input
dtype before P V) plus twice the rounding of the reference to that dtype, and with softcap the
error of ``tanh.approx`` (relative 2^-11) times the cap; the lse within 1e-3 (plus that softcap
term).

Run on a B200: ``python -m pytest -q tests/gpu/test_sm100_features_kernels.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import load_sibling

from cutefa.api.features import UNBOUNDED
from cutefa.model.options import Mask
from cutefa.model.spec import Features, VariantSpec

ref = load_sibling("reference")


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    capability = torch.cuda.get_device_capability()
    if capability[0] != 10:
        return f"needs a GPU that runs the sm100 family (compute capability 10.x), this GPU is {capability}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SOFTCAP = 5.0
TANH_APPROX_ERROR = 2.0**-11  # tanh.approx.f32, relative
LSE_TOL = 1e-3
ALL = Features(varlen=True, softcap=True, alibi=True, sinks=True)
NO_FEATURES = Features()
# The default tile of each head dim (docs/design/sm100.md): (tile_m, tile_n, stages, exp_emu)
TILES = {
    64: (256, 128, 3, 25),
    96: (256, 128, 3, 25),
    128: (256, 128, 3, 25),
    192: (256, 64, 3, 0),
    256: (128, 64, 2, 0),
}


def _spec(head_dim=128, dtype="bf16", *, mask=Mask.NONE, features=NO_FEATURES, **options):
    tile_m, tile_n, stages, exp_emu = TILES[head_dim]
    options = {"exp_emu": exp_emu, **options}
    return VariantSpec(
        "sm100", "fwd", dtype, head_dim, tile_m, tile_n, stages, 16, mask=mask, features=features, **options
    )


SPECS = [
    # each feature alone
    _spec(features=Features(varlen=True)),
    _spec(64, "fp16", mask=Mask.CAUSAL, features=Features(varlen=True)),
    _spec(mask=Mask.LOCAL),
    _spec(256, mask=Mask.LOCAL),
    _spec(192, mask=Mask.CAUSAL, features=Features(softcap=True)),
    _spec(96, features=Features(alibi=True)),
    _spec(features=Features(sinks=True)),
    # combinations
    _spec(mask=Mask.LOCAL, features=Features(varlen=True)),
    _spec(mask=Mask.LOCAL, features=ALL),
    _spec(64, "fp16", mask=Mask.LOCAL, features=ALL),
    _spec(256, mask=Mask.CAUSAL, features=ALL),
    _spec(192, mask=Mask.LOCAL, features=ALL),
    _spec(mask=Mask.LOCAL, features=ALL, exp_emu=0),
    _spec(mask=Mask.LOCAL, features=Features(softcap=True, alibi=True, sinks=True)),
    # CTA pairs
    _spec(mask=Mask.CAUSAL, features=Features(varlen=True), cta_pair=True),
    _spec(256, "fp16", features=Features(varlen=True), cta_pair=True),
]

# (seqlen_q, seqlen_k) per sequence of a packed batch: one row, short against long, an empty
# sequence, long against short, several tiles, a sequence with no keys, odd tile counts.
VARLEN_LENGTHS = ((1, 1), (17, 1000), (0, 5), (1000, 17), (4097, 4097), (300, 129), (5, 0), (257, 513))
SLACK = (0, 3, 0, 7, 1, 0, 2, 5)  # rows of each span past its seqused
TAIL = 9  # packed rows after the last span
# (batch, seqlen_q, seqlen_k) of the dense calls
DENSE_SHAPES = ((2, 17, 1000), (1, 1000, 17), (1, 4097, 4097), (3, 129, 300))
# (window_left, window_right); -1 unbounded. With seqlen_q > seqlen_k the leading rows of a narrow
# window see no key; causal + window is right = 0.
WINDOWS = ((100, 50), (0, 0), (300, 0), (-1, 0), (17, -1), (-1, -1), (4096, 4096))
HEADS = ((6, 2), (3, 3))  # (heads_q, heads_kv): grouped and plain


def _kernel(spec):
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel

    target = current_target()
    if not spec.runs_on(target):
        pytest.skip(f"{spec.arch} kernels do not run on {target}")
    return get_kernel(spec, target)


def _bound(side: int) -> int:
    return UNBOUNDED if side < 0 else side


def _window(spec, window):
    """The reference's window_size for a call: the window with the local mask, causal's (-1, 0)."""
    if spec.mask is Mask.LOCAL:
        return window
    return (-1, 0) if spec.mask is Mask.CAUSAL else (-1, -1)


def _trailing(spec, window, slopes, sinks):
    """The kernel arguments after the varlen ones, in the convention's order."""
    args = []
    if spec.mask is Mask.LOCAL:
        args += [_bound(window[0]), _bound(window[1])]
    if spec.features.softcap:
        args.append(SOFTCAP)
    if spec.features.alibi:
        args.append(slopes)
    if spec.features.sinks:
        args.append(sinks)
    return args


def _extras(gen, spec, batch, heads_q, broadcast_slopes):
    slopes = sinks = None
    if spec.features.alibi:
        if broadcast_slopes:  # one slope per head for every sequence: a stride-0 batch mode
            slopes = (torch.rand(heads_q, generator=gen, device="cuda") * 0.2).expand(batch, heads_q)
        else:
            slopes = torch.rand(batch, heads_q, generator=gen, device="cuda") * 0.2
    if spec.features.sinks:
        sinks = torch.randn(heads_q, generator=gen, device="cuda") * 2
    return slopes, sinks


def _check(out, lse, ref_out, ref_lse, no_key, v_absmax, spec, sinks, where):
    """Kernel (out (rows, hq, d), lse (hq, rows)) of one sequence against the reference."""
    if out.numel() == 0:
        return
    dtype = DTYPES[spec.dtype]
    out, lse = out.float(), lse.float()
    assert not out.isnan().any(), f"{where}: NaN in out (an element was not written)"
    assert not lse.isnan().any(), f"{where}: NaN in lse (an element was not written)"
    eps = torch.finfo(dtype).eps
    tol = 2 * eps * v_absmax + 2 * ref.rounding_error(ref_out, dtype)
    lse_tol = LSE_TOL
    if spec.features.softcap:
        tol += SOFTCAP * TANH_APPROX_ERROR * v_absmax
        lse_tol += SOFTCAP * TANH_APPROX_ERROR
    err = ref.max_abs(out, ref_out)
    assert err <= tol, f"{where}: out error {err:.3g} > {tol:.3g}"
    assert (out.permute(1, 0, 2)[no_key] == 0).all(), f"{where}: a row with no key is not 0"
    if sinks is None:
        assert (lse[no_key] == -math.inf).all(), f"{where}: a row with no key has lse != -inf"
    else:
        expected = sinks.float()[:, None].expand_as(no_key)[no_key]
        assert torch.allclose(lse[no_key], expected, atol=1e-5), (
            f"{where}: a row with no key has lse != its sink"
        )
    keyed = ~no_key
    if keyed.any():
        lse_err = ref.max_abs(lse[keyed], ref_lse[keyed])
        assert lse_err <= lse_tol, f"{where}: lse error {lse_err:.3g} > {lse_tol:.3g}"


def _no_key(sq, sk, spec, window, heads_q):
    """(heads_q, sq) True where a query row attends no key."""
    rows = torch.arange(sq, device="cuda")
    none = ~ref.allowed_keys(rows, sq, sk, False, _window(spec, window)).any(dim=-1)
    return none[None, :].expand(heads_q, sq)


def _run_varlen(gen, kernel, spec, window, heads_q, heads_kv, broadcast_slopes):
    """One packed batch through ``kernel``, checked sequence by sequence; returns [(out, lse)]."""
    dtype = DTYPES[spec.dtype]
    d = spec.head_dim
    spans = [(sq + e, sk + e) for (sq, sk), e in zip(VARLEN_LENGTHS, SLACK)]
    cu_q = [0]
    cu_k = [0]
    for sq, sk in spans:
        cu_q.append(cu_q[-1] + sq)
        cu_k.append(cu_k[-1] + sk)
    total_q, total_k = cu_q[-1] + TAIL, cu_k[-1] + TAIL
    q = torch.randn(total_q, heads_q, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(total_k, heads_kv, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(total_k, heads_kv, d, generator=gen, device="cuda").to(dtype)
    int32 = {"device": "cuda", "dtype": torch.int32}
    cu_seqlens_q, cu_seqlens_k = torch.tensor(cu_q, **int32), torch.tensor(cu_k, **int32)
    seqused_q = torch.tensor([sq for sq, _ in VARLEN_LENGTHS], **int32)
    seqused_k = torch.tensor([sk for _, sk in VARLEN_LENGTHS], **int32)
    used_q = ref.used_rows(cu_seqlens_q, seqused_q, total_q)
    used_k = ref.used_rows(cu_seqlens_k, seqused_k, total_k)
    q[~used_q] = math.nan
    k[~used_k] = math.nan
    v[~used_k] = 100 + v[~used_k]
    batch = len(VARLEN_LENGTHS)
    slopes, sinks = _extras(gen, spec, batch, heads_q, broadcast_slopes)
    out = torch.full_like(q, math.nan)
    lse = torch.full((heads_q, total_q), math.nan, device="cuda")
    scale = 1.0 / math.sqrt(d)
    max_seqlen_q = max(sq for sq, _ in VARLEN_LENGTHS)
    varlen = [cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q]
    kernel(q, k, v, out, lse, scale, *varlen, *_trailing(spec, window, slopes, sinks))
    torch.cuda.synchronize()
    assert (out[~used_q] == 0).all() and torch.isneginf(lse[:, ~used_q]).all(), (
        "a row of no sequence: not 0 / -inf"
    )
    ref_out, ref_lse = ref.varlen_ref(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        window_size=_window(spec, window), softcap=SOFTCAP if spec.features.softcap else 0.0,
        alibi_slopes=slopes, sinks=sinks, softmax_scale=scale,
    )  # fmt: skip
    v_absmax = v[used_k].float().abs().max().item() if used_k.any() else 0.0
    for b, (sq, sk) in enumerate(VARLEN_LENGTHS):
        rows = slice(cu_q[b], cu_q[b] + sq)
        where = f"{spec.name} window={window} heads={heads_q}/{heads_kv} sequence {b} ({sq}, {sk})"
        _check(
            out[rows], lse[:, rows], ref_out[rows], ref_lse[:, rows], _no_key(sq, sk, spec, window, heads_q),
            v_absmax, spec, sinks, where,
        )  # fmt: skip
    return [(out, lse)]


def _run_dense(gen, kernel, spec, window, heads_q, heads_kv, broadcast_slopes):
    """The dense shapes through ``kernel``, checked batch by batch; returns [(out, lse)] per shape."""
    results = []
    dtype = DTYPES[spec.dtype]
    d = spec.head_dim
    scale = 1.0 / math.sqrt(d)
    for batch, sq, sk in DENSE_SHAPES:
        q = torch.randn(batch, sq, heads_q, d, generator=gen, device="cuda").to(dtype)
        k = torch.randn(batch, sk, heads_kv, d, generator=gen, device="cuda").to(dtype)
        v = torch.randn(batch, sk, heads_kv, d, generator=gen, device="cuda").to(dtype)
        slopes, sinks = _extras(gen, spec, batch, heads_q, broadcast_slopes)
        out = torch.full_like(q, math.nan)
        lse = torch.full((batch, heads_q, sq), math.nan, device="cuda")
        kernel(q, k, v, out, lse, scale, *_trailing(spec, window, slopes, sinks))
        torch.cuda.synchronize()
        ref_out, ref_lse = ref.attention_ref(
            q, k, v, window_size=_window(spec, window), softcap=SOFTCAP if spec.features.softcap else 0.0,
            alibi_slopes=slopes, sinks=sinks, softmax_scale=scale,
        )  # fmt: skip
        results.append((out, lse))
        v_absmax = v.float().abs().max().item()
        for b in range(batch):
            where = f"{spec.name} window={window} heads={heads_q}/{heads_kv} batch {b} ({sq}, {sk})"
            _check(
                out[b], lse[b], ref_out[b], ref_lse[b], _no_key(sq, sk, spec, window, heads_q), v_absmax, spec,
                sinks, where,
            )  # fmt: skip
    return results


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_feature_kernel(gen, spec):
    kernel = _kernel(spec)
    run = _run_varlen if spec.features.varlen else _run_dense
    windows = WINDOWS if spec.mask is Mask.LOCAL else ((-1, -1),)
    for i, window in enumerate(windows):
        for heads_q, heads_kv in HEADS:
            run(gen, kernel, spec, window, heads_q, heads_kv, broadcast_slopes=i % 2 == 1)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.options.cta_pair], ids=lambda s: s.name)
def test_pair_matches_single_cta(spec):
    """The pair splits keys of K and columns of V between its CTAs, not a reduction: on the same
    inputs its rows are the single-CTA kernel's up to a few output ulps."""
    run = _run_varlen if spec.features.varlen else _run_dense
    results = []
    for kernel in (_kernel(spec), _kernel(spec.replace(cta_pair=False))):
        gen = torch.Generator(device="cuda").manual_seed(1234)  # the same inputs for both
        results.append(run(gen, kernel, spec, (100, 50), 6, 2, broadcast_slopes=False))
    for (out_p, lse_p), (out_s, lse_s) in zip(*results):
        used = ~out_p.isnan()  # every row (those of no sequence 0 / -inf in both: the fill)
        assert torch.equal(used, ~out_s.isnan())
        torch.testing.assert_close(out_p[used].float(), out_s[used].float(), atol=2e-2, rtol=2e-2)
        finite = torch.isfinite(lse_p)
        assert torch.equal(finite, torch.isfinite(lse_s))
        torch.testing.assert_close(lse_p[finite], lse_s[finite], atol=1e-3, rtol=1e-4)
