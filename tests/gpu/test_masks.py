"""Windows, softcap, ALiBi and sinks through the public API on a CUDA GPU.

``cutefa.flash_attn_func(..., window_size=, softcap=, alibi_slopes=, sinks=)`` (and the same options
of ``flash_attn_varlen_func``) against the float32 reference (tests/gpu/reference.py), forward and
backward, judged with tests/gpu/test_varlen.py's bars (see its docstring): outputs into NaN-filled
allocations, rows that attend no key exactly 0 with lse -inf (with sinks: the sink), gradients
through a loss on out and lse, dsinks included. Windows (left, right) with and without causal,
empty for some rows (seqlen_q > seqlen_k) and larger than the sequence; settings that change
nothing give bitwise the plain call; deterministic mode bitwise repeatable; errors that name the
argument.

The default set is small (seconds per case); ``CUTEFA_FULL_GPU_TESTS=1`` runs the larger sweep.
Run on an H100/H200: ``python -m pytest -q tests/gpu/test_masks.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa

ref = _load("reference")
vl = _load("test_varlen")
fwd80 = _load("test_fwd_sm80")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

DEVICE = "cuda"
FULL = vl.FULL
DTYPES = vl.DTYPES
HEADS = (4, 2)  # heads_q, heads_kv
# (batch, seqlen_q, seqlen_k): square, sq > sk (leading rows outside right-bounded windows),
# sq < sk (the band starts late), a long key side
SHAPES = ((2, 1000, 1000), (1, 1000, 17), (1, 17, 1000), (1, 333, 4097))
GRAD_SHAPES = ((2, 600, 600), (1, 700, 333), (1, 333, 700))
# (left, right): one key, a sliding window, a symmetric band, left only, right only, wider than
# every sequence, and flash-attn's spelling of causal
WINDOWS = ((0, 0), (16, 0), (64, 64), (256, -1), (-1, 8), (5000, 5000), (-1, 0))


def inputs(gen, batch, sq, sk, dtype=torch.bfloat16, head_dim=128, heads=HEADS, q_scale=1.0):
    hq, hkv = heads
    cuda = {"device": DEVICE, "dtype": dtype}
    q = torch.randn(batch, sq, hq, head_dim, generator=gen, **cuda)
    if q_scale != 1.0:
        q = (q.float() * q_scale).to(dtype)
    k = torch.randn(batch, sk, hkv, head_dim, generator=gen, **cuda)
    v = torch.randn(batch, sk, hkv, head_dim, generator=gen, **cuda)
    return q, k, v


def to_rows(out, lse):
    """Dense (batch, sq, heads, d) and (batch, heads, sq) as rows: (batch * sq, heads, d), (heads, batch * sq)."""
    return out.flatten(0, 1), lse.permute(1, 0, 2).flatten(1)


def has_keys(batch, sq, sk, causal, window_size):
    """(batch * sq,) bool: rows that attend a key (the leading ref.empty_rows rows do not)."""
    rows = torch.arange(sq, device=DEVICE) >= ref.empty_rows(sq, sk, causal, window_size)
    return rows.repeat(batch)


def alibi(kind, batch, heads_q):
    """ALiBi slopes: "h" the usual geometric (heads_q,) sequence, "bh" random (batch, heads_q)."""
    if kind == "h":
        return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads_q) for h in range(heads_q)], device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(batch * 100 + heads_q)
    return torch.rand(batch, heads_q, generator=g, device=DEVICE) * 0.5


def sinks_for(heads_q):
    """Sinks around the rows' lse (a few units), so that they move the output visibly."""
    return torch.linspace(-1.0, 4.0, heads_q, device=DEVICE)


