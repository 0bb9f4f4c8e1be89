"""The backward pass on the CPU: the kernel's block schedule emulated in torch, autograd wiring,
GQA reduction, dLSE, deterministic splits, fake impls under torch.compile, and the host side of the
launch (which tensors each family's kernel gets, the sm90 family's grouped-query workspace).

``emulate_kernel`` follows templates/bwd_sm80.py.j2 step by step (key blocks per CTA and split,
the first query block of a key block when causal, when the mask is applied, LSE in log2 units with
+inf for empty or padded rows, D = rowsum(dO * O) - dLSE, P and dS rounded to the input dtype,
dK and dQ scaled at the end), so the index arithmetic of the kernel is checked against autograd
of a plain float32 attention on ragged, causal and grouped-query shapes. Grouped-query dK and dV
(shaped like k) are summed as the sm90 family's kernels sum them (templates/bwd_sm90.py.j2: the
float32 dK/dV of a key block added into the kv head's slot, slots summed in order, one rounding);
given per-query-head tensors it writes them as the sm80 family's kernels do.
"""

from __future__ import annotations

import math

import pytest
import torch
from cpu_support import load_tool, reference
from torch._subclasses.fake_tensor import FakeTensorMode

import cutefa
from cutefa.api import backward, dense, validate
from cutefa.kernels.sm80 import tail
from cutefa.model.budgets_sm90 import sm90_bwd_dkv_accum_shape
from cutefa.model.defaults import DEFAULT_BWD_TILES, default_spec
from cutefa.model.options import DqLayout
from cutefa.model.rules import why_not_on
from cutefa.model.spec import HEAD_DIMS, VariantSpec

