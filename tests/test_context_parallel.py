"""PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``) on
cutefa's SDPA provider, on the CPU: the installed torch's ring attention calls the flash ops the
provider overrides, with arguments the provider accepts, and reads outputs it produces as
PyTorch's own kernel (its meta function) does; and the real ring, on two gloo processes, gives
the unsharded attention and its gradients.

As in tests/test_torch_sdpa.py, the provider is installed on the CPU dispatch key, an H100 is
pretended and the kernel calls are replaced by a float32 reference, so the dispatcher, DTensor's
sharding rules, the ring's chunking, its log-sum-exp merge and its collectives all run for real.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from cutefa import sdpa_serve
from cutefa import torch_sdpa as ts
from cutefa.api import validate

cp = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._attention")
ring_module = cp  # where _templated_ring_attention and the flash handlers live (torch 2.9 and later)
aten = torch.ops.aten

pytestmark = pytest.mark.skipif(
    not hasattr(torch.nn.attention, "register_flash_attention_impl"),
    reason=f"torch {torch.__version__} has no flash-attention provider registry (torch 2.10 and later)",
)


# ---------------------------------------------------------------------------------------------
# The ring's code path, read from the installed torch


def test_the_ring_calls_the_flash_ops_the_provider_overrides():
    """The flash handlers run ``aten._scaled_dot_product_flash_attention`` and its backward: the
    ops the provider overrides (so CP reaches cutefa with no adapter)."""
    forward = inspect.getsource(cp._scaled_dot_product_ring_flash_attention)
    backward = inspect.getsource(cp._scaled_dot_product_ring_flash_attention_backward)
    assert f"aten.{sdpa_serve._SDPA_FWD}," in forward
    assert f"aten.{sdpa_serve._SDPA_BWD}.default" in backward
    handled = {str(op) for op in cp.custom_ops}
    assert {f"aten.{sdpa_serve._SDPA_FWD}.default", f"aten.{sdpa_serve._SDPA_BWD}.default"} <= handled


def test_the_ring_reads_out_and_lse_and_passes_the_rest_through():
    """What the ring reads of the forward: the first two outputs (out, logsumexp), merged per
    step; the rest of the last step goes back to the caller (and on to the backward)."""
    ring = inspect.getsource(cp._templated_ring_attention)
    assert "out, logsumexp, *rest = op(" in ring
    assert "is_causal=is_causal_behavior.value" in ring
    assert "query.chunk(2, dim=2)[1]" in ring  # the load-balanced steps' chunk views
    assert "key.chunk(ROUND_ROBIN_CYCLE, dim=2)[0]" in ring
    merge = inspect.getsource(cp._SDPAMerger)
    assert "block_lse.unsqueeze(dim=-1)" in merge  # a (batch, heads, seqlen) lse: flash's layout
    back = inspect.getsource(cp._templated_ring_attention_backward)
    assert "out=out_," in back and "logsumexp=lse," in back  # the merged out and lse, chunked


# ---------------------------------------------------------------------------------------------
# The outputs against PyTorch's contract (the ops' meta functions)


@pytest.fixture
def provider(monkeypatch):
    """The provider on the CPU key, an H100 pretended, the kernels replaced by the reference."""
    from test_torch_sdpa import Recorder

    recorder = Recorder()
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(sdpa_serve, "_device_target", lambda device: ("sm_90a", "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(sdpa_serve, "_REASONS", {})
    monkeypatch.setattr(sdpa_serve, "_dense_forward", recorder.dense_forward)
    monkeypatch.setattr(sdpa_serve, "_backward", recorder.backward)
    handle = ts._install(prefer_flash=False, dispatch_key="CPU")
    yield recorder
    handle.remove()


def _local_shard(batch, seqlen, heads, head_dim, gen):
    """A buffer as ``context_parallel`` leaves it: resized in place, so (batch, heads, seqlen,
    head_dim)-contiguous whatever its layout before."""
    return torch.randn(batch, heads, seqlen, head_dim, generator=gen, dtype=torch.bfloat16)


def _same_contract(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b), (i, type(a), type(b))
        if isinstance(a, torch.Tensor):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), (i, a.shape, a.dtype, b.shape, b.dtype)
        else:
            assert a == b, (i, a, b)


# (the ring step, q's slice, k's slice): step 0 on the whole shard; the load-balanced steps on
# the second half of q (i > rank) or the first half of k and v (i <= rank)
STEPS = {"whole": (slice(None), slice(None)), "q_tail": (slice(16, None), slice(None)),
         "kv_head": (slice(None), slice(0, 16))}  # fmt: skip


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("heads_kv", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.1])
def test_forward_and_backward_as_the_ring_calls_them(provider, step, heads_kv, causal, scale):
    gen = torch.Generator().manual_seed(7)
    query, key = _local_shard(1, 32, 4, 64, gen), _local_shard(1, 32, heads_kv, 64, gen)
    value = _local_shard(1, 32, heads_kv, 64, gen)
    rows, keys = STEPS[step]
    q, k, v = query[:, :, rows], key[:, :, keys], value[:, :, keys]
    causal = causal and step == "whole"  # the ring passes is_causal=False off the diagonal
    kwargs = {"is_causal": causal, "dropout_p": 0.0, "scale": scale}
    ours = aten._scaled_dot_product_flash_attention(q, k, v, **kwargs)
    meta = aten._scaled_dot_product_flash_attention(*(t.to("meta") for t in (q, k, v)), **kwargs)
    _same_contract(ours, meta)
    assert provider.calls[-1][:3] == ("dense_forward", causal, scale)
    _, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = ours
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]  # the merger's unsqueeze(-1) fits

    # the backward as the ring calls it: by keyword, with the merged (contiguous) out and lse
    # chunked like q, and the forward's other outputs passed back
    merged_out = torch.randn(query.shape, generator=gen, dtype=torch.bfloat16)[:, :, rows]
    merged_lse = lse.clone().contiguous()
    grad_out = torch.randn(query.shape, generator=gen, dtype=torch.bfloat16)[:, :, rows]
    bwd = {"grad_out": grad_out, "query": q, "key": k, "value": v, "out": merged_out,
           "logsumexp": merged_lse, "cum_seq_q": cum_q, "cum_seq_k": cum_k, "max_q": max_q, "max_k": max_k,
           "dropout_p": 0.0, "is_causal": causal, "philox_seed": seed, "philox_offset": offset,
           "scale": scale}  # fmt: skip
    grads = aten._scaled_dot_product_flash_attention_backward.default(**bwd)
    meta_args = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in bwd.items()}
    _same_contract(grads, aten._scaled_dot_product_flash_attention_backward.default(**meta_args))
    assert provider.calls[-1] == ("backward", causal, (-1, -1), False)
    # the ring adds them into zeros_like(query/key/value): shapes are what matters, and they match


# ---------------------------------------------------------------------------------------------
# The real ring on two gloo processes


def _rank_main(rank: int, world: int, store_file: str, cases: list[tuple[bool, bool, int]]) -> None:
    """One rank: context_parallel over a 1-D CPU mesh, the flash op called on DTensors (what SDPA's
    flash backend calls), forward and backward, against the unsharded reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    # a file store, not a TCP one: no port to race for, and no rank hosts a server the other still
    # needs while it tears down (a rank left alone at exit aborted in gloo's threads)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from test_torch_sdpa import Recorder, reference, reference_backward

    recorder = Recorder()
    validate.DEVICE_TYPES = ("cuda", "cpu")
    sdpa_serve._device_target = lambda device: ("sm_90a", "NVIDIA H100 80GB HBM3")
    sdpa_serve._dense_forward, sdpa_serve._backward = recorder.dense_forward, recorder.backward
    handle = ts._install(prefer_flash=False, dispatch_key="CPU")
    mesh = init_device_mesh("cpu", (world,))
    options = cp._cp_options
    try:
        for causal, balance, heads_kv in cases:
            recorder.calls.clear()
            options.enable_load_balance = balance
            gen = torch.Generator().manual_seed(11)
            b, s, hq, d = 2, 64, 4, 64
            q, k, v, g = (torch.randn(b, s, h, d, generator=gen, dtype=torch.bfloat16).transpose(1, 2)
                          for h in (hq, heads_kv, heads_kv, hq))  # fmt: skip
            want_out, want_lse = reference(*(t.transpose(1, 2) for t in (q, k, v)), causal, None)
            want = reference_backward(g.transpose(1, 2), *(t.transpose(1, 2) for t in (q, k, v)),
                                      want_out, want_lse, causal, None)  # fmt: skip
            buffers = [t.clone() for t in (q, k, v, g)]
            with cp.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
                balanced = options.enable_load_balance
                ql, kl, vl, gl = (t.detach().clone().requires_grad_() for t in buffers)
                with torch.enable_grad():
                    dq, dk, dv = (
                        DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (ql, kl, vl)
                    )
                    outs = aten._scaled_dot_product_flash_attention(dq, dk, dv, is_causal=causal)
                    outs[0].to_local().backward(gl)
                got = cp.context_parallel_unshard(mesh, [outs[0].to_local().detach(), ql.grad, kl.grad, vl.grad],
                                               [2, 2, 2, 2])  # fmt: skip
            assert balanced == (balance and causal), (balance, causal, balanced)
            # per step: causal on the diagonal, not off it; without load balance, rank 0 skips
            # the keys of rank 1 (all in its future)
            steps = [True, False] if causal else [False, False]
            if causal and not balance and rank == 0:
                steps = [True]
            assert [c[:2] for c in recorder.calls] == [("dense_forward", c) for c in steps] + [
                ("backward", c) for c in steps
            ], recorder.calls
            want_bhsd = [want_out.transpose(1, 2), *(t.transpose(1, 2) for t in want)]
            for name, a, w in zip(("out", "dq", "dk", "dv"), got, want_bhsd):
                err = (a.float() - w.float()).norm() / w.float().norm()
                assert err < 2e-2, (name, causal, balance, heads_kv, float(err))
        dist.barrier()  # both ranks are done with the group before either tears it down
    finally:
        handle.remove()
        dist.destroy_process_group()


def test_context_parallel_on_two_gloo_ranks_matches_the_unsharded_attention(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    import torch.multiprocessing as mp

    # (causal, load balance, heads_kv): the load-balanced causal ring (head-tail chunks), the plain
    # causal ring (the SKIP step), the non-causal ring (load balance must be off), and GQA
    cases = [(True, True, 4), (True, True, 2), (True, False, 2), (False, False, 2)]
    saved = cp._cp_options.enable_load_balance
    try:
        mp.spawn(_rank_main, args=(2, str(tmp_path / "store"), cases), nprocs=2, join=True)
    finally:
        cp._cp_options.enable_load_balance = saved
