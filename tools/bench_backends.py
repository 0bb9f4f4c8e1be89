"""The benchmark's backends (tools/bench.py) and GPU helpers: the timer, cutefa, FA4
(``flash_attn.cute``), SDPA's cuDNN, FlashAttention-2 and memory-efficient backends, FlexAttention,
a cutefa backward forced to one variant, the dense matmul ceiling and the run's environment.

Every backend is called at its library's own level, which allocates its outputs, and returns its
log-sum-exp with its output (so that both are checked): ``cutefa.flash_attn_func(...,
return_lse=True)``; FA4's ``flash_attn_func(..., return_lse=True)``; SDPA's backend ops
(``torch.ops.aten._scaled_dot_product_{cudnn,flash,efficient}_attention``, what
``F.scaled_dot_product_attention`` runs, with the log-sum-exp asked for) on (batch, heads, seqlen,
head_dim) views, or on grouped-query cells ``F.scaled_dot_product_attention(..., enable_gqa=True)``
under ``sdpa_kernel`` (torch refuses a backend that cannot; no log-sum-exp is returned there, so only
the output is checked); FlexAttention compiled once, its block mask built outside the timed call.
SDPA's causal mask is aligned top-left: the grid's cells have seqlen_q == seqlen_k.

v may have a head dim of its own (a ``--hdim QK:V`` cell): the output then has v's. Whether a backend
takes a cell's head dims is its own library's word, asked before the cell runs (``Backend.refuses``;
a refused cell is "n/a (why)", neither run nor timed): cutefa's head-dim rule
(``cutefa.model.spec.why_not_head_dims``: one head dim, a multiple of 8 up to 256, or a pair of
``HEAD_DIM_V_PAIRS``); FA4's own validation (``flash_attn.cute.interface._validate_head_dims``: on
sm90 each of d_qk and d_v a multiple of 8 from 8 to 256, on sm100 up to 128 or (192, 128) and a few
other pairs; an FA4 without it lets the call decide); SDPA's backends, where v's head dim differs
from q's, torch's dispatcher checks (``torch.backends.cuda.can_use_{flash,efficient,cudnn}_attention``,
the reason its warning: the FlashAttention-2 backend wants one head dim for q, k and v, cuDNN's
limits depend on its version and the GPU). FlexAttention has no check: its call decides.
"""

# No `from __future__ import annotations`: tools load this file by path, not always registering it
# in sys.modules, and dataclasses cannot resolve string annotations then.
import contextlib
import datetime
import inspect
import re
import statistics
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_grid import tflops
from bench_run import first_line as _first_line


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
    """``make(q, k, v, causal)`` -> a no-argument callable running the forward once (q, k, v in
    (batch, seqlen, heads, head_dim), v's head dim d_v); ``outputs(raw)`` -> (out (b, sq, hq, d_v),
    lse (b, hq, sq) or None) of what that callable returned (views, outside the timed call);
    ``context``: entered around every call; ``missing``: why the backend is absent; ``refuses(q, k,
    v, causal)`` (within ``context``; None: the call decides): why the backend does not take the
    problem, by its library's own check, or None."""

    name: str
    make: Callable | None
    outputs: Callable = None  # type: ignore[assignment]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    missing: str | None = None
    refuses: Callable | None = None

    def __post_init__(self):
        if self.outputs is None:
            self.outputs = pair


def pair(raw):
    """(out, lse or None) of a result that is a tensor or a tuple (out, lse, ...)."""
    if isinstance(raw, (tuple, list)):
        return raw[0], (raw[1] if len(raw) > 1 else None)
    return raw, None


def canonical_lse(lse, batch: int, heads: int, seqlen: int):
    """A backend's log-sum-exp as (batch, heads, seqlen): trailing unit dims dropped, padding past
    seqlen cut (SDPA's efficient backend pads it), a (batch, seqlen, heads) one transposed; None stays None.
    ValueError for any other shape."""
    if lse is None:
        return None
    x = lse
    while x.dim() > 3 and x.shape[-1] == 1:
        x = x.squeeze(-1)
    if x.dim() == 3 and tuple(x.shape[:2]) == (batch, heads) and x.shape[2] >= seqlen:
        return x[:, :, :seqlen]
    if x.dim() == 3 and tuple(x.shape) == (batch, seqlen, heads):
        return x.transpose(1, 2)
    raise ValueError(
        f"a log-sum-exp of shape {tuple(lse.shape)} for batch={batch} heads={heads} seqlen={seqlen}"
    )