LOG2_E = math.log2(math.e)


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def emulate_kernel(dout, q, k, v, out, lse, dlse, dq, dk_heads, dv_heads, causal, scale, deterministic,
                   tile_m=64, tile_n=128, splits=3, slots=0):  # fmt: skip
    """What the three kernels of templates/bwd_sm80.py.j2 compute, block by block (``slots``: the
    stream-K tail's, 0 for none). ``dk_heads``/``dv_heads`` per query head (the sm80 family's), or
    shaped like k: then a kv head's group is summed in float32 as the sm90 family's kernels do it."""
    dtype = q.dtype
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    per_head = dk_heads.shape[2] == hq
    # the sm90 family's grouped-query workspace: a slot per query head of a group when deterministic
    dkv_slots = 1 if per_head or not deterministic else group
    dkv_sum = torch.zeros(dkv_slots, 2, batch, sk, hkv, d)
    # preprocess
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dpsum = (dout.float() * out.float()).sum(-1).transpose(1, 2) - dlse
    lse2 = torch.where(lse == -math.inf, math.inf, lse * LOG2_E)
    # main
    n_blocks, m_blocks = ceil_div(sk, tile_n), ceil_div(sq, tile_m)
    splits = min(splits, n_blocks) if deterministic else 1
    grid_x = splits if deterministic else n_blocks
    acc = torch.zeros(splits, batch, sq, hq, d)

    def rows_of(t, b, h, r0, n):  # a zero-padded (n, d) tile
        tile = torch.zeros(n, d, dtype=t.dtype)
        part = t[b, r0 : r0 + n, h]
        tile[: part.shape[0]] = part
        return tile.float()

    def key_block(b, h, n_block, split, m_lo=None, m_hi=None):
        """dK (scaled) and dV of one key block over query blocks [m_lo, m_hi), its dQ added."""
        n0 = n_block * tile_n
        m_begin = max(n0 + sq - sk, 0) // tile_m if causal else 0
        m_lo = m_begin if m_lo is None else m_lo
        m_hi = m_blocks if m_hi is None else m_hi
        kt, vt = rows_of(k, b, h // group, n0, tile_n), rows_of(v, b, h // group, n0, tile_n)
        dk_acc, dv_acc = torch.zeros(tile_n, d), torch.zeros(tile_n, d)
        for m_block in range(m_lo, m_hi):
            m0 = m_block * tile_m
            rows = torch.arange(m0, m0 + tile_m)
            inside = rows < sq
            l2 = torch.full((tile_m,), math.inf)
            dps = torch.zeros(tile_m)
            l2[inside] = lse2[b, h, rows[inside]]
            dps[inside] = dpsum[b, h, rows[inside]]
            qt, dot = rows_of(q, b, h, m0, tile_m), rows_of(dout, b, h, m0, tile_m)
            s = qt @ kt.T
            masked = n0 + tile_n > sk or (causal and n0 + tile_n - 1 > m0 + sk - sq)
            if masked:
                cols = torch.arange(n0, n0 + tile_n)
                limit = torch.full((tile_m,), sk)
                if causal:
                    limit = torch.minimum(limit, rows + 1 + sk - sq)
                s = s.masked_fill(cols[None, :] >= limit[:, None], -math.inf)
            p = torch.exp2(s * scale * LOG2_E - l2[:, None]).to(dtype)
            dp = dot @ vt.T
            ds = (p.float() * (dp - dps[:, None])).to(dtype)
            dv_acc += p.float().T @ dot
            dk_acc += ds.float().T @ qt
            dq_tile = ds.float() @ kt
            acc[split, b, rows[inside], h] += dq_tile[inside]
        return dk_acc * scale, dv_acc

    def write(b, h, n_block, dk_acc, dv_acc):
        n0 = n_block * tile_n
        valid = min(tile_n, sk - n0)
        if per_head:
            dk_heads[b, n0 : n0 + valid, h] = dk_acc[:valid].to(dtype)
            dv_heads[b, n0 : n0 + valid, h] = dv_acc[:valid].to(dtype)
        else:
            slot = h % group if dkv_slots > 1 else 0
            dkv_sum[slot, 0, b, n0 : n0 + valid, h // group] += dk_acc[:valid]
            dkv_sum[slot, 1, b, n0 : n0 + valid, h // group] += dv_acc[:valid]

    # The stream-K tail (cutefa/kernels/sm80/tail.py): the units of the grid's order from `region`
    # on are cut into the stream CTAs' ranges; a cut unit's parts are summed in CTA order.
    units = n_blocks * hq * batch
    ctas = tail.plan(units, m_blocks, slots) if slots and not causal and not deterministic else []
    region = units - units % slots - slots if ctas else units
    for b in range(batch):
        for h in range(hq):
            for bx in range(grid_x):
                if bx + n_blocks * (h + hq * b) >= region and not deterministic:
                    continue
                for it in range(ceil_div(n_blocks - bx, grid_x)):
                    n_block = bx + it * grid_x
                    write(b, h, n_block, *key_block(b, h, n_block, bx if deterministic else 0))
    parts = {}
    for c, segments in enumerate(ctas):
        for unit, m_lo, m_hi, slot in segments:
            u = region + unit
            n_block, h, b = u % n_blocks, u // n_blocks % hq, u // (n_blocks * hq)
            dk_acc, dv_acc = key_block(b, h, n_block, 0, m_lo, m_hi)
            if slot < 0:
                write(b, h, n_block, dk_acc, dv_acc)
            else:
                parts[c, slot] = (dk_acc, dv_acc)
    steps = (units % slots + slots) * m_blocks if ctas else 0
    for unit in range(units - region):
        order = tail.part_slots(unit, m_blocks, steps, slots)
        if len(order) > 1:
            u = region + unit
            got = [parts.pop(key) for key in order]  # KeyError: a part the plan did not make
            dk_acc, dv_acc = got[0]
            for dk_part, dv_part in got[1:]:
                dk_acc, dv_acc = dk_acc + dk_part, dv_acc + dv_part
            write(u // (n_blocks * hq), u // n_blocks % hq, u % n_blocks, dk_acc, dv_acc)
    assert not parts, f"parts never summed: {sorted(parts)}"
    # postprocess
    dq.copy_((acc.sum(0) * scale).to(dtype))
    if not per_head:
        total = dkv_sum[0]
        for slot in range(1, dkv_slots):  # in order
            total = total + dkv_sum[slot]
        dk_heads.copy_(total[0].to(dtype))
        dv_heads.copy_(total[1].to(dtype))


@pytest.fixture
def on_cpu(monkeypatch):
    """The forward op runs the float32 reference and the backward launch runs the emulation."""
    calls = []

    def launch(q, k, v, out, lse, causal, softmax_scale):
        o, l = reference(q, k, v, causal, softmax_scale)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)

    def launch_bwd(*args, spec=None, dpsum=None):
        calls.append(args)
        emulate_kernel(*args)
        if dpsum is not None:  # the preprocess's D = rowsum(dO * O) - dLSE, lse's layout
            dout, out, dlse = args[0], args[4], args[6]
            d = (dout.float() * out.float()).sum(-1).permute(0, 2, 1)
            dpsum.copy_(d - (dlse.float() if dlse is not None else 0.0))

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dense, "_launch", launch)
    monkeypatch.setattr(backward, "_launch_bwd", launch_bwd)
    return calls


def qkv(batch, sq, sk, hq, hkv, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda s, h: torch.randn(batch, s, h, d, generator=g).to(dtype).requires_grad_()
    return mk(sq, hq), mk(sk, hkv), mk(sk, hkv)


SHAPES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv
    (1, 1, 1, 1, 1),
    (1, 17, 17, 2, 1),
    (2, 130, 70, 2, 2),
    (1, 70, 200, 4, 2),
    (1, 200, 130, 3, 1),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_sq{}_sk{}_hq{}_hkv{}".format(*s))
@pytest.mark.parametrize("deterministic", [False, True])
def test_kernel_schedule_matches_autograd(on_cpu, shape, causal, deterministic):
    batch, sq, sk, hq, hkv = shape
    q, k, v = qkv(batch, sq, sk, hq, hkv, 64)
    scale = 0.3
    out, lse = cutefa.flash_attn_func(
        q, k, v, causal=causal, softmax_scale=scale, return_lse=True, deterministic=deterministic
    )
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g)
    dlse = torch.where(torch.isinf(lse), 0.0, dlse)
    torch.autograd.backward((out, lse), (dout, dlse))
    assert len(on_cpu) == 1 and on_cpu[0][12] is deterministic
    assert on_cpu[0][8].shape == on_cpu[0][9].shape == k.shape  # dk, dv: one per kv head

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference(q32, k32, v32, causal, scale)
    lse_fin = torch.where(torch.isinf(lse_ref), 0.0, lse_ref)
    torch.autograd.backward((o_ref, lse_fin), (dout.float(), dlse))
    for name, got, want in (("dq", q.grad, q32.grad), ("dk", k.grad, k32.grad), ("dv", v.grad, v32.grad)):
        assert got.shape == want.shape and got.dtype == torch.float16, name
        err = (got.float() - want).norm() / max(want.norm(), 1e-6)
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv) and a slot count that gives it a stream-K tail
TAIL_CASES = [((1, 130, 1600, 1, 1), n) for n in (2, 3, 5, 7)] + [
    ((1, 200, 2053, 1, 1), 3),
    ((1, 200, 2053, 1, 1), 7),
    ((2, 70, 300, 2, 1), 5),
    ((2, 70, 300, 2, 1), 7),
    ((3, 100, 260, 2, 2), 4),
]


@pytest.mark.parametrize(("shape", "slots"), TAIL_CASES, ids=str)
def test_stream_tail_matches_autograd(shape, slots):
    """The emulated kernel with the stream-K tail on a few slots (CTAs covering parts of key blocks
    and several key blocks of different heads and batches) against autograd of the reference."""
    batch, sq, sk, hq, hkv = shape
    assert backward.tail_slots(VariantSpec("sm80", "bwd", "fp16", 64, 64, 128, 1, 8), False, batch, hq, sq, sk, slots)
    q, k, v = qkv(batch, sq, sk, hq, hkv, 64, seed=slots)
    scale = 0.3
    with torch.no_grad():
        out, lse = reference(q.float(), k.float(), v.float(), False, scale)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(out.shape, generator=g).to(q.dtype)
    dq, dk_heads, dv_heads = torch.full_like(q, math.nan), *(torch.full((batch, sk, hq, 64), math.nan, dtype=q.dtype) for _ in range(2))
    emulate_kernel(dout, q.detach(), k.detach(), v.detach(), out.to(q.dtype), lse, None, dq, dk_heads, dv_heads, False,
                   scale, False, slots=slots)  # fmt: skip
    dk = dk_heads.float().view(batch, sk, hkv, hq // hkv, 64).sum(3)
    dv = dv_heads.float().view(batch, sk, hkv, hq // hkv, 64).sum(3)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference(q32, k32, v32, False, scale)
    o_ref.backward(dout.float())
    for name, got, want in (("dq", dq, q32.grad), ("dk", dk, k32.grad), ("dv", dv, v32.grad)):
        err = (got.float() - want).norm() / max(want.norm(), 1e-6)
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 7, 132, 264])
@pytest.mark.parametrize("m_blocks", [1, 2, 3, 16, 33])
@pytest.mark.parametrize("units", [1, 7, 64, 200, 2048, 4097])
def test_stream_tail_plan(units, m_blocks, slots):
    """The tail's plan: the region (the partial wave and one full wave before it) is covered step by
    step exactly once, in order, by ranges of equal length (to one step); no CTA has more than 3
    segments; a unit is cut exactly when more than one CTA covers it, and the reading side's
    (CTA, slot) order of its parts is the writers' own."""
    ctas = tail.plan(units, m_blocks, slots)
    rem = units % slots
    if rem == 0 or units < rem + slots:
        assert ctas == []
        return
    assert len(ctas) == slots
    steps = (rem + slots) * m_blocks
    covered = [(u * m_blocks + m) for segs in ctas for u, lo, hi, _ in segs for m in range(lo, hi)]
    assert covered == list(range(steps))
    lengths = [sum(hi - lo for _, lo, hi, _ in segs) for segs in ctas]
    assert max(lengths) - min(lengths) <= 1 and min(lengths) >= m_blocks
    assert max(len(segs) for segs in ctas) <= 3
    writers = {}
    for c, segs in enumerate(ctas):
        for u, lo, hi, slot in segs:
            assert (slot >= 0) == (lo > 0 or hi < m_blocks)
            if slot >= 0:
                writers.setdefault(u, []).append((c, slot))
    for u in range(rem + slots):
        order = tail.part_slots(u, m_blocks, steps, slots)
        assert order == writers.get(u, order[:1] if len(order) == 1 else None), u
        assert u < 2 * slots  # the counters the host allocates


def test_stream_tail_slots():
    """When the host turns the tail on: sm80 non-causal backward, not deterministic, a grid that
    ends on a partial wave after at least one full one, and the region's step products in 32 bits."""
    spec = VariantSpec("sm80", "bwd", "bf16", 64, 128, 128, 2, 8, dq_layout=DqLayout.TILE)
    # the bench grid at head dim 64: 2048 heads x dim / 64 = 32 heads, 16384 tokens: 4096 key blocks
    assert backward.tail_slots(spec, False, 2, 32, 8192, 8192, 132) == 132  # 4096 = 31 x 132 + 4
    assert backward.tail_slots(spec, True, 2, 32, 8192, 8192, 132) == 0  # deterministic
    assert backward.tail_slots(spec.replace(causal=True), False, 2, 32, 8192, 8192, 132) == 0
    assert backward.tail_slots(spec, False, 2, 33, 8192, 8192, 132) == 0  # 4224 = 32 x 132: whole waves
    assert backward.tail_slots(spec, False, 1, 1, 8192, 8192, 132) == 0  # 64 key blocks: under a wave
    assert backward.tail_slots(spec, False, 1, 1, 8192, 8192, 0) == 0
    assert backward.tail_slots(spec, False, 1, 1, 1 << 20, 128 * 150, 100) == 100  # 150 key blocks: 50 + 100
    assert backward.tail_slots(spec, False, 1, 1, 1 << 26, 128 * 150, 100) == 0  # steps x slots past 32 bits
    sm90 = VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12)
    assert backward.tail_slots(sm90, False, 2, 16, 8192, 8192, 132) == 0
    try:
        backward.TAIL_SLOTS = 5
        assert backward.tail_slots(spec, False, 2, 32, 8192, 8192, 132) == 5  # the override: 4096 = 819 x 5 + 1
    finally:
        backward.TAIL_SLOTS = None


