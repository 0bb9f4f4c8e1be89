"""The sm90 16-bit forward's feature kernels (templates/fwd_sm90.py.j2: packed variable-length
batches, the local window, softcap, ALiBi, sinks; each alone and combined), called directly with
the calling convention of cutefa/api/features.py, against a float32 reference computed sequence
by sequence here.

Every output is NaN-filled before the call, so an element the kernel does not write fails; in a
packed batch the rows of no sequence (a span's slack past its ``seqused``, the packed tail) must
be 0 with lse -inf (the module's fill kernel, cutefa/kernels/common/varlen_fill.py, writes them;
the attention kernel never does), and the slack rows of q, k and v hold NaN (the kernel
must never read them: the ragged TMA views zero-fill past a sequence's end); an edge batch (empty
and one-row sequences, windows empty for whole tiles) also runs with the packed tensors in guarded
memory, unmapped address space right below and right above each, where any access outside them
faults at once. A row that attends no key (an empty window, a sequence without keys) must be
exactly 0 with lse -inf (the sink with sinks). Errors are held to twice those of the same
attention computed with the inputs' dtype (scores and P rounded to it, as a 16-bit kernel does),
plus the rounding of the output dtype and, with softcap, what the error of ``tanh.approx``
(relative 2^-11, times the cap in the scores) can move the output and the lse by.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import hopper_skip_reason

from cutefa.api.features import UNBOUNDED
from cutefa.model.options import Mask, Schedule, Scheduler
from cutefa.model.spec import Features, VariantSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(hopper_skip_reason() is not None, reason=str(hopper_skip_reason())),
]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TARGET = "sm_90a"
SOFTCAP = 5.0
TANH_APPROX_ERROR = 2.0**-11  # tanh.approx.f32, relative
LSE_TOL = 5e-4


def _spec(head_dim, tile, dtype="bf16", *, mask=Mask.NONE, schedule=Schedule.OVERLAP_PINGPONG, **flags):
    """A 16-bit sm90 forward spec: ``tile`` (tile_m, tile_n); ``flags``: the Features fields and the
    option fields (scheduler, pair_cvt, lazy_rescale, early_rescale, exp_emu)."""
    feature_names = {"varlen", "softcap", "alibi", "sinks"}
    features = Features(**{k: v for k, v in flags.items() if k in feature_names})
    options = {k: v for k, v in flags.items() if k not in feature_names}
    warps = 4 * (tile[0] // 64 + 1)
    return VariantSpec(
        "sm90", "fwd", dtype, head_dim, tile[0], tile[1], 2, warps, mask=mask, features=features,
        schedule=schedule, **options,
    )  # fmt: skip


ALL = {"varlen": True, "softcap": True, "alibi": True, "sinks": True}
SPECS = [
    # the dispatched default (128 x tile_n, overlap + ping-pong, grid) with each feature alone
    _spec(128, (128, 128), varlen=True),
    _spec(128, (128, 128), "fp16", mask=Mask.CAUSAL, varlen=True),
    _spec(64, (128, 128), mask=Mask.LOCAL),
    _spec(128, (128, 128), mask=Mask.LOCAL, varlen=True),
    _spec(256, (128, 64), mask=Mask.CAUSAL, softcap=True),
    _spec(96, (128, 128), alibi=True),
    _spec(192, (128, 96), mask=Mask.LOCAL, sinks=True),
    _spec(128, (128, 128), softcap=True),
    _spec(64, (128, 128), "fp16", sinks=True),
    # everything at once
    _spec(128, (128, 128), "fp16", mask=Mask.LOCAL, **ALL),
    _spec(64, (128, 128), mask=Mask.LOCAL, **ALL),
    _spec(256, (128, 64), mask=Mask.LOCAL, **ALL),
    # the other schedules and options
    _spec(128, (128, 128), mask=Mask.LOCAL, schedule=Schedule.SERIAL, varlen=True, sinks=True),
    _spec(128, (128, 128), schedule=Schedule.PINGPONG, varlen=True, alibi=True),
    _spec(128, (128, 128), mask=Mask.LOCAL, schedule=Schedule.OVERLAP, softcap=True, exp_emu=25),
    _spec(
        64, (128, 128), mask=Mask.LOCAL, scheduler=Scheduler.PERSISTENT, softcap=True, alibi=True, sinks=True
    ),
    _spec(64, (192, 128), mask=Mask.LOCAL, scheduler=Scheduler.LPT, sinks=True),
    # packed batches on the persistent and longest-first schedulers (the batch's tile list)
    _spec(64, (128, 128), mask=Mask.CAUSAL, scheduler=Scheduler.PERSISTENT, varlen=True),
    _spec(64, (192, 128), mask=Mask.LOCAL, scheduler=Scheduler.LPT, varlen=True, alibi=True),
    _spec(
        256,
        (128, 80),
        mask=Mask.CAUSAL,
        scheduler=Scheduler.LPT,
        early_rescale=True,
        pair_cvt=True,
        lazy_rescale=True,
        varlen=True,
        softcap=True,
    ),
    _spec(64, (192, 128), mask=Mask.LOCAL, lazy_rescale=True, varlen=True, softcap=True),
    _spec(128, (128, 176), "fp16", mask=Mask.CAUSAL, pair_cvt=True, varlen=True, sinks=True),
    _spec(256, (128, 80), mask=Mask.CAUSAL, early_rescale=True, pair_cvt=True, lazy_rescale=True, **ALL),
]

# (seqlen_q, seqlen_k) per sequence of a packed batch: one-row, short against long, an empty
# sequence, long against short, more keys than one tile row, a sequence with no keys.
VARLEN_LENGTHS = ((1, 1), (17, 1000), (0, 5), (1000, 17), (4097, 4097), (300, 129), (5, 0))
SLACK = (0, 3, 0, 7, 1, 0, 2)  # rows of each span past its seqused (slack holds NaN)
# (batch, seqlen_q, seqlen_k) of the dense calls
DENSE_SHAPES = ((2, 17, 1000), (1, 1000, 17), (1, 4097, 4097), (3, 129, 300))
# (window_left, window_right); -1 unbounded. Causal with a window is right = 0. With seqlen_q >
# seqlen_k the leading rows of a narrow window see no key.
WINDOWS = ((100, 50), (0, 0), (300, 0), (-1, 0), (17, -1), (-1, -1), (4096, 4096))
HEADS = ((6, 2), (3, 3))  # (heads_q, heads_kv): grouped and plain


def _bound(side: int) -> int:
    return UNBOUNDED if side < 0 else side


# ---------------------------------------------------------------------------------------------
# Reference


def reference(q, k, v, scale, *, causal, window, softcap, slopes, sinks, dtype=torch.float32):
    """One sequence: q (sq, hq, d), k and v (sk, hkv, d); ``slopes`` (hq,) or None, ``sinks``
    (hq,) or None, ``window`` (left, right) with -1 unbounded, or None. Returns (out (sq, hq, d)
    float32, lse (hq, sq) float32). With ``dtype`` 16-bit, scores and P are rounded to it (what a
    16-bit kernel does); the softmax itself stays float32."""
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.to(dtype), k.to(dtype)).float() * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rows = torch.arange(sq, device=q.device)[:, None]
    cols = torch.arange(sk, device=q.device)[None, :]
    diag = rows + sk - sq
    if slopes is not None:
        s = s - slopes.float()[:, None, None] * (diag - cols).abs().float()
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= cols <= diag
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= cols >= diag - left
        if right >= 0:
            allowed &= cols <= diag + right
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        with_sink = torch.cat([s, sinks.float()[:, None, None].expand(hq, sq, 1)], dim=-1)
        lse = torch.logsumexp(with_sink, dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1) if sk else torch.full((hq, sq), -math.inf, device=q.device)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", p.to(dtype), v.to(dtype)).float()
    return out, lse


def check(out, lse, q, k, v, scale, spec, window, slopes, sinks, where):
    """Kernel (out (sq, hq, d), lse (hq, sq)) of one sequence against the float32 reference."""
    if out.numel() == 0:
        return
    kw = {
        "causal": spec.mask is Mask.CAUSAL, "window": window, "softcap": SOFTCAP if spec.features.softcap else 0.0,
        "slopes": slopes,
    }  # fmt: skip
    ref_out, ref_lse = reference(q, k, v, scale, sinks=sinks, **kw)
    low_out, _ = reference(q, k, v, scale, sinks=sinks, dtype=q.dtype, **kw)
    # rows that attend no key (lse -inf without the sink)
    no_key = torch.isinf(ref_lse if sinks is None else reference(q, k, v, scale, sinks=None, **kw)[1])
    out, lse = out.float(), lse.float()
    assert not out.isnan().any(), f"{where}: NaN in out"
    assert not lse.isnan().any(), f"{where}: NaN in lse"
    tol = 2 * (low_out - ref_out).abs().max().item() + torch.finfo(q.dtype).eps
    lse_tol = LSE_TOL
    if spec.features.softcap:
        # a relative error e of P moves an average of v by at most 2 e max|v|
        tol += 2 * SOFTCAP * TANH_APPROX_ERROR * (v.float().abs().max().item() if v.numel() else 0.0)
        lse_tol += SOFTCAP * TANH_APPROX_ERROR
    err = (out - ref_out).abs().max().item()
    assert err <= tol, f"{where}: out error {err:.3g} > {tol:.3g}"
    assert (out.permute(1, 0, 2)[no_key] == 0).all(), f"{where}: a row with no key is not 0"
    if sinks is None:
        assert torch.isinf(lse[no_key]).all() and (lse[no_key] < 0).all(), (
            f"{where}: a row with no key has lse != -inf"
        )
    else:
        sink_rows = sinks.float()[:, None].expand_as(no_key)[no_key]
        assert torch.allclose(lse[no_key], sink_rows, atol=1e-5), (
            f"{where}: a row with no key has lse != its sink"
        )
    keyed = ~no_key
    if keyed.any():
        lse_err = (lse[keyed] - ref_lse[keyed]).abs().max().item()
        assert lse_err <= lse_tol, f"{where}: lse error {lse_err:.3g} > {lse_tol:.3g}"


# ---------------------------------------------------------------------------------------------
# Calls


def feature_args(spec, window, slopes, sinks, varlen=()):
    """The trailing kernel arguments in the convention's order (cutefa/api/features.py)."""
    args = list(varlen)
    if spec.mask is Mask.LOCAL:
        args += [_bound(window[0]), _bound(window[1])]
    if spec.features.softcap:
        args.append(SOFTCAP)
    if spec.features.alibi:
        args.append(slopes)
    if spec.features.sinks:
        args.append(sinks)
    return args


