"""The public op on the CPU: validation errors, edge cases, the fake impl under torch.compile, autograd.

Checks that need CUDA tensors run either on fake CUDA tensors (``FakeTensorMode`` makes them on a
CPU-only torch) or with :data:`cutefa.api.validate.DEVICE_TYPES` widened to the CPU and the kernel launch
replaced by a reference computed with torch.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys

import pytest
import torch
from cpu_support import reference, trace_attention_block
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import cutefa
from cutefa import dispatch
from cutefa.api import dense, launch, plans, validate
from cutefa.model.defaults import DEFAULT_TILES
from cutefa.model.spec import VariantSpec

CPU = ("cpu",)


def qkv(batch=2, sq=8, sk=8, hq=4, hkv=2, d=64, dtype=torch.bfloat16, device="cpu"):
    q = torch.randn(batch, sq, hq, d, dtype=dtype, device=device)
    k = torch.randn(batch, sk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(batch, sk, hkv, d, dtype=dtype, device=device)
    return q, k, v


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the op accept CPU tensors and replace the kernel launch by the reference; records calls."""
    calls = []

    def launch(q, k, v, out, lse, causal, softmax_scale):
        calls.append((tuple(q.shape), tuple(k.shape), causal, softmax_scale))
        o, l = reference(q, k, v, causal, softmax_scale)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dense, "_launch", launch)
    return calls


# ---------------------------------------------------------------------------------------------
# Validation errors


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor; got list"):
        cutefa.flash_attn_func(q, k.tolist(), v)


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v must be 4-D \(batch, seqlen, heads, head_dim\); got 3-D shape"):
        cutefa.flash_attn_func(q, k, v[0])


def test_dtype_not_half():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(
        TypeError, match="q has dtype torch.float32; cutefa accepts torch.float16 or torch.bfloat16"
    ):
        cutefa.flash_attn_func(q, k, v)


def test_fp8_e5m2_is_not_implemented():
    q, k, v = (t.to(torch.float8_e5m2) for t in qkv())
    with pytest.raises(NotImplementedError, match="cutefa's fp8 forward takes torch.float8_e4m3fn only"):
        cutefa.flash_attn_func(q, k, v)


def test_fp8_on_the_16_bit_path_names_the_fp8_forward():
    q, k, v = (t.to(torch.float8_e4m3fn) for t in qkv())
    with pytest.raises(NotImplementedError, match="fp8 inputs go through the fp8 forward"):
        validate.validate_inputs(q, k, v, device_types=CPU)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="one dtype; got q torch.bfloat16, k torch.float16, v torch.bfloat16"):
        cutefa.flash_attn_func(q, k.half(), v)


def test_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="cutefa runs on CUDA tensors; got q on cpu"):
        cutefa.flash_attn_func(*qkv())


def test_tensors_on_different_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device; got q on cpu, k on meta, v on cpu"):
        validate.validate_inputs(q, k.to("meta"), v, device_types=("cpu", "meta"))


SHAPE_ERRORS = {
    "batch": ((2, 8, 4, 64), (3, 8, 2, 64), (3, 8, 2, 64), "batch sizes differ: q has 2, k has 3, v has 3"),
    "head_dim": ((2, 8, 4, 64), (2, 8, 2, 128), (2, 8, 2, 128), "head_dim differs: q has 64, k has 128"),
    "k_vs_v": (
        (2, 8, 4, 64),
        (2, 8, 2, 64),
        (2, 9, 2, 64),
        r"k and v must have the same shape \(but for v's head dim\); got k \(2, 8, 2, 64\)",
    ),
    "heads": (
        (2, 8, 6, 64),
        (2, 8, 4, 64),
        (2, 8, 4, 64),
        r"q's heads \(6\) must be a multiple of k/v's heads \(4\)",
    ),
    "no_kv_heads": ((2, 8, 4, 64), (2, 8, 0, 64), (2, 8, 0, 64), r"q's heads \(4\) must be a multiple"),
    "head_dim_unsupported": (
        (1, 8, 2, 84),
        (1, 8, 2, 84),
        (1, 8, 2, 84),
        r"head_dim=84 is not supported \(q.shape\[-1\]\): cutefa takes a multiple of 8 from 8 to 256",
    ),
}


@pytest.mark.parametrize("shapes", SHAPE_ERRORS.values(), ids=SHAPE_ERRORS.keys())
def test_shape_errors(shapes):
    *sizes, message = shapes
    q, k, v = (torch.empty(s, dtype=torch.float16) for s in sizes)
    with pytest.raises(ValueError, match=message):
        validate.validate_inputs(q, k, v, device_types=CPU)


def test_shape_errors_reach_users_on_cuda_tensors():
    with FakeTensorMode():
        q, k, v = qkv(hq=6, hkv=4, device="cuda")
        with pytest.raises(ValueError, match=r"q's heads \(6\) must be a multiple of k/v's heads \(4\)"):
            cutefa.flash_attn_func(q, k, v)