def test_deterministic_splits():
    assert backward.dq_splits(False, 1, 1, 4096, 128, 132) == 1
    assert backward.dq_splits(True, 1, 4, 4096, 128, 132) == 32  # enough CTAs to fill 132 SMs
    assert backward.dq_splits(True, 1, 4, 200, 128, 132) == 2  # never more than the key blocks
    assert backward.dq_splits(True, 8, 32, 4096, 128, 132) == 1


def test_rows_that_attend_nothing_get_zero_gradients(on_cpu):
    q, k, v = qkv(1, 70, 20, 2, 2, 64)
    out = cutefa.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    assert torch.all(q.grad[:, :50] == 0)
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_empty_problems_give_zero_gradients(on_cpu):
    q, k, v = qkv(1, 5, 0, 2, 1, 64)
    cutefa.flash_attn_func(q, k, v).sum().backward()
    assert torch.all(q.grad == 0) and k.grad.shape == k.shape
    assert on_cpu == []


def test_choose_bwd_uses_the_default_tiles():
    """sm_90a: the sm90 backward where it has a tile (head dims 64 and 128), else the sm80 one;
    sm_80: always the sm80 one."""
    for head_dim in HEAD_DIMS:
        spec = backward.choose_bwd("sm_90a", torch.bfloat16, head_dim, True)
        family = "sm90" if head_dim in DEFAULT_BWD_TILES["sm90"] else "sm80"
        assert (spec.arch, spec.direction, spec.dtype, spec.causal) == (family, "bwd", "bf16", True), head_dim
        assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == DEFAULT_BWD_TILES[family][head_dim]
        spec = backward.choose_bwd("sm_80", torch.bfloat16, head_dim, True)
        assert (spec.arch, spec.tile_m, spec.tile_n, spec.stages, spec.warps) == (
            "sm80", *DEFAULT_BWD_TILES["sm80"][head_dim]
        )


