"""Host cost of a training call (forward + backward, inputs that require gradients), two ways.

``tools/bench.py --enqueue --train`` (GPU): host microseconds per fwd+bwd of a tiny grouped-query
problem, backends side by side in turns: cutefa (its eager training path), cutefa through its
custom op (``cutefa.api.dense.FAST_TRAINING`` off: the path torch.compile traces), cutefa through
SDPA (:mod:`cutefa.torch_sdpa` active), FA4, FA2 and cuDNN (SDPA). Each backend's gradients are
first checked against a float32 reference.

``python tools/bench_train_host.py --cpu`` (no GPU): the same Python path on CPU tensors with the
kernels replaced by a no-op stand-in and an H100 pretended, per call and per component (the
numbers of docs/log/perf-notes.md's training-path entry). It measures cutefa's own host work
only: no kernel launch, no CUDA allocation, no stream query.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import types
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

TRAIN_SHAPE = {"batch": 1, "seqlen": 128, "heads_q": 8, "heads_kv": 2, "hdim": 128, "causal": True}
BACKENDS = ("cutefa", "cutefa (custom op)", "cutefa via SDPA", "FA4", "FA2", "cuDNN")


def _inputs(device: str, dtype, sh: dict = TRAIN_SHAPE, heads_kv: int | None = None):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    hkv = sh["heads_kv"] if heads_kv is None else heads_kv
    mk = lambda h: torch.randn(
        sh["batch"], sh["seqlen"], h, sh["hdim"], device=device, dtype=dtype, generator=g
    )
    q, k, v = mk(sh["heads_q"]), mk(hkv), mk(hkv)
    return tuple(t.requires_grad_() for t in (q, k, v))


@contextlib.contextmanager
def fast_training(on: bool):
    """cutefa's eager training path on or off (:data:`cutefa.api.dense.FAST_TRAINING`) in the block."""
    from cutefa.api import dense

    saved = dense.FAST_TRAINING
    dense.FAST_TRAINING = on
    try:
        yield
    finally:
        dense.FAST_TRAINING = saved