def check_forward(tag, q, k, v, *, causal, **features):
    """One flash_attn_func call into NaN-filled outputs, judged by test_varlen's judge_forward.
    Returns (out, lse)."""
    with fwd80.nan_filled_allocations():
        out, lse = cutefa.flash_attn_func(q, k, v, causal=causal, return_lse=True, **features)
    torch.cuda.synchronize()
    batch, sq, hq, _ = q.shape
    sk = k.shape[1]
    assert out.shape == q.shape and out.dtype == q.dtype, f"{tag}: out {tuple(out.shape)} {out.dtype}"
    assert lse.shape == (batch, hq, sq) and lse.dtype == torch.float32, f"{tag}: lse {tuple(lse.shape)}"
    with torch.no_grad():
        exact, exact_lse = ref.attention_ref(q, k, v, causal=causal, **features)
    window = features.get("window_size", ref.NO_WINDOW)
    vl.judge_forward(
        tag, *to_rows(out, lse), *to_rows(exact, exact_lse), has_keys(batch, sq, sk, causal, window),
        sinks=features.get("sinks"), softcap=features.get("softcap", 0.0), v_absmax=vl.absmax(v),
    )  # fmt: skip
    return out, lse


def check_grads(tag, q, k, v, gen, *, causal, deterministic=False, **features):
    """test_varlen's compare_grads for a flash_attn_func call: a loss on out and the finite lse."""
    sinks = features.pop("sinks", None)
    dout = torch.randn(q.shape, generator=gen, device=DEVICE)
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=gen, device=DEVICE)
    everything = torch.ones((), dtype=torch.bool, device=DEVICE)
    loss = vl.loss_fn(dout, dlse, everything, everything)

    def call(a, b, c, s):
        return cutefa.flash_attn_func(
            a, b, c, causal=causal, sinks=s, deterministic=deterministic, return_lse=True, **features
        )

    def reference(a, b, c, s):
        return ref.attention_ref(a, b, c, causal=causal, sinks=s, **features)

    return vl.compare_grads(tag, call, reference, (q, k, v, sinks), loss, to_rows, dout, dlse)


def _ids(value):
    if isinstance(value, bool):
        return "causal" if value else "full"
    if isinstance(value, tuple) and len(value) == 2:
        return f"w{value[0]}_{value[1]}"
    return None


# --- sliding windows --------------------------------------------------------------------------


def _window_variants():
    """(dtype, head_dim) the window tests run over: bf16 hd128, or every one in the sweep."""
    if FULL:
        return [(dt, d) for dt in DTYPES for d in (64, 96, 128, 192, 256)]
    return [("bf16", 128)]


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("window", WINDOWS, ids=_ids)
@pytest.mark.parametrize("dtype,head_dim", _window_variants())
def test_window_forward(gen, dtype, head_dim, window, causal):
    for batch, sq, sk in SHAPES:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim)
        tag = f"{dtype} hd{head_dim} window={window} causal={causal} b{batch} sq{sq} sk{sk}"
        check_forward(tag, q, k, v, causal=causal, window_size=window)


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("dtype,head_dim", [("fp16", 64), ("bf16", 256)] + ([("fp16", 192)] if FULL else []))
def test_window_forward_other_head_dims(gen, dtype, head_dim, causal):
    for batch, sq, sk in SHAPES[:3]:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim)
        tag = f"{dtype} hd{head_dim} causal={causal} b{batch} sq{sq} sk{sk}"
        check_forward(tag, q, k, v, causal=causal, window_size=(37, 5))


GRAD_WINDOWS = ((16, 0), (64, 64), (5000, 5000)) + (((0, 0), (256, -1), (-1, 8)) if FULL else ())


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("window", GRAD_WINDOWS, ids=_ids)
@pytest.mark.parametrize("dtype,head_dim", _window_variants())
def test_window_grads(gen, dtype, head_dim, window, causal):
    for batch, sq, sk in GRAD_SHAPES:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim)
        tag = f"{dtype} hd{head_dim} window={window} causal={causal} b{batch} sq{sq} sk{sk}"
        check_grads(tag, q, k, v, gen, causal=causal, window_size=window)