def test_choose_bwd_by_shared_memory():
    """sm80 hd256: the single-buffered tile with dq_pipe (163 KiB) on every target from the A100
    on; the double-buffered one (182 KiB) is a measured alternative (tools/alternatives.py) that
    only sm_90a and newer hold. On sm_86/sm_89 (99 KiB) the defaults do not fit: hd64-128 take the largest committed tile
    that does, hd192/256 have none, and the error says so."""
    for target in ("sm_80", "sm_100a", "sm_103a"):  # sm_90a runs the sm90 family
        spec = backward.choose_bwd(target, torch.bfloat16, 256, False)
        assert (spec.arch, spec.tile_m, spec.tile_n, spec.stages, spec.options.dq_pipe) == ("sm80", 64, 64, 1, True), target
        assert why_not_on(spec, target) is None
    alternatives = load_tool("alternatives")
    assert (64, 64, 2, 8) in alternatives.SM80_BWD_TUNING_ALTERNATIVES[256]
    big_spec = next(
        s for s in alternatives.alternative_variants("sm80", "bwd") if s.head_dim == 256 and s.stages == 2
    )
    assert why_not_on(big_spec, "sm_90a") is None
    assert why_not_on(big_spec, "sm_80") == (
        "needs 182.0 KiB of shared memory, over the 163 KiB per-block opt-in limit of sm_80 GPUs"
    )
    for target in ("sm_86", "sm_89"):
        for head_dim, tile in ((64, (64, 128, 2, 8)), (96, (64, 64, 1, 8)), (128, (64, 64, 1, 8))):
            spec = backward.choose_bwd(target, torch.bfloat16, head_dim, True)
            assert (spec.arch, spec.tile_m, spec.tile_n, spec.stages, spec.warps) == ("sm80", *tile), head_dim
            assert spec.options.dq_layout is DqLayout.TILE and spec.causal and why_not_on(spec, target) is None
        for head_dim, kib in ((192, 118), (256, 150)):
            with pytest.raises(
                NotImplementedError, match=f"needs {kib}.0 KiB of shared memory, over the 99 KiB per-block opt-in "
                f"limit of {target} GPUs",
            ):  # fmt: skip
                backward.choose_bwd(target, torch.bfloat16, head_dim, True)


