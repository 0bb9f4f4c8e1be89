"""Kernels from a pack on the GPU: bitwise the JIT-compiled kernels' results, in a fresh process
that never imports the DSL compiler, on the caller's current stream.

A module-scoped pack holds the variants the dispatcher picks for the problems below on this GPU
(built through the cache, so kernels compiled earlier are reused). The JIT reference is the DSL's
own compiled object (``cute.compile``), run in this process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa
from cutefa import compile as cc
from cutefa import dispatch, loader, pack, pack_build
from cutefa.api import launch, plans

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal)
PROBLEMS = {
    "bf16-hd128-causal-tiny": (1, 128, 128, 16, 16, 128, torch.bfloat16, True),
    "fp16-hd64-gqa": (2, 1000, 777, 8, 2, 64, torch.float16, False),
}


def _inputs(problem, seed=0):
    batch, sq, sk, hq, hkv, d, dtype, _ = problem
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d))
    return tuple(torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes)


def _choice(problem):
    q, k, _ = _inputs(problem)
    return launch.choose(q, k, problem[-1])


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(pack directory, {problem id: variant spec}) for this GPU's target."""
    target = dispatch.current_target()
    chosen = {name: _choice(problem).spec for name, problem in PROBLEMS.items()}
    out = tmp_path_factory.mktemp("pack")
    specs = sorted(set(chosen.values()))
    results = pack_build.build_pack(specs, target=target, pack_dir=out, jobs=len(specs), progress=False)
    failed = {r.spec.name: r.error for r in results if not r.ok}
    assert not failed, f"building the pack failed: {failed}"
    return out, chosen


def _run(fn, q, k, v, scale):
    batch, sq, hq, _ = q.shape
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, hq, sq), math.nan, device=q.device)
    fn(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    return out, lse


_JIT: dict = {}


def _jit(spec):
    """The DSL's compiled object for ``spec`` on this GPU, compiled in this process (once)."""
    target = dispatch.current_target()
    if not cc.can_compile_here(target):
        pytest.skip(f"this process's DSL compiles for {cc.dsl_target()}, not {target}")
    if spec not in _JIT:
        compiled = cc.compile_object(spec, target)
        _JIT[spec] = loader._with_sm_count(compiled) if cc.takes_sm_count(spec) else compiled
    return _JIT[spec]


def _same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bitwise, NaN and -inf included


@pytest.mark.parametrize("name", PROBLEMS)
def test_pack_kernel_is_bitwise_the_jit_kernel(packed, name, monkeypatch):
    out_dir, chosen = packed
    spec, problem = chosen[name], PROBLEMS[name]
    target = dispatch.current_target()
    monkeypatch.setenv("CUTEFA_KERNEL_PATH", str(out_dir))
    found, refusals = pack.find_kernel(spec.name, target, cc.fingerprint(spec, target))
    assert found is not None and found.pack == out_dir, f"the pack was refused: {refusals}"
    from_pack = loader.load_library(found.path, found.function_name, found.runtime)
    if cc.takes_sm_count(spec):  # its entry also takes the number of CTAs (get_kernel adds it)
        from_pack = loader._with_sm_count(from_pack)
    q, k, v = _inputs(problem)
    scale = 1.0 / math.sqrt(q.shape[-1])
    packed_out, packed_lse = _run(from_pack, q, k, v, scale)
    jit_out, jit_lse = _run(_jit(spec), q, k, v, scale)
    assert _same(packed_out, jit_out), (
        f"{spec.name}: output of the pack's kernel differs from the JIT kernel's"
    )
    assert _same(packed_lse, jit_lse), f"{spec.name}: lse of the pack's kernel differs from the JIT kernel's"
    assert not packed_out.isnan().any(), "the kernel left outputs unwritten"


CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
q, k, v = torch.load(sys.argv[1])
causal = sys.argv[2] == "1"
torch.cuda.synchronize()
ready = time.perf_counter()
import cutefa
import cutefa.loader as loader
out = cutefa.flash_attn_func(q, k, v, causal=causal)
torch.cuda.synchronize()
first = time.perf_counter()
again = cutefa.flash_attn_func(q, k, v, causal=causal)
torch.save((out, again), sys.argv[3])
print(json.dumps({
    "first_ms": (first - ready) * 1e3,
    "dsl": sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "iket")),
    "origins": sorted(loader.loaded_kernels().values()),
}))
"""


@pytest.mark.parametrize("name", PROBLEMS)
def test_attention_from_a_pack_in_a_fresh_process(packed, name, tmp_path):
    """CUTEFA_JIT=0 and an empty cache: the pack must serve, the DSL compiler stays unimported, and
    the result equals the JIT kernel's bit for bit."""
    out_dir, chosen = packed
    spec, problem = chosen[name], PROBLEMS[name]
    q, k, v = _inputs(problem)
    torch.save((q, k, v), tmp_path / "inputs.pt")
    env = {key: val for key, val in os.environ.items() if key != "CUTE_DSL_ARCH"}
    env |= {
        "CUTEFA_KERNEL_PATH": str(out_dir),
        "CUTEFA_JIT": "0",
        "CUTEFA_CACHE_DIR": str(tmp_path / "cache"),
    }
    argv = [str(tmp_path / "inputs.pt"), "1" if problem[-1] else "0", str(tmp_path / "out.pt")]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), *argv],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["dsl"] == [], f"running from a pack imported the DSL: {report['dsl']}"
    assert report["origins"] == [f"pack {out_dir}"]
    out, again = torch.load(tmp_path / "out.pt")
    jit_out, _ = _run(_jit(spec), q, k, v, 1.0 / math.sqrt(q.shape[-1]))
    assert _same(out, jit_out) and _same(again, jit_out), f"{spec.name}: pack result differs from JIT result"