def test_last_dim_must_be_contiguous():
    _, k, v = qkv()
    strided = torch.randn(2, 8, 4, 128, dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(ValueError, match=r"q.stride\(-1\) must be 1 \(contiguous head_dim\); got 2"):
        validate.validate_inputs(strided, k, v, device_types=CPU)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_softmax_scale_must_be_positive_finite(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite float or None"):
        cutefa.flash_attn_func(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, torch.tensor(0.1)])
def test_softmax_scale_must_be_a_number(scale):
    with pytest.raises(TypeError, match="softmax_scale must be a positive finite float or None"):
        cutefa.flash_attn_func(*qkv(), softmax_scale=scale)


def test_causal_must_be_bool():
    with pytest.raises(TypeError, match="causal must be a bool; got 1"):
        cutefa.flash_attn_func(*qkv(), causal=1)


def test_unsupported_arch_is_reported_from_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "device_target", lambda device: ("sm_75", "Tesla T4"))
    dispatch.clear_caches()
    with pytest.raises(NotImplementedError, match=r"no cutefa kernel for Tesla T4 \(sm_75\): .*8\.0\+"):
        dense._launch(*qkv(), torch.empty(0), torch.empty(0), False, 0.1)


# ---------------------------------------------------------------------------------------------
# Behaviour of the op (CPU stand-in for the kernel)


def test_results_shapes_and_default_scale(on_cpu):
    q, k, v = qkv(sq=5, sk=9, hq=4, hkv=2)
    out, lse = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    assert on_cpu == [((2, 5, 4, 64), (2, 9, 2, 64), True, 1 / 8)]
    expect, expect_lse = reference(q, k, v, True, 1 / 8)
    torch.testing.assert_close(out.float(), expect, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, expect_lse)
    assert isinstance(cutefa.flash_attn_func(q, k, v, softmax_scale=0.5), torch.Tensor)
    assert on_cpu[-1][-1] == 0.5


@pytest.mark.parametrize(
    "shape", [(0, 8, 4, 64), (2, 0, 4, 64), (2, 8, 0, 64)], ids=["batch0", "seqlen_q0", "heads0"]
)
def test_empty_problems_return_empty_results_without_a_launch(on_cpu, shape):
    q = torch.randn(shape, dtype=torch.float16)
    k = v = torch.randn(shape[0], 8, 2 if shape[2] else 1, 64, dtype=torch.float16)
    out, lse = cutefa.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == shape and lse.shape == (shape[0], shape[2], shape[1])
    assert on_cpu == []


def test_no_keys_gives_zero_output_and_minus_inf_lse(on_cpu):
    q, k, v = qkv(sq=3, sk=0)
    out, lse = cutefa.flash_attn_func(q, k, v, return_lse=True)
    assert (out == 0).all() and out.shape == q.shape
    assert torch.isneginf(lse).all() and lse.shape == (2, 4, 3)
    assert on_cpu == []


def test_misaligned_inputs_are_copied_aligned_ones_are_not():
    aligned = torch.randn(2, 8, 4, 64, dtype=torch.float16)
    assert launch.aligned(aligned) is aligned
    view = aligned.transpose(1, 2)  # strides (2048, 64, 256, 1): all multiples of 8
    assert launch.aligned(view) is view
    odd_rows = torch.randn(2, 8, 4, 68, dtype=torch.float16)[..., :64]  # row stride 68 elements
    copy = launch.aligned(odd_rows)
    assert copy.is_contiguous() and torch.equal(copy, odd_rows)
    shifted = torch.randn(1 + 2 * 8 * 4 * 64, dtype=torch.float16)[1:].view(2, 8, 4, 64)  # 2-byte offset
    assert shifted.data_ptr() % 16 != 0
    copy = launch.aligned(shifted)
    assert copy.data_ptr() % 16 == 0 and torch.equal(copy, shifted)