@contextlib.contextmanager
def forced_bwd_variant(name: str, tail: bool | None = None):
    """Within the block, cutefa's backward runs variant ``name`` whatever dispatch would choose
    (ValueError for a problem it does not serve); ``tail`` False turns the sm80 non-causal
    backward's stream-K tail off (None: as dispatch runs it)."""
    from cutefa.api import backward
    from cutefa.model.spec import parse_name

    spec = parse_name(name)
    saved = backward.choose_bwd, backward.TAIL_SLOTS

    def choose(target, dtype, head_dim, causal, **where):
        wanted = saved[0](target, dtype, head_dim, causal, **where)
        if (wanted.dtype, wanted.head_dim, wanted.causal) != (spec.dtype, spec.head_dim, spec.causal):
            raise ValueError(
                f"--bwd-variants: {name} does not serve this problem (dispatch wants {wanted.name})"
            )
        return spec

    backward.choose_bwd = choose
    if tail is False:
        backward.TAIL_SLOTS = 0
    try:
        yield
    finally:
        backward.choose_bwd, backward.TAIL_SLOTS = saved


def bwd_variant_backend(name: str, cutefa_backend: "Backend", label: str | None = None,
                        tail: bool | None = None) -> "Backend":  # fmt: skip
    """cutefa's backend with the backward forced to variant ``name`` (named ``label``, default the variant)."""
    return Backend(
        label or name, cutefa_backend.make, cutefa_backend.outputs,
        context=lambda: forced_bwd_variant(name, tail), missing=cutefa_backend.missing,
        refuses=cutefa_backend.refuses,
    )  # fmt: skip


def _cutefa() -> Backend:
    try:
        import cutefa
    except Exception as exc:  # noqa: BLE001 - a broken import is a table entry, not a crash
        return Backend("cutefa", None, missing=f"cutefa not importable: {_first_line(exc)}")

    def make(q, k, v, causal, _f=cutefa.flash_attn_func):
        return lambda: _f(q, k, v, causal=causal, return_lse=True)

    return Backend("cutefa", make, refuses=_cutefa_refuses)


def _cutefa_refuses(q, k, v, causal) -> str | None:
    """cutefa's own head-dim rule (its forward and backward take the same head dims)."""
    from cutefa.model.spec import why_not_head_dims

    return why_not_head_dims(int(q.shape[-1]), int(v.shape[-1]))


def _fa4() -> Backend:
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception:  # noqa: BLE001 - absent or broken: either way no FA4 column
        return Backend("FA4", None, missing="FA4 not installed")
    try:
        takes_lse = "return_lse" in inspect.signature(fa4).parameters
    except (TypeError, ValueError):
        takes_lse = False
    extra = {"return_lse": True} if takes_lse else {}

    def make(q, k, v, causal):
        return lambda: fa4(q, k, v, causal=causal, **extra)

    return Backend("FA4", make, refuses=_fa4_refuses)


def _fa4_refuses(q, k, v, causal) -> str | None:
    """FA4's own head-dim validation for q's GPU (the one its forward and backward run first); None
    where this FA4 has none (its call decides)."""
    import torch

    try:
        from flash_attn.cute.interface import _validate_head_dims
    except ImportError:
        return None
    major, _ = torch.cuda.get_device_capability(q.device)
    try:
        _validate_head_dims(int(q.shape[-1]), int(v.shape[-1]), major, 16 // v.element_size())
    except AssertionError as exc:
        return f"FA4: {exc}"
    except TypeError:  # another signature: not the check this knows
        return None
    return None


SDPA_OPS = {"cuDNN": "CUDNN_ATTENTION", "FA2": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def _sdpa(name: str) -> Backend:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = getattr(SDPBackend, SDPA_OPS[name])
    aten = torch.ops.aten

    def make(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        if q.shape[2] != k.shape[2]:
            return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
        if name == "FA2":
            return lambda: aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal)
        if name == "cuDNN":
            return lambda: aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, causal)
        return lambda: aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, causal)

    def outputs(raw):
        out, lse = pair(raw)
        b, h, s = out.shape[:3]
        return out.transpose(1, 2), canonical_lse(lse, b, h, s)

    return Backend(name, make, outputs, context=lambda: sdpa_kernel(kind), refuses=sdpa_refuses(name))