def test_settings_that_change_nothing_give_the_plain_call(gen):
    """window (-1, -1) / (None, None) is no window and (-1, 0) is causal: bitwise the plain call
    (softcap 0 likewise). Causal with a right side caps it at 0, and a window wider than the
    sequences is none: both held to the reference and close to the plain call (they may run
    another kernel of the same arithmetic)."""
    q, k, v = inputs(gen, 2, 700, 900)
    for causal in (False, True):
        plain = cutefa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        for window in ((-1, -1), (None, None)):
            same = cutefa.flash_attn_func(
                q, k, v, causal=causal, window_size=window, softcap=0.0, return_lse=True
            )
            assert torch.equal(same[0], plain[0]) and torch.equal(same[1], plain[1]), (
                f"{window} causal={causal}"
            )
        wide, _ = check_forward(
            f"window (5000, 5000) causal={causal}", q, k, v, causal=causal, window_size=(5000, 5000)
        )
        assert ref.rel_l2(wide, plain[0].float()) <= 1e-2, f"window (5000, 5000) causal={causal}"
    causal = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    same = cutefa.flash_attn_func(q, k, v, window_size=(-1, 0), return_lse=True)
    assert torch.equal(same[0], causal[0]) and torch.equal(same[1], causal[1]), "window (-1, 0) is not causal"
    capped, _ = check_forward("causal window (-1, 7)", q, k, v, causal=True, window_size=(-1, 7))
    assert ref.rel_l2(capped, causal[0].float()) <= 1e-2, "causal does not cap the window's right side at 0"


# --- softcap, ALiBi, sinks --------------------------------------------------------------------

# (softcap, q scale): a cap that bends most scores (scores of ~4 sigma against a cap of 4), and a
# loose one (unit scores against 30)
SOFTCAPS = ((4.0, 4.0), (30.0, 1.0))


def _modifier_variants():
    if FULL:
        return [(dt, d) for dt in DTYPES for d in (64, 96, 128, 192, 256)]
    return [("bf16", 128)]


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("softcap,q_scale", SOFTCAPS, ids=lambda x: None)
@pytest.mark.parametrize("dtype,head_dim", _modifier_variants())
def test_softcap_forward(gen, dtype, head_dim, softcap, q_scale, causal):
    for batch, sq, sk in SHAPES[:2]:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim, q_scale=q_scale)
        check_forward(
            f"softcap={softcap} causal={causal} sq{sq} sk{sk}", q, k, v, causal=causal, softcap=softcap
        )


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("dtype,head_dim", _modifier_variants())
def test_softcap_grads(gen, dtype, head_dim, causal):
    for batch, sq, sk in GRAD_SHAPES[:2]:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim, q_scale=4.0)
        check_grads(f"softcap=4 causal={causal} sq{sq} sk{sk}", q, k, v, gen, causal=causal, softcap=4.0)


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("slopes", ["h", "bh"])
@pytest.mark.parametrize("dtype,head_dim", _modifier_variants())
def test_alibi_forward(gen, dtype, head_dim, slopes, causal):
    for batch, sq, sk in SHAPES[:3]:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim)
        kwargs = {"alibi_slopes": alibi(slopes, batch, HEADS[0])}
        check_forward(f"alibi {slopes} causal={causal} sq{sq} sk{sk}", q, k, v, causal=causal, **kwargs)


@pytest.mark.parametrize("slopes,causal", [("h", True), ("bh", False)])
@pytest.mark.parametrize("dtype,head_dim", _modifier_variants())
def test_alibi_grads(gen, dtype, head_dim, slopes, causal):
    for batch, sq, sk in GRAD_SHAPES:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim)
        kwargs = {"alibi_slopes": alibi(slopes, batch, HEADS[0])}
        check_grads(f"alibi {slopes} causal={causal} sq{sq} sk{sk}", q, k, v, gen, causal=causal, **kwargs)


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("dtype,head_dim", _modifier_variants())
def test_sinks_forward(gen, dtype, head_dim, causal):
    """With causal, (1, 1000, 17) has 983 rows without a key: their lse must be the sink."""
    for batch, sq, sk in SHAPES:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim)
        check_forward(
            f"sinks causal={causal} sq{sq} sk{sk}", q, k, v, causal=causal, sinks=sinks_for(HEADS[0])
        )


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("dtype,head_dim", _modifier_variants())
def test_sinks_grads(gen, dtype, head_dim, causal):
    """dq, dk, dv and dsinks (sinks.requires_grad): rows without a key included (causal sq > sk)."""
    for batch, sq, sk in GRAD_SHAPES:
        q, k, v = inputs(gen, batch, sq, sk, DTYPES[dtype], head_dim)
        got = check_grads(
            f"sinks causal={causal} sq{sq} sk{sk}", q, k, v, gen, causal=causal, sinks=sinks_for(HEADS[0])
        )
        assert got[3] is not None and got[3].dtype == torch.float32 and got[3].shape == (HEADS[0],)