def test_launch_dispatches_runs_the_kernel_and_logs(monkeypatch, caplog):
    q, k, v = qkv(d=128)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 8)
    ran = []
    monkeypatch.setattr(dispatch, "device_target", lambda device: ("sm_90a", "NVIDIA H200"))
    monkeypatch.setattr(
        dense, "get_kernel", lambda spec, target: lambda *args: ran.append((spec, target, args))
    )
    guards = []
    monkeypatch.setattr(
        torch.cuda, "device", lambda device: guards.append(device) or contextlib.nullcontext()
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # q.device.index of a CPU tensor
    dispatch.clear_caches()
    try:
        dispatch.set_logging(True)
        with caplog.at_level("INFO", logger="cutefa"):
            dense._launch(q, k, v, out, lse, True, 0.25)
            assert guards == []  # q is on the current device: no device switch
            monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
            dense._launch(q, k, v, out, lse, True, 0.25)
            assert guards == [q.device]  # another device is current: switch to q's for the launch
    finally:
        dispatch.set_logging(False)
    assert len(ran) == 2
    spec, target, args = ran[0]
    expected = dispatch.choose(
        target="sm_90a", dtype="bf16", head_dim=128, causal=True, seqlen_q=8, seqlen_k=8, batch=2,
        heads_q=4, heads_kv=2, gpu_name="NVIDIA H200",
    )  # fmt: skip
    assert spec == expected.spec and (spec.arch, spec.dtype, spec.head_dim, spec.causal) == ("sm90", "bf16", 128, True)
    assert target == "sm_90a"
    assert args[0] is q and args[3] is out and args[4] is lse and args[5] == 0.25
    assert (
        f"cutefa: ran {spec.name} on sm_90a for q=(2, 8, 4, 128) k=(2, 8, 2, 128) causal=True" in caplog.text
    )


# ---------------------------------------------------------------------------------------------
# torch.compile, the fake impl and autograd


def test_fake_impl_shapes_on_fake_cuda_tensors():
    with FakeTensorMode():
        q, k, v = qkv(sq=5, sk=7, hq=8, hkv=2, d=128, dtype=torch.float16, device="cuda")
        out, lse = torch.ops.cutefa.flash_fwd(q, k, v, True, 0.1)
    assert (out.shape, out.dtype, out.device.type) == ((2, 5, 8, 128), torch.float16, "cuda")
    assert (lse.shape, lse.dtype, lse.device.type) == ((2, 8, 5), torch.float32, "cuda")


def test_torch_compile_fullgraph_traces_through_the_fake_impl():
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        (out, lse), ops_called = trace_attention_block(q, k, v)
    assert out.shape == q.shape and out.device.type == "cuda" and lse.shape == (2, 4, 8)
    assert torch.ops.cutefa.flash_fwd.default in ops_called


def test_torch_compile_runs_end_to_end_on_the_op(on_cpu):
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: cutefa.flash_attn_func(q, k, v, causal=True) + 1, fullgraph=True, backend="eager"
    )
    q, k, v = qkv()
    torch.testing.assert_close(compiled(q, k, v), cutefa.flash_attn_func(q, k, v, causal=True) + 1)
    assert len(on_cpu) == 2


def test_opcheck(on_cpu):
    q, k, v = qkv()
    torch.library.opcheck(torch.ops.cutefa.flash_fwd.default, (q, k, v, True, 0.125))


def test_eager_fast_path_only_where_it_equals_the_op():
    q, k, v = qkv()
    assert plans.plain_eager(q, k, v)
    assert not plans.plain_eager(q, k.requires_grad_(), v)  # autograd must see the op
    with torch.no_grad():
        assert plans.plain_eager(q, k, v)
    with FakeTensorMode() as mode:
        assert not plans.plain_eager(*(mode.from_tensor(t) for t in (q, k, v)))
    k = k.detach()
    with TorchDispatchMode():
        assert not plans.plain_eager(q, k, v)


# ---------------------------------------------------------------------------------------------
# Public surface


def test_explain_for_a_target_on_cpu_tensors():
    dispatch.clear_caches()
    text = cutefa.explain(*qkv(d=128), causal=True, target="sm_80")
    name = VariantSpec("sm80", "fwd", "bf16", 128, *DEFAULT_TILES["sm80"][128], causal=True).name
    assert text.splitlines()[1] == f"chosen: {name} (family sm80, compiled for sm_80)"
    with pytest.raises(ValueError, match="cutefa runs on CUDA tensors; got q on cpu"):
        cutefa.explain(*qkv())


def test_import_cutefa_does_not_import_the_dsl():
    code = (
        "import sys, cutefa\n"
        "assert 'cutlass' not in sys.modules and 'torch' not in sys.modules, 'import cutefa is light'\n"
        "cutefa.flash_attn_func, cutefa.explain, cutefa.fp8_block_sizes, cutefa.center_v\n"
        "cutefa.flash_attn_varlen_func, cutefa.unpad_input, cutefa.pad_input, cutefa.flash_attn_with_kvcache\n"
        "cutefa.PagedKVCache\n"
        "assert 'cutlass' not in sys.modules, 'the API itself does not import the DSL'\n"
        "print(sorted(cutefa.__all__), cutefa.__version__)\n"
    )
    env = {k: val for k, val in os.environ.items() if k != "CUTE_DSL_ARCH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "['BlockMask', 'PagedKVCache', '__version__', 'center_v', 'create_block_mask', 'explain', "
        "'flash_attn_func', 'flash_attn_varlen_func', "
        "'flash_attn_with_kvcache', 'fp8_block_sizes', 'pad_input', 'quantize_fp8', 'unpad_input'] "
    )
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        cutefa.nope  # noqa: B018