SDPA_CHECKS = {"cuDNN": "can_use_cudnn_attention", "FA2": "can_use_flash_attention",
               "efficient": "can_use_efficient_attention"}  # fmt: skip


def sdpa_refuses(name: str) -> Callable:
    """``refuses`` of SDPA's backend ``name``: where v's head dim differs from q's, torch's own
    dispatcher check of that backend (within its ``sdpa_kernel`` context), the reason the warning it
    gives; with one head dim the backend is called as before (None)."""

    def refuses(q, k, v, causal) -> str | None:
        import torch.backends.cuda as tbc

        if q.shape[-1] == v.shape[-1]:
            return None
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        try:
            params = tbc.SDPAParams(qt, kt, vt, None, 0.0, causal, q.shape[2] != k.shape[2])
        except TypeError:  # a torch without enable_gqa
            params = tbc.SDPAParams(qt, kt, vt, None, 0.0, causal)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ok = getattr(tbc, SDPA_CHECKS[name])(params, True)
        if ok:
            return None
        said = [str(w.message).split(" (Triggered internally")[0].strip() for w in seen]
        return said[-1] if said else f"torch's {SDPA_CHECKS[name]} is False for this problem"

    return refuses


_FLEX: dict = {}


def _flex() -> Backend:
    try:
        import torch
        from torch.nn.attention import flex_attention as fa
    except Exception:  # noqa: BLE001 - absent: no column
        return Backend("Flex", None, missing="FlexAttention not available in this torch")
    aux = getattr(fa, "AuxRequest", None)
    if "compiled" not in _FLEX:
        # one compiled function for every cell's shapes: enough recompilations allowed for a grid
        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 512))
        _FLEX["compiled"] = torch.compile(fa.flex_attention, dynamic=False)
    flex = _FLEX["compiled"]

    def make(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        sq, sk = q.shape[1], k.shape[1]
        mask = None
        if causal:
            shift = sk - sq

            def bottom_right(b, h, i, j):
                return j <= i + shift

            mask = fa.create_block_mask(bottom_right, None, None, sq, sk, device=q.device)
        gqa = q.shape[2] != k.shape[2]
        if aux is not None:
            return lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=gqa, return_aux=aux(lse=True))
        return lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=gqa, return_lse=True)

    def outputs(raw):
        out, extra = pair(raw)
        lse = getattr(extra, "lse", extra)
        b, h, s = out.shape[:3]
        return out.transpose(1, 2), canonical_lse(lse, b, h, s)

    return Backend("Flex", make, outputs)


def load_backends(wanted: list[str]) -> list[Backend]:
    """The named backends (tools/bench_grid.BACKENDS), each present or with its ``missing`` reason."""
    makers = {"cutefa": _cutefa, "FA4": _fa4, "Flex": _flex}
    return [makers[name]() if name in makers else _sdpa(name) for name in wanted]


def _variant(q, k, v, causal) -> str | None:
    try:
        import cutefa

        m = re.search(r"cutefa_sm\d+_\w+", cutefa.explain(q, k, v, causal=causal))
        return m.group(0) if m else None
    except Exception:  # noqa: BLE001 - the variant name is a label only
        return None


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
    for dist in ("cutefa", "nvidia-cutlass-dsl", "flash-attn-4", "triton", "nvidia-cudnn-cu12"):
        try:
            meta[dist] = md.version(dist)
        except md.PackageNotFoundError:
            meta[dist] = None
    return meta
