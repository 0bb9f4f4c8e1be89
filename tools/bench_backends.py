"""The benchmark's GPU side (tools/bench.py): the timer, the backends (cutefa, FA4, cuDNN, FA2; a
backward forced to one variant), the check of an output against SDPA, one backend timed on one
cell, the dense matmul ceiling and the run's environment."""

# No `from __future__ import annotations`: tools load this file by path, not always registering it
# in sys.modules, and dataclasses cannot resolve string annotations then.
import contextlib
import datetime
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_grid import Result, tflops


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_timer(warmup: int, rep: int) -> tuple[str, Callable[[Callable[[], object]], float]]:
    """(name, time_ms): median milliseconds of a callable."""
    import torch

    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:

        def bench_ms(fn: Callable[[], object]) -> float:
            try:
                return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
            except TypeError:  # a triton without return_mode
                return float(do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])[0])

        return "triton.testing.do_bench", bench_ms

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")

    def time_ms(fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        est = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(max(1, int(warmup / est))):
            fn()
        times = []
        for _ in range(max(5, int(rep / est))):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times)

    return "CUDA events (triton not installed)", time_ms


@dataclass
class Backend:
    name: str
    # make(q, k, v, causal) -> a no-argument callable that runs the attention forward once
    make: Callable | None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    missing: str | None = None


@contextlib.contextmanager
def forced_bwd_variant(name: str):
    """Within the block, cutefa's backward runs variant ``name`` whatever dispatch would choose."""
    from cutefa.api import backward
    from cutefa.model.spec import parse_name

    spec = parse_name(name)
    saved = backward.choose_bwd

    def choose(target, dtype, head_dim, causal, **where):
        wanted = saved(target, dtype, head_dim, causal, **where)
        if (wanted.dtype, wanted.head_dim, wanted.causal) != (spec.dtype, spec.head_dim, spec.causal):
            raise ValueError(
                f"--bwd-variants: {name} does not serve this problem (dispatch wants {wanted.name})"
            )
        return spec

    backward.choose_bwd = choose
    try:
        yield
    finally:
        backward.choose_bwd = saved


def bwd_variant_backend(name: str, cutefa_backend: "Backend") -> "Backend":
    """cutefa's backend with the backward forced to variant ``name``."""
    return Backend(
        name, cutefa_backend.make, context=lambda: forced_bwd_variant(name), missing=cutefa_backend.missing
    )


def load_backends(wanted: list[str]) -> list[Backend]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = []
    for name in wanted:
        if name == "cutefa":
            try:
                import cutefa

                def make(q, k, v, causal, _f=cutefa.flash_attn_func):
                    return lambda: _f(q, k, v, causal=causal)

                out.append(Backend(name, make))
            except Exception as exc:  # noqa: BLE001 - a broken import is a table entry, not a crash
                out.append(Backend(name, None, missing=f"cutefa not importable: {_first_line(exc)}"))
        elif name == "FA4":
            try:
                from flash_attn.cute import flash_attn_func as fa4
            except Exception:  # noqa: BLE001 - absent or broken: either way no FA4 column
                out.append(Backend(name, None, missing="FA4 not installed"))
                continue

            def make(q, k, v, causal, _f=fa4):
                return lambda: _f(q, k, v, causal=causal)

            out.append(Backend(name, make))
        else:
            kind = SDPBackend.CUDNN_ATTENTION if name == "cuDNN" else SDPBackend.FLASH_ATTENTION

            def make(q, k, v, causal):
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            out.append(Backend(name, make, context=lambda kind=kind: sdpa_kernel(kind)))
    return out


def _output(value):
    """Backends return out, or (out, lse): the attention output either way, as (b, s, h, d)."""
    return value[0] if isinstance(value, (tuple, list)) else value


def _sdpa_out(q, k, v, causal):
    import torch.nn.functional as F

    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return o.transpose(1, 2)


def rel_err(out, ref) -> float:
    import torch

    if out.shape != ref.shape:
        return math.inf
    diff = torch.linalg.vector_norm(out.float() - ref.float()).item()
    norm = torch.linalg.vector_norm(ref.float()).item()
    err = diff / norm if norm else (0.0 if diff == 0 else math.inf)
    return math.inf if math.isnan(err) else err


def _variant(q, k, v, causal) -> str | None:
    try:
        import cutefa

        m = re.search(r"cutefa_sm\d+_\w+", cutefa.explain(q, k, v, causal=causal))
        return m.group(0) if m else None
    except Exception:  # noqa: BLE001 - the variant name is a label only
        return None


def _backward(make, q, k, v, causal, dout):
    """A closure timing the backward only: the forward runs once here, the closure re-runs
    autograd over its graph (retain_graph) and returns dQ."""
    import torch

    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = _output(make(qq, kk, vv, causal)())
    if out.shape != dout.shape:  # SDPA backends return (b, h, s, d)
        dout = dout.transpose(1, 2)
    return lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True)[0]


def _sdpa_dq(q, k, v, causal, dout):
    import torch

    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(_sdpa_out(qq, kk, vv, causal), qq, dout)[0]


def run_backend(backend: Backend, q, k, v, causal, time_ms, expect, check_tol, dout=None) -> Result:
    if backend.make is None:
        return Result("missing", error=backend.missing)
    try:
        with backend.context():
            if dout is None:
                fn = backend.make(q, k, v, causal)
            else:
                fn = _backward(backend.make, q, k, v, causal, dout)
            err = None
            if expect is not None:
                err = rel_err(_output(fn()), expect)
                if not err <= check_tol:
                    return Result("WRONG", rel_err=err, error=f"rel err {err:.3g} vs SDPA > {check_tol}")
            ms = time_ms(fn)
        return Result("ok", ms=ms, rel_err=err)
    except Exception as exc:  # noqa: BLE001 - one failing backend must not kill the table
        return Result("err", error=_first_line(exc))


def measure_matmul(time_ms) -> float:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.mm(a, b))
    return tflops(2.0 * n**3, ms)


def environment() -> dict:
    import importlib.metadata as md

    import torch

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        meta["gpu"] = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    for dist in ("cutefa", "nvidia-cutlass-dsl", "flash-attn-4", "triton"):
        try:
            meta[dist] = md.version(dist)
        except md.PackageNotFoundError:
            meta[dist] = None
    return meta