@contextlib.contextmanager
def sdpa_provider():
    """cutefa serving SDPA's flash backend in the block."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cutefa.torch_sdpa as provider

    provider.activate()
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    finally:
        provider.deactivate()


def step_maker(name: str):
    """(make(q, k, v, dout) -> a callable running fwd + bwd once and returning (dq, dk, dv), the
    context to run it in), or a string saying why ``name`` cannot run. q, k, v: (batch, seqlen,
    heads, head_dim) leaves; the SDPA backends get k and v with their heads repeated (MHA)."""
    import torch

    causal = TRAIN_SHAPE["causal"]
    grad = torch.autograd.grad
    if name.startswith("cutefa") and name != "cutefa via SDPA":
        import cutefa

        def make(q, k, v, dout):
            return lambda: grad(cutefa.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)

        return make, (lambda: fast_training(name == "cutefa"))
    if name == "FA4":
        try:
            from flash_attn.cute import flash_attn_func as fa4
        except Exception:  # noqa: BLE001 - absent or broken: no column
            return "FA4 not installed"

        def make(q, k, v, dout):
            def step():
                out = fa4(q, k, v, causal=causal)
                return grad(out[0] if isinstance(out, tuple) else out, (q, k, v), dout)

            return step

        return make, contextlib.nullcontext
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(q, k, v, dout):
        group = q.shape[2] // k.shape[2]
        k2, v2 = (t.detach().repeat_interleave(group, 2).requires_grad_() for t in (k, v))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k2, v2))
        dt = dout.transpose(1, 2)

        def step():
            dq, dk, dv = grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), (q, k2, v2), dt)
            shape = (*dk.shape[:2], k.shape[2], group, dk.shape[-1])
            return dq, dk.view(shape).sum(3), dv.view(shape).sum(3)

        return step

    if name == "cutefa via SDPA":
        return make, sdpa_provider
    kinds = {"FA2": SDPBackend.FLASH_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION}
    return make, (lambda: sdpa_kernel(kinds[name]))


def run_train_enqueue(args: argparse.Namespace) -> int:
    """Host (and total) microseconds per fwd+bwd call on the GPU, backends in turns after a check of
    their gradients; writes ``enqueue_train.md``/``.json`` under ``args.out``."""
    import torch
    from bench_backends import environment
    from bench_check import expectation
    from bench_run import Entry, host_timer, run_entries

    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[args.dtype[0]])
    q, k, v = _inputs("cuda", dtype)
    dout = torch.randn_like(q)
    # dQ, dK, dV against float32 on a sample of slices, the bar from the 16-bit reference's own error
    expect = expectation(q, k, v, causal=TRAIN_SHAPE["causal"], scale=q.shape[-1] ** -0.5, dout=dout)
    judge = expect.judge
    iters = max(1, args.enqueue_iters // 4)
    totals: dict[int, list[float]] = {}
    names: dict[str, int] = {}

    host_us = host_timer(iters, 20, totals)

    entries = []
    for name in BACKENDS:
        made = step_maker(name)
        if isinstance(made, str):
            entries.append(Entry(name, None, judge, missing=made))
            continue
        make, context = made

        def build(make=make, name=name):
            fn = make(q, k, v, dout)
            names[name] = id(fn)
            return fn

        entries.append(Entry(name, build, judge, context))
    found = run_entries(entries, host_us, rounds=args.rounds)
    sh = TRAIN_SHAPE
    lines = [
        "# Host cost per training call (forward + backward)",
        "",
        (
            f"b={sh['batch']} s={sh['seqlen']} hq={sh['heads_q']} hkv={sh['heads_kv']} d={sh['hdim']} causal, "
            f"{args.dtype[0]}, inputs requiring gradients, torch.autograd.grad of the output; median of "
            f"{args.rounds} rounds (in turns) of the median of 5 loops of {iters} calls. host = loop time / "
            "calls, total = with the final synchronize. The SDPA backends get k and v with repeated heads "
            "(their dK/dV summed per KV head inside the timed call). 'cutefa (custom op)': the custom op and "
            "its torch.library autograd (the path torch.compile traces); 'cutefa': the eager training path."
        ),
        "",
        "| backend | host us/call | total us/call | grad check |",
        "|---|---|---|---|",
    ]
    results = {}
    for name, res in found.items():
        if res.status == "ok":
            total = statistics.median(totals[names[name]])
            results[name] = {"host_us": res.ms, "total_us": total, "checks": res.checks}
            lines.append(f"| {name} | {res.ms:.1f} | {total:.1f} | ok |")
        else:
            results[name] = {"status": res.status, "error": res.error}
            lines.append(f"| {name} | | | {res.status}: {res.error or ''} |")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "enqueue_train.md").write_text(text + "\n")
    blob = {"meta": environment() | {"shape": sh, "dtype": args.dtype[0]}, "results": results}
    (args.out / "enqueue_train.json").write_text(json.dumps(blob, indent=1) + "\n")
    return 1 if any(found[n].status == "FAIL" for n in ("cutefa", "cutefa (custom op)")) else 0


# ---------------------------------------------------------------------------------------------
# CPU: cutefa's Python path with no-op kernels


@contextlib.contextmanager
def stub_kernels():
    """cutefa on CPU tensors as on an H100, every kernel a no-op: yields the list of kernel calls."""
    import torch

    from cutefa import dispatch
    from cutefa.api import backward, dense, plans, validate

    calls: list[int] = []

    def kernel(*args):
        calls.append(len(args))

    props = types.SimpleNamespace(
        multi_processor_count=132, regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472
    )
    patches = [
        (validate, "DEVICE_TYPES", ("cuda", "cpu")),
        (dispatch, "device_target", lambda device=None: ("sm_90a", "NVIDIA H100 80GB HBM3")),
        (torch.cuda, "current_device", lambda: None),
        (torch.cuda, "get_device_properties", lambda device=None: props),
        (dense, "get_kernel", lambda spec, target: kernel),
        (backward, "get_kernel", lambda spec, target: kernel),
    ]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    for m, n, value in patches:
        setattr(m, n, value)
    dispatch.clear_caches()
    try:
        yield calls
    finally:
        for m, n, value in saved:
            setattr(m, n, value)
        dispatch.clear_caches()
        plans.clear_plans()


def per_call_us(fn, n: int = 300, repeats: int = 7) -> float:
    """The smallest of ``repeats`` means over ``n`` calls, in microseconds (the least disturbed)."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def cpu_components(shape: dict = TRAIN_SHAPE) -> dict[str, float]:
    """Microseconds per call of cutefa's training path and its pieces on this CPU (no-op kernels)."""
    import torch

    import cutefa
    from cutefa import dispatch
    from cutefa.api import backward, dense, launch, validate

    with stub_kernels():
        q, k, v = _inputs("cpu", torch.bfloat16, shape)
        dout = torch.randn_like(q)
        causal, scale = shape["causal"], shape["hdim"] ** -0.5
        grad = torch.autograd.grad
        out, lse = dense.flash_fwd(q, k, v, causal, scale)
        qd, kd, vd, od, ld = (t.detach() for t in (q, k, v, out, lse))
        found: dict[str, float] = {}
        for label, on in (("fwd+bwd, custom op path", False), ("fwd+bwd, eager training path", True)):
            with fast_training(on):
                found[label] = per_call_us(
                    lambda: grad(cutefa.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
                )
                found[label.replace("fwd+bwd", "fwd")] = per_call_us(
                    lambda: cutefa.flash_attn_func(q, k, v, causal=causal)
                )
        with torch.no_grad():
            found["fwd, inference plan (no grad)"] = per_call_us(
                lambda: cutefa.flash_attn_func(qd, kd, vd, causal=causal)
            )
        found["autograd engine + a no-op Function (floor)"] = per_call_us(
            lambda: grad(_Identity.apply(q, k, v), (q, k, v), dout)
        )
        found["custom op flash_bwd (no grad; planned after its first call)"] = per_call_us(
            lambda: backward.flash_bwd(dout, qd, kd, vd, od, ld, None, causal, scale, False)
        )
        found["backward.gradients (validating: no plan, no op dispatch)"] = per_call_us(
            lambda: backward.gradients(dout, qd, kd, vd, od, ld, None, causal, scale, False)
        )
        found["planned_gradients (backward plan)"] = per_call_us(
            lambda: backward.planned_gradients(dout, qd, kd, vd, od, ld, None, causal, scale, False)
        )
        found["choose_bwd (backward variant choice)"] = per_call_us(
            lambda: backward.choose_bwd(
                "sm_90a",
                qd.dtype,
                qd.shape[-1],
                causal,
                seqlen_k=kd.shape[1],
                gpu_name="NVIDIA H100 80GB HBM3",
            )
        )
        found["bwd_setup (choice, kernel, workspace shapes)"] = per_call_us(
            lambda: backward.bwd_setup(qd, kd, vd, causal, False)
        )
        found["validate_inputs (forward)"] = per_call_us(
            lambda: validate.validate_inputs(qd, kd, vd, causal=causal, softmax_scale=scale, separate_v=True)
        )
        found["launch.choose (forward dispatch)"] = per_call_us(lambda: launch.choose(qd, kd, causal, v=vd))
        found["aligned() x5"] = per_call_us(lambda: [launch.aligned(t) for t in (qd, kd, vd, od, dout)])
        found["torch.empty x6 (validating workspaces)"] = per_call_us(
            lambda: [torch.empty((1, 8, 128), dtype=torch.float32) for _ in range(6)]
        )
        found["dispatch.device_target"] = per_call_us(lambda: dispatch.device_target(qd.device))
    return found


class _Identity:
    """A no-op autograd.Function of three inputs (the engine's and Function's own cost), made lazily."""

    _fn = None

    @classmethod
    def apply(cls, q, k, v):
        if cls._fn is None:
            import torch

            class Identity(torch.autograd.Function):
                @staticmethod
                def forward(ctx, q, k, v):
                    ctx.save_for_backward(q, k, v)
                    return q.detach()

                @staticmethod
                def backward(ctx, g):
                    _, k, v = ctx.saved_tensors
                    return g, torch.empty_like(k), torch.empty_like(v)

            cls._fn = Identity
        return cls._fn.apply(q, k, v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="cutefa's host path on CPU tensors with no-op kernels")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    if not args.cpu:
        p.error("on a GPU run `tools/bench.py --enqueue --train`; here only --cpu")
    found = cpu_components()
    width = max(map(len, found))
    for name, us in found.items():
        print(f"{name:<{width}}  {us:8.1f} us")
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