def test_sinks_gradient_reaches_the_leaf(gen):
    """sinks.requires_grad: backward writes sinks.grad (float32 (heads_q,)), no other leaf needed."""
    q, k, v = inputs(gen, 1, 300, 300)
    sinks = sinks_for(HEADS[0]).requires_grad_()
    out, lse = cutefa.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    assert sinks.grad is not None and sinks.grad.shape == sinks.shape and torch.isfinite(sinks.grad).all()


ALL_TOGETHER = {"window_size": (48, 16), "softcap": 4.0, "slopes": "bh"}


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
def test_everything_together(gen, causal):
    """Window, softcap, ALiBi and sinks in one call: forward on every shape, then gradients."""
    for batch, sq, sk in SHAPES:
        q, k, v = inputs(gen, batch, sq, sk, q_scale=4.0)
        kwargs = {
            "window_size": ALL_TOGETHER["window_size"], "softcap": ALL_TOGETHER["softcap"],
            "alibi_slopes": alibi(ALL_TOGETHER["slopes"], batch, HEADS[0]), "sinks": sinks_for(HEADS[0]),
        }  # fmt: skip
        check_forward(f"all causal={causal} sq{sq} sk{sk}", q, k, v, causal=causal, **kwargs)
    for batch, sq, sk in GRAD_SHAPES[1:]:
        q, k, v = inputs(gen, batch, sq, sk, q_scale=4.0)
        kwargs = {
            "window_size": ALL_TOGETHER["window_size"], "softcap": ALL_TOGETHER["softcap"],
            "alibi_slopes": alibi(ALL_TOGETHER["slopes"], batch, HEADS[0]), "sinks": sinks_for(HEADS[0]),
        }  # fmt: skip
        check_grads(f"all causal={causal} sq{sq} sk{sk}", q, k, v, gen, causal=causal, **kwargs)


def test_deterministic_with_features_is_bitwise_repeatable(gen):
    q, k, v = inputs(gen, 2, 1000, 1000)
    sinks = sinks_for(HEADS[0])
    dout = torch.randn(q.shape, generator=gen, device=DEVICE)
    everything = torch.ones((), dtype=torch.bool, device=DEVICE)
    loss = vl.loss_fn(dout, torch.ones(2, HEADS[0], 1000, device=DEVICE), everything, everything)

    def call(a, b, c, s):
        return cutefa.flash_attn_func(
            a,
            b,
            c,
            causal=True,
            window_size=(100, 0),
            softcap=30.0,
            sinks=s,
            deterministic=True,
            return_lse=True,
        )

    runs = [vl.grads_of(call, (q, k, v, sinks), loss) for _ in range(2)]
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), *runs):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


# --- on packed sequences ----------------------------------------------------------------------

VARLEN_LENGTHS = [(300, 300), (0, 0), (1000, 17), (17, 1000), (5, 0), (777, 800)]
VARLEN_FEATURES = {
    "window": (True, {"window_size": (32, 8)}),
    "softcap": (False, {"softcap": 30.0}),
    "alibi": (True, {"slopes": "bh"}),
    "sinks": (False, {"sinks": True}),
}