def windows_of(spec):
    """The windows a spec is called with: none without the local mask."""
    return WINDOWS if spec.mask is Mask.LOCAL else (None,)


def extras(gen, spec, batch, heads_q):
    slopes = torch.rand(batch, heads_q, generator=gen, device="cuda") * 0.2 if spec.features.alibi else None
    sinks = torch.randn(heads_q, generator=gen, device="cuda") * 2 if spec.features.sinks else None
    return slopes, sinks


def _driver_ok(result):
    """The value of a cuda.bindings driver call's (error, value...) tuple; raises on an error."""
    import cuda.bindings.driver as cu

    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else tuple(values) or None


class _DeviceArray:
    """Raw device bytes as an object torch.as_tensor takes (the CUDA array interface, version 3)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None,
        }  # fmt: skip


class GuardedMemory:
    """Device buffers each in its own reserved address range with unmapped address space as large
    as the buffer right below it and one allocation granule right above it (the driver's virtual
    memory management: cuMemAddressReserve, cuMemCreate, cuMemMap). An access outside a buffer, or
    a TMA descriptor whose base address lies outside it, raises an illegal-address error instead of
    reading whatever the caching allocator put next to it. A context manager: the buffers are
    unmapped and freed (after a device synchronisation) when it exits; no tensor of it may be used
    after that."""

    def __enter__(self):
        import cuda.bindings.driver as cu

        torch.zeros(1, device="cuda")  # torch's primary context current on this thread
        self.device = torch.cuda.current_device()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        self._prop = prop
        minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granule = int(_driver_ok(cu.cuMemGetAllocationGranularity(prop, minimum)))
        self._held = []
        return self

    def rows_filling(self, rows: int, row_bytes: int) -> int:
        """The least row count >= ``rows`` whose bytes fill whole granules (so the buffer ends where
        the unmapped space above it begins)."""
        step = self.granule // math.gcd(self.granule, row_bytes)
        return -(-max(rows, 1) // step) * step

    def full(self, shape, value, dtype) -> torch.Tensor:
        import cuda.bindings.driver as cu

        nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
        assert nbytes % self.granule == 0, "pad the rows with rows_filling"
        reserved = nbytes + nbytes + self.granule  # unmapped below, the buffer, unmapped above
        start = int(_driver_ok(cu.cuMemAddressReserve(reserved, self.granule, 0, 0)))
        address = start + nbytes
        handle = _driver_ok(cu.cuMemCreate(nbytes, self._prop, 0))
        _driver_ok(cu.cuMemMap(address, nbytes, 0, handle, 0))
        self._held.append((start, reserved, address, nbytes, handle))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _driver_ok(cu.cuMemSetAccess(address, nbytes, [access], 1))
        raw = torch.as_tensor(_DeviceArray(address, nbytes), device=f"cuda:{self.device}")
        assert raw.data_ptr() == address
        return raw.view(dtype).view(shape).fill_(value)

    def __exit__(self, *exc):
        import cuda.bindings.driver as cu

        torch.cuda.synchronize()
        for start, reserved, address, nbytes, handle in reversed(self._held):
            _driver_ok(cu.cuMemUnmap(address, nbytes))
            _driver_ok(cu.cuMemRelease(handle))
            _driver_ok(cu.cuMemAddressFree(start, reserved))
        return False


def run_varlen(
    gen, spec, kernel, heads_q, heads_kv, window, lengths=VARLEN_LENGTHS, slack=SLACK, memory=None
):
    """A packed batch of sequences of ``lengths`` (seqlen_q, seqlen_k), each span ``slack`` rows
    longer than its seqused, the packed tensors a few rows longer than the spans. ``memory``: a
    :class:`GuardedMemory` to place q, k, v and out in (their tails then padded to whole granules),
    where an access outside them faults."""
    dtype, d = DTYPES[spec.dtype], spec.head_dim
    scale = 1.0 / math.sqrt(d)
    lens_q = [sq for sq, _ in lengths]
    lens_k = [sk for _, sk in lengths]
    spans_q = [n + s for n, s in zip(lens_q, slack, strict=True)]
    spans_k = [n + s for n, s in zip(lens_k, slack, strict=True)]
    cu_q = torch.tensor([0, *torch.tensor(spans_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(spans_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    tail = 9  # packed rows past the last span (a buffer with room to spare)
    total_q, total_k = int(cu_q[-1]) + tail, int(cu_k[-1]) + tail

    def packed(rows, heads):
        if memory is None:
            return torch.full((rows, heads, d), math.nan, dtype=dtype, device="cuda")
        return memory.full((rows, heads, d), math.nan, dtype)

    if memory is not None:
        row_bytes = d * torch.finfo(dtype).bits // 8
        total_q = memory.rows_filling(total_q, heads_q * row_bytes)
        total_k = memory.rows_filling(total_k, heads_kv * row_bytes)
    q, out = packed(total_q, heads_q), packed(total_q, heads_q)
    k, v = packed(total_k, heads_kv), packed(total_k, heads_kv)
    for b in range(len(lens_q)):  # sequences' rows random, slack and tail NaN
        q[int(cu_q[b]) : int(cu_q[b]) + lens_q[b]] = torch.randn(
            lens_q[b], heads_q, d, generator=gen, device="cuda"
        ).to(dtype)
        for t in (k, v):
            t[int(cu_k[b]) : int(cu_k[b]) + lens_k[b]] = torch.randn(
                lens_k[b], heads_kv, d, generator=gen, device="cuda"
            ).to(dtype)
    used_q = torch.tensor(lens_q, dtype=torch.int32, device="cuda")
    used_k = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    lse = torch.full((heads_q, total_q), math.nan, device="cuda")
    slopes, sinks = extras(gen, spec, len(lens_q), heads_q)
    varlen = (cu_q, cu_k, used_q, used_k, max(lens_q))
    kernel(q, k, v, out, lse, scale, *feature_args(spec, window, slopes, sinks, varlen))
    torch.cuda.synchronize()
    written = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b]) + lens_q[b])
        rk = slice(int(cu_k[b]), int(cu_k[b]) + lens_k[b])
        written[rq] = True
        where = f"{spec.name} heads {heads_q}/{heads_kv} window {window} sequence {b} {lengths[b]}"
        check(
            out[rq], lse[:, rq], q[rq], k[rk], v[rk], scale, spec, window,
            None if slopes is None else slopes[b], sinks, where,
        )  # fmt: skip
    assert (out[~written] == 0).all(), f"{spec.name}: packed rows of no sequence must be 0 (the fill)"
    assert torch.isneginf(lse[:, ~written]).all(), (
        f"{spec.name}: packed rows of no sequence must have lse -inf"
    )


def run_dense(gen, spec, kernel, heads_q, heads_kv, window, shape):
    dtype, d = DTYPES[spec.dtype], spec.head_dim
    scale = 1.0 / math.sqrt(d)
    batch, sq, sk = shape
    q = torch.randn(batch, sq, heads_q, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(batch, sk, heads_kv, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(batch, sk, heads_kv, d, generator=gen, device="cuda").to(dtype)
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, heads_q, sq), math.nan, device="cuda")
    slopes, sinks = extras(gen, spec, batch, heads_q)
    kernel(q, k, v, out, lse, scale, *feature_args(spec, window, slopes, sinks))
    torch.cuda.synchronize()
    for b in range(batch):
        where = f"{spec.name} heads {heads_q}/{heads_kv} window {window} shape {shape} batch {b}"
        check(
            out[b],
            lse[b],
            q[b],
            k[b],
            v[b],
            scale,
            spec,
            window,
            None if slopes is None else slopes[b],
            sinks,
            where,
        )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_feature_kernel(gen, spec):
    from cutefa.loader import get_kernel
    from cutefa.model.rules import why_invalid

    assert why_invalid(spec) is None, why_invalid(spec)
    kernel = get_kernel(spec, TARGET)  # a persistent kernel's SM count is appended last
    for heads_q, heads_kv in HEADS:
        for window in windows_of(spec):
            if spec.features.varlen:
                run_varlen(gen, spec, kernel, heads_q, heads_kv, window)
            else:
                for shape in DENSE_SHAPES:
                    run_dense(gen, spec, kernel, heads_q, heads_kv, window, shape)


PACKED = [s for s in SPECS if s.features.varlen]


@pytest.mark.parametrize(
    "spec",
    [s for s in PACKED if s.options.scheduler is not Scheduler.GRID] + PACKED[:1],
    ids=lambda s: s.name,
)
def test_many_sequences(gen, spec):
    """70 sequences (several 32-sequence steps of the tile list's search), lengths 0 to 700 with
    zeros among them, on the schedulers that walk the batch's tile list and on the grid."""
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, TARGET)
    draw = torch.randint(0, 700, (70, 2), generator=torch.Generator().manual_seed(70))
    draw[::9, 0] = 0  # sequences with no query
    draw[4::9, 1] = 0  # and with no key
    lengths = [(int(a), int(b)) for a, b in draw]
    slack = [int(x) for x in torch.randint(0, 4, (70,), generator=torch.Generator().manual_seed(71))]
    window = (200, 30) if spec.mask is Mask.LOCAL else None
    run_varlen(gen, spec, kernel, 4, 2, window, lengths, slack)