def test_choose_bwd_on_blackwell():
    """sm_100a: the sm100 backward where it has a tile (head dims 64 and 128), else the sm80 one."""
    for head_dim in HEAD_DIMS:
        spec = backward.choose_bwd("sm_100a", torch.float16, head_dim, False)
        family = "sm100" if head_dim in DEFAULT_BWD_TILES["sm100"] else "sm80"
        assert (spec.arch, spec.direction, spec.dtype) == (family, "bwd", "fp16"), head_dim
        assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == DEFAULT_BWD_TILES[family][head_dim]


def test_deterministic_must_be_bool():
    q, k, v = qkv(1, 4, 4, 1, 1, 64)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cutefa.flash_attn_func(q, k, v, deterministic=1)


def test_bwd_fake_impl_shapes_on_fake_cuda_tensors():
    with FakeTensorMode():
        q = torch.empty(2, 5, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 7, 2, 128, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(2, 8, 5, device="cuda")
        dq, dk, dv = torch.ops.cutefa.flash_bwd(q, q, k, k, q, lse, None, True, 0.1, False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    assert dq.dtype == torch.bfloat16 and dk.device.type == "cuda"


def test_torch_compile_fullgraph_traces_forward_and_backward(on_cpu):
    """fullgraph=True: the forward graph calls cutefa::flash_fwd and the backward graph
    cutefa::flash_bwd (AOT autograd traces both through the fake impls)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=capture, bw_compiler=capture)

    @torch.compile(fullgraph=True, backend=backend)
    def step(q, k, v):
        out, lse = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return (out.float() * 2).sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()

    torch._dynamo.reset()
    q, k, v = qkv(2, 8, 8, 4, 2, 64)
    step(q, k, v).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    called = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.cutefa.flash_fwd.default in called
    assert torch.ops.cutefa.flash_bwd.default in called


def test_torch_compile_matches_eager_on_cpu(on_cpu):
    torch._dynamo.reset()

    def loss(q, k, v):
        return cutefa.flash_attn_func(q, k, v, causal=True).float().square().sum()

    q, k, v = qkv(1, 33, 40, 2, 1, 64)
    loss(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    for got, want in zip((q.grad, k.grad, v.grad), eager):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# The host side of the launch: the tensors each family's kernel gets


class _H200:
    multi_processor_count = 132
    regs_per_multiprocessor = 65536
    shared_memory_per_multiprocessor = 228 * 1024


@pytest.fixture
def host_launch(monkeypatch):
    """backward.gradients on CPU tensors down to the kernel call: an H200 pretended, the kernel a
    stand-in that records its arguments and writes 1 + the head index into every row of its dK and
    dV arguments (arguments 8 and 9: dq, then dk, dv follow the seven inputs). Returns the calls."""
    calls = []

    def call_on(device, kernel, *args):
        calls.append((kernel, args))
        for t in args[8:10]:
            t.copy_(torch.arange(1, t.shape[2] + 1, dtype=t.dtype).view(1, 1, -1, 1).expand(t.shape))

    monkeypatch.setattr(backward.dispatch, "device_target", lambda device=None: ("sm_90a", "NVIDIA H200"))
    monkeypatch.setattr(backward, "get_kernel", lambda spec, target: spec)
    monkeypatch.setattr(backward, "call_on", call_on)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _H200())
    return calls


def _problem(heads_q, heads_kv, seqlen_k=200, head_dim=128):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 70, heads_q, head_dim, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, heads_kv, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    lse = torch.zeros(2, heads_q, 70)
    return q, k, v, lse


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(8, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_sm90_kernel_writes_kv_heads(host_launch, heads_q, heads_kv, head_dim, deterministic):
    """The sm90 family's kernel gets dk and dv shaped like k (the tensors the call returns: no
    per-query-head tensors, no sum on the host) and the grouped-query workspace of its tile: (slots,
    batch, heads_kv, key blocks, 2 x tile_n x head_dim) float32, a slot per query head of a group
    when deterministic; with one query head per kv head the dQ workspace in its place."""
    q, k, v, lse = _problem(heads_q, heads_kv, head_dim=head_dim)
    spec = default_spec("sm90", "bwd", "bf16", head_dim, causal=True)
    _, dk, dv = backward.gradients(q, q, k, v, q, lse, None, True, 0.1, deterministic, spec=spec)
    ((kernel, args),) = host_launch
    assert kernel == spec and len(args) == 16
    assert args[8] is dk and args[9] is dv and dk.shape == dv.shape == k.shape
    assert torch.equal(dk, torch.arange(1, heads_kv + 1, dtype=dk.dtype).view(1, 1, -1, 1).expand(k.shape))
    dq_accum, dkv_accum = args[10], args[11]
    assert args[14:] == (0.1, int(deterministic))
    if heads_q == heads_kv:
        assert dkv_accum is dq_accum  # untouched by the kernel: nothing allocated
        return
    slots = heads_q // heads_kv if deterministic else 1
    blocks = ceil_div(k.shape[1], spec.tile_n)
    assert dkv_accum.dtype == torch.float32 and dkv_accum.is_contiguous()
    assert dkv_accum.shape == (slots, 2, heads_kv, blocks, 2 * spec.tile_n * head_dim)
    assert dkv_accum.shape == sm90_bwd_dkv_accum_shape(spec, slots, 2, k.shape[1], heads_kv)


@pytest.mark.parametrize(("heads_q", "heads_kv"), [(8, 2), (6, 1), (2, 2)])
def test_sm80_kernel_writes_query_heads_summed_on_the_host(host_launch, heads_q, heads_kv):
    """The sm80 family's kernel (and the sm100 one) still writes dK/dV per query head, the host sums
    each kv head's group in float32."""
    q, k, v, lse = _problem(heads_q, heads_kv)
    spec = default_spec("sm80", "bwd", "bf16", 128, causal=False)
    _, dk, dv = backward.gradients(q, q, k, v, q, lse, None, False, 0.1, False, spec=spec)
    ((_, args),) = host_launch
    assert args[8].shape == (2, 200, heads_q, 128) and (heads_q > heads_kv) == (args[8] is not dk)
    group = heads_q // heads_kv
    want = torch.arange(1, heads_q + 1, dtype=torch.float32).view(heads_kv, group).sum(1)
    for t in (dk, dv):
        assert t.shape == k.shape and torch.equal(t, want.to(t.dtype).view(1, 1, -1, 1).expand(k.shape))


def test_dkv_accum_shape_rounds_up_to_key_blocks():
    """Each sm90 partition's tile: 128 keys (hd64-128), 96 (the swapped hd192), 64 (the head-dim split)."""
    for head_dim, tile_n in ((64, 128), (128, 128), (192, 96), (256, 64)):
        spec = default_spec("sm90", "bwd", "fp16", head_dim)
        assert spec.tile_n == tile_n
        for seqlen_k, blocks in ((1, 1), (tile_n, 1), (tile_n + 1, 2), (5 * tile_n - 1, 5)):
            assert sm90_bwd_dkv_accum_shape(spec, 3, 2, seqlen_k, 4) == (3, 2, 4, blocks, 2 * tile_n * head_dim)


def test_sm90_gqa_emulation_matches_autograd_in_deterministic_slots(on_cpu):
    """Grouped heads through the emulated launch in deterministic mode (a slot per query head, summed
    in order) and not: both close to autograd, and the two within float32 rounding of each other."""
    q, k, v = qkv(1, 70, 300, 8, 2, 64)
    grads = []
    for deterministic in (False, True):
        out = cutefa.flash_attn_func(q, k, v, causal=True, softmax_scale=0.3, deterministic=deterministic)
        out.float().square().sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    reference(q32, k32, v32, True, 0.3)[0].square().sum().backward()
    for got in grads:
        for name, g, want in zip(("dq", "dk", "dv"), got, (q32.grad, k32.grad, v32.grad)):
            assert (g.float() - want).norm() / want.norm() < 2e-2, name
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


# The grouped-query kernels of the sm90 backward in SASS (sm_90a, on this CPU), one variant per
# partition: the defaults at head dims 128 (templates/bwd_sm90.py.j2), 192 (the swapped dK/dV) and
# 256 (the head-dim split).
GQA_SASS = [default_spec("sm90", "bwd", "bf16", hd, causal=hd == 192) for hd in (128, 192, 256)]


@pytest.fixture(scope="module")
def gqa_cubins(tmp_path_factory):
    from cutefa import sass

    return sass.dump_cubins(GQA_SASS, "sm_90a", tmp_path_factory.mktemp("gqa_sm_90a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", GQA_SASS, ids=lambda s: s.name)
def test_sm90_bwd_gqa_sass(gqa_cubins, spec):
    """The main kernel adds a consumer's fp32 dK and dV pieces with 16-byte reductions only
    (REDG.E.ADD.F32x4: 2 x the values per thread / 4, one code path for both consumers), and no
    value spills; dkv_zero writes 16-byte zeros only; dkv_postprocess reads the workspace 16 bytes
    at a time, stages fp32 in shared memory (8-byte stores of column pairs where the fragment holds
    pairs, 4-byte ones in the swapped partition's transposed pieces), reads it back 16 bytes at a
    time and writes dK/dV with 8-byte stores; no local memory anywhere."""
    import re

    from cutefa import sass
    from cutefa.model.budgets_sm90 import sm90_bwd_head_split, sm90_bwd_swapped

    report = sass.analyze(gqa_cubins[spec.name])
    assert report.spills == 0, report.summary()
    text = sass.disassemble(gqa_cubins[spec.name])
    main = sass.kernel_text(text, "kernel")
    piece = 64 * spec.head_dim // 2 if sm90_bwd_head_split(spec) else spec.head_dim * spec.tile_n // 2
    assert len(re.findall(r"\bREDG\.E\.ADD\.F32x4\b", main)) == 2 * piece // 128 // 4
    zero = sass.opcode_forms(sass.kernel_text(text, "dkv_zero"))
    assert {f for f in zero if f.split(".")[0] in ("STG", "LDG", "STL", "LDL")} == {"STG.E.128"}, zero
    post = sass.opcode_forms(sass.kernel_text(text, "dkv_postprocess"))
    memory = {f: n for f, n in post.items() if f.split(".")[0] in ("LDG", "STG", "LDS", "STS", "STL", "LDL")}
    staged = "STS" if sm90_bwd_swapped(spec) else "STS.64"
    assert set(memory) == {"LDG.E.128", staged, "LDS.128", "STG.E.64"}, memory
    assert memory["STG.E.64"] == memory["LDS.128"] == 2 * spec.tile_n * spec.head_dim // 4 // 128, memory