def _varlen_features(kind, batch):
    causal, spec = VARLEN_FEATURES[kind]
    features = {k: v for k, v in spec.items() if k not in ("slopes", "sinks")}
    if "slopes" in spec:
        features["alibi_slopes"] = alibi(spec["slopes"], batch, HEADS[0])
    if spec.get("sinks"):
        features["sinks"] = sinks_for(HEADS[0])
    return causal, features


@pytest.mark.parametrize("kind", VARLEN_FEATURES)
def test_packed_sequences_forward(gen, kind):
    """Each option on a packed batch: windows and ALiBi aligned bottom-right per sequence, (batch,
    heads) slopes per sequence, sinks on rows without keys."""
    p = vl.make_packed(gen, VARLEN_LENGTHS, *HEADS, 128, torch.bfloat16)
    causal, features = _varlen_features(kind, p.batch)
    vl.check_varlen_forward(f"varlen {kind} causal={causal}", p, causal=causal, **features)


@pytest.mark.parametrize("kinds", [("window", "sinks"), ("softcap", "alibi")], ids="+".join)
def test_packed_sequences_grads(gen, kinds):
    lengths, slack = vl.SLACK["slack"]
    p = vl.make_packed(gen, lengths, *HEADS, 128, torch.bfloat16, slack=slack, tail=(3, 5))
    causal, features = _varlen_features(kinds[0], p.batch)
    features.update(_varlen_features(kinds[1], p.batch)[1])
    vl.check_varlen_grads(f"varlen {'+'.join(kinds)} causal={causal}", p, gen, causal=causal, **features)


# --- errors -----------------------------------------------------------------------------------

BAD_FEATURES = {
    "window of one side": ({"window_size": (-1,)}, TypeError, "window_size"),
    "window not a pair": ({"window_size": 16}, TypeError, "window_size"),
    "window of floats": ({"window_size": (1.5, 0)}, ValueError, "window_size"),
    "window below -1": ({"window_size": (-2, 0)}, ValueError, "window_size"),
    "negative softcap": ({"softcap": -1.0}, ValueError, "softcap"),
    "infinite softcap": ({"softcap": math.inf}, ValueError, "softcap"),
    "softcap a string": ({"softcap": "50"}, TypeError, "softcap"),
    "slopes of another head count": (
        {"alibi_slopes": ("zeros", (5,), torch.float32)},
        ValueError,
        "alibi_slopes",
    ),
    "slopes of ints": ({"alibi_slopes": ("zeros", (4,), torch.int32)}, TypeError, "alibi_slopes"),
    "slopes on the host": ({"alibi_slopes": ("host", (4,), torch.float32)}, ValueError, "alibi_slopes"),
    "slopes not a tensor": ({"alibi_slopes": [0.5] * 4}, TypeError, "alibi_slopes"),
    "sinks per batch": ({"sinks": ("zeros", (2, 4), torch.float32)}, ValueError, "sinks"),
    "sinks of ints": ({"sinks": ("zeros", (4,), torch.int64)}, TypeError, "sinks"),
    "sinks on the host": ({"sinks": ("host", (4,), torch.float32)}, ValueError, "sinks"),
}


def _materialize(value):
    if isinstance(value, tuple) and len(value) == 3 and value[0] in ("zeros", "host"):
        kind, shape, dtype = value
        return torch.zeros(shape, dtype=dtype, device="cpu" if kind == "host" else DEVICE)
    return value


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("case", BAD_FEATURES, ids=str)
def test_bad_feature_input_names_the_argument(gen, case, varlen):
    options, error, name = BAD_FEATURES[case]
    options = {key: _materialize(value) for key, value in options.items()}
    if varlen:
        p = vl.make_packed(gen, [(5, 5), (7, 9)], *HEADS, 64, torch.bfloat16)
        with pytest.raises(error, match=name):
            p.call(**options)
    else:
        q, k, v = inputs(gen, 2, 16, 16, head_dim=64)
        with pytest.raises(error, match=name):
            cutefa.flash_attn_func(q, k, v, **options)