def test_varlen_grid_wider_than_the_batch(gen):
    """max_seqlen_q larger than every sequence (the grid has columns past every sequence's tiles):
    those CTAs write nothing, and the result is the same, bit for bit, as with the exact max."""
    from cutefa.loader import get_kernel

    spec = SPECS[0]
    kernel = get_kernel(spec, TARGET)
    d, dtype = spec.head_dim, DTYPES[spec.dtype]
    lens = [130, 1, 64]
    cu = torch.tensor([0, 130, 131, 195], dtype=torch.int32, device="cuda")
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(195, 4, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(195, 2, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(195, 2, d, generator=gen, device="cuda").to(dtype)
    results = []
    for max_seqlen in (130, 1000):
        out = torch.full_like(q, math.nan)
        lse = torch.full((4, 195), math.nan, device="cuda")
        kernel(q, k, v, out, lse, 0.125, cu, cu, used, used, max_seqlen)
        results.append((out, lse))
    torch.cuda.synchronize()
    assert not results[0][0].isnan().any() and not results[0][1].isnan().any()
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize(
    "spec",
    [s for s in PACKED if s.options.scheduler is not Scheduler.GRID] + PACKED[:1],
    ids=lambda s: s.name,
)
def test_varlen_batch_without_queries(gen, spec):
    """Every sequence's seqused_q is 0 (max_seqlen_q 0): the launch still has one CTA across,
    which finds no tile and writes nothing; every row is then one of no sequence: the module's fill
    makes it 0 / -inf."""
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, TARGET)
    d, dtype = spec.head_dim, DTYPES[spec.dtype]
    cu = torch.tensor([0, 40, 80], dtype=torch.int32, device="cuda")
    used_q = torch.zeros(2, dtype=torch.int32, device="cuda")
    used_k = torch.tensor([40, 7], dtype=torch.int32, device="cuda")
    q = torch.randn(80, 4, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(80, 2, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(80, 2, d, generator=gen, device="cuda").to(dtype)
    out = torch.full_like(q, math.nan)
    lse = torch.full((4, 80), math.nan, device="cuda")
    slopes, sinks = extras(gen, spec, 2, 4)
    window = (10, 0) if spec.mask is Mask.LOCAL else None
    kernel(q, k, v, out, lse, 0.125, *feature_args(spec, window, slopes, sinks, (cu, cu, used_q, used_k, 0)))
    torch.cuda.synchronize()
    assert (out == 0).all() and torch.isneginf(lse).all()


# A packed batch at the edges: sequences with no query, no key or neither, one-row ones, one row
# short of and past a tile, and more queries than keys, so that the narrow windows leave whole
# query tiles whose band is empty (they load no key block).
EDGE_LENGTHS = ((0, 0), (1, 1), (0, 1), (1, 0), (127, 129), (129, 127), (300, 20), (20, 300), (1, 200))
EDGE_SLACK = (0, 0, 2, 0, 1, 0, 0, 3, 0)
EDGE_WINDOWS = ((0, 0), (5, 0), (-1, 0), (0, -1), (-1, -1))


@pytest.mark.parametrize("spec", PACKED, ids=lambda s: s.name)
def test_varlen_guarded(gen, spec):
    """Every packed-batch kernel on the edge batch with q, k, v and out in guarded memory
    (:class:`GuardedMemory`: unmapped address space right below and right above each, the packed
    tails padded so that each ends where the space above begins). Any TMA box or load outside
    them, or a TMA descriptor whose base address lies outside them, raises an illegal-address
    error here, where next to the caching allocator's neighbours it would read or write them
    unnoticed (or fault only in some processes)."""
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, TARGET)
    for window in EDGE_WINDOWS if spec.mask is Mask.LOCAL else (None,):
        with GuardedMemory() as memory:
            run_varlen(gen, spec, kernel, 4, 2, window, EDGE_LENGTHS, EDGE_SLACK, memory)