def test_call_plan_runs_the_pack_kernel_on_the_current_stream(packed, monkeypatch):
    out_dir, chosen = packed
    name = "bf16-hd128-causal-tiny"
    spec, problem = chosen[name], PROBLEMS[name]
    monkeypatch.setenv("CUTEFA_KERNEL_PATH", str(out_dir))
    monkeypatch.setattr(loader, "_KERNELS", {})
    monkeypatch.setattr(loader, "_ORIGINS", {})
    monkeypatch.setattr(plans, "_PLANS", {})
    q, k, v = _inputs(problem)
    jit_out, _ = _run(_jit(spec), q, k, v, 1.0 / math.sqrt(q.shape[-1]))
    first = cutefa.flash_attn_func(q, k, v, causal=True)  # validating way, makes the plan
    second = cutefa.flash_attn_func(q, k, v, causal=True)  # the plan
    assert (
        len(plans._PLANS) == 1
        and loader.loaded_kernels()[(spec.name, dispatch.current_target())] == f"pack {out_dir}"
    )
    assert _same(first, jit_out) and _same(second, jit_out)

    # On a side stream, behind a long kernel that produces q: a kernel launched on any other
    # stream would read q before it is written.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        late_q = q * 1
        late = cutefa.flash_attn_func(late_q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert _same(late, jit_out), "the kernel did not run on the current stream"

    # Inputs the kernel refuses (a misaligned view) go the validating way and are copied.
    odd = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape).copy_(q)
    assert odd.data_ptr() % 16
    assert _same(cutefa.flash_attn_func(odd, k, v, causal=True), jit_out)

    # A view of the same shape with other strides: the bound launcher is not for it (the full call
    # passes its strides); the result is the same.
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_strided.is_contiguous()
    assert _same(cutefa.flash_attn_func(q_strided, k, v, causal=True), jit_out)


def test_call_plan_uses_the_bound_launcher_and_is_thread_safe(packed, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from cutefa import ffi

    out_dir, _ = packed
    problem = PROBLEMS["bf16-hd128-causal-tiny"]
    monkeypatch.setenv("CUTEFA_KERNEL_PATH", str(out_dir))
    monkeypatch.setattr(loader, "_KERNELS", {})
    monkeypatch.setattr(plans, "_PLANS", {})
    inputs = [_inputs(problem, seed=i) for i in range(4)]
    bound_calls = []
    real_bind = ffi.Function.bind

    def counting_bind(self, args, slots):
        launcher = real_bind(self, args, slots)
        return lambda *t: bound_calls.append(1) or launcher(*t)

    monkeypatch.setattr(ffi.Function, "bind", counting_bind)
    expected = [
        cutefa.flash_attn_func(q, k, v, causal=True).clone() for q, k, v in inputs
    ]  # 1st: makes the plan
    assert bound_calls == [1, 1, 1]  # calls 2-4 took the plan's bound launcher
    assert _same(cutefa.flash_attn_func(*inputs[1], causal=True), expected[1]) and len(bound_calls) == 4

    def worker(i):
        q, k, v = inputs[i]
        return all(_same(cutefa.flash_attn_func(q, k, v, causal=True), expected[i]) for _ in range(50))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, range(4)))
    torch.cuda.synchronize()
