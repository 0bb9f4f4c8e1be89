"""The benchmark's host-side measurements (tools/bench.py --enqueue, --startup): the host cost per
call of a tiny problem, and the time from `import cutefa` to the first result from a kernel pack,
in fresh processes."""

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

import bench_check
from bench_backends import Backend, _first_line, environment, load_backends
from bench_grid import DTYPE_NAMES
from bench_run import Entry, Preallocated, host_timer, run_entries

ENQUEUE_SHAPE = {"batch": 1, "seqlen": 128, "heads": 16, "hdim": 128, "causal": True}


def _tiny_problem(dtype_name: str):
    """(q, k, v, causal) of the enqueue/startup problem, on the GPU."""
    import torch

    sh = ENQUEUE_SHAPE
    dtype = getattr(torch, DTYPE_NAMES[dtype_name])
    shape = (sh["batch"], sh["seqlen"], sh["heads"], sh["hdim"])
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    return q, k, v, sh["causal"]


def ensure_pack(pack_dir: Path, q, k, causal: bool) -> str:
    """Make sure the pack at ``pack_dir`` has the kernel cutefa runs for (q, k); returns its name.

    Sets ``CUTEFA_KERNEL_PATH`` to the pack for this process and its children.
    """
    from cutefa import dispatch, pack, pack_build
    from cutefa.api.launch import choose
    from cutefa.compile import fingerprint

    choice = choose(q, k, causal)
    target = dispatch.current_target(q.device)
    os.environ["CUTEFA_KERNEL_PATH"] = str(pack_dir.resolve())
    found, refused = pack.find_kernel(choice.spec.name, target, fingerprint(choice.spec, target))
    if found is None or found.pack != pack_dir.resolve():
        for why in refused:
            print(f"refused: {why}", file=sys.stderr)
        print(
            f"building {choice.spec.name} for {target} into the pack {pack_dir}", file=sys.stderr, flush=True
        )
        (result,) = pack_build.build_pack([choice.spec], target=target, pack_dir=pack_dir, progress=False)
        if not result.ok:
            raise RuntimeError(f"could not build {choice.spec.name}: {result.error}")
    return choice.spec.name


def _raw_kernel(q, k, v, causal, how="call"):
    """A call of cutefa's kernel alone (outputs allocated once, :class:`bench_run.Preallocated`,
    giving (out, lse)): the floor under the API's cost.
    ``how``: "call" (the loaded kernel's full call: arguments laid out per call), "bound" (the
    launcher the API's call plans use: data pointers only) or "tvm_ffi" (the same kernel file
    loaded and called through the tvm_ffi package, for comparison)."""
    import torch

    from cutefa import compile as cc
    from cutefa import ffi, loader
    from cutefa.api.dense import bind
    from cutefa.api.launch import choose

    choice = choose(q, k, causal)
    kernel = loader.get_kernel(choice.spec, choice.target)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if how == "bound":
        bound = bind(kernel, q, k, tuple(lse.shape), scale)
        if bound is None:
            raise RuntimeError("the kernel cannot bind (not loaded from a file)")

        def launch():
            if not bound(q, k, v, out, lse):
                raise RuntimeError("bound launcher busy")

        return Preallocated(launch, (out, lse))
    if how == "tvm_ffi":
        import tvm_ffi

        path = next(
            p
            for p in ffi._LIBRARIES
            if p.stem == choice.spec.name or p.parent.name.startswith(choice.spec.name)
        )
        fn = tvm_ffi.load_module(str(path))[choice.spec.name]
        kernel = loader._with_sm_count(fn) if cc.takes_sm_count(choice.spec) else fn

    return Preallocated(lambda: kernel(q, k, v, out, lse, scale), (out, lse))


def run_enqueue(args: argparse.Namespace) -> int:
    """Host time per call of a tiny problem: loops of N calls timed on the host, one sync at the end
    of each. Every backend is first checked (O and log-sum-exp against the float32 reference on
    every (batch, head), outputs poisoned: tools/bench_check.py) and then timed in turns,
    ``--rounds`` rounds of 5 loops (tools/bench_run.py)."""

    sh = ENQUEUE_SHAPE
    q, k, v, causal = _tiny_problem(args.dtype[0])
    expect = bench_check.expectation(
        q, k, v, causal=causal, scale=1.0 / math.sqrt(sh["hdim"]), slices=sh["batch"] * sh["heads"]
    )
    iters = max(1, args.enqueue_iters)
    notes = []
    if args.pack is not None and "cutefa" in args.backends:
        try:
            notes.append(f"cutefa runs {ensure_pack(args.pack, q, k, causal)} from the pack {args.pack}")
        except Exception as exc:  # noqa: BLE001 - reported, cutefa then runs from the cache or JIT
            notes.append(f"no pack: {_first_line(exc)}")
    backends = load_backends(args.backends)
    names = [b.name for b in backends]
    if "cutefa" in names:
        at = names.index("cutefa") + 1
        for label, how in (("cutefa kernel alone (full call)", "call"), ("cutefa kernel alone (bound)", "bound"),
                           ("cutefa kernel via tvm_ffi", "tvm_ffi")):  # fmt: skip
            backends.insert(at, Backend(label, functools.partial(_raw_kernel, how=how)))
            at += 1
    for b in backends:
        if b.missing:
            print(b.missing)
    totals: dict[int, list[float]] = {}
    timed: dict[str, int] = {}

    host_us = host_timer(iters, 50, totals)

    def entry(b: Backend) -> Entry:
        def make():
            fn = b.make(q, k, v, causal)
            timed[b.name] = id(fn)
            return fn

        return Entry(
            b.name, make if b.make else None, lambda raw: expect.judge(b.outputs(raw)), b.context, b.missing
        )

    found = run_entries([entry(b) for b in backends], host_us, rounds=args.rounds)
    results = {}
    for name, res in found.items():
        if res.status == "ok":
            results[name] = {
                "status": "ok", "host_us": res.ms, "total_us": statistics.median(totals[timed[name]]),
                "rounds_host_us": res.rounds_ms, "checks": res.checks,
            }  # fmt: skip
        else:
            results[name] = {"status": res.status, "error": res.error, "checks": res.checks}
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)

    meta = environment() | {"shape": sh, "dtype": args.dtype[0], "iters": iters}
    if "cutefa" in args.backends:
        from cutefa.loader import loaded_kernels

        meta["cutefa_kernels"] = {
            f"{name} ({target})": where for (name, target), where in loaded_kernels().items()
        }
        notes += [f"cutefa kernel {name}: from {where}" for name, where in meta["cutefa_kernels"].items()]
    lines = [
        "# Host cost per call (enqueue)",
        "",
        f"GPU: {meta.get('gpu', '?')}; torch {meta['torch']}; {meta['date']}",
        (
            f"b={sh['batch']} s={sh['seqlen']} h={sh['heads']} d={sh['hdim']} causal, {args.dtype[0]}; "
            f"median of {args.rounds} rounds (backends in turns) of the median of 5 loops of {iters} calls; "
            "host = loop time on the host / calls, "
            "total = including the final synchronize. 'cutefa kernel alone' calls the loaded kernel "
            "with preallocated outputs, with its arguments laid out per call (full call) or only its "
            "data pointers written (bound, as the API's call plans do): the floor under cutefa's own "
            "call path; 'via tvm_ffi' is the same kernel file called through the tvm_ffi package. Each "
            "backend's output and log-sum-exp were checked first against the float32 reference (FAIL: "
            "outside the bar or not finite; no time is taken)."
        ),
        "",
        "| backend | host us/call | total us/call |",
        "|---|---|---|",
    ]
    for name, r in results.items():
        if r["status"] == "ok":
            lines.append(f"| {name} | {r['host_us']:.1f} | {r['total_us']:.1f} |")
        else:
            shown = "" if r["status"] == "missing" else f"{r['status']}: {r.get('error', '')}"
            lines.append(f"| {name} | {shown} | |")
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    md_text = "\n".join(lines)
    print()
    print(md_text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "enqueue.md").write_text(md_text + "\n")
    blob = {"meta": meta, "results": results, "notes": notes}
    (args.out / "enqueue.json").write_text(json.dumps(blob, indent=1) + "\n")
    print(f"wrote {args.out / 'enqueue.md'} and {args.out / 'enqueue.json'}")
    return 1 if any(r["status"] == "FAIL" for n, r in results.items() if n.startswith("cutefa")) else 0


# One fresh process: torch's own start-up (import, CUDA context, the inputs), then either
# `import cutefa` + the first call, or torch's own first attention call (SDPA, FA2 backend). The
# first call writes into NaN-poisoned allocations (tools/bench_check.py, its fill kernel warmed up
# before the clock starts) and its result is checked against the float32 reference afterwards.
_STARTUP_CHILD = """
import json, math, sys, time
shape, dtype, causal, which, tools = json.loads(sys.argv[1])
sys.path.insert(0, tools)
import bench_check
t0 = time.perf_counter()
import torch
q, k, v = (torch.randn(shape, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
with bench_check.poisoned_allocations("cuda"):
    torch.empty(8, device="cuda")
torch.cuda.synchronize()
t1 = time.perf_counter()
if which == "cutefa":
    import cutefa
    t2 = time.perf_counter()
    with bench_check.poisoned_allocations("cuda"):
        out, lse_out = cutefa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    t_call = time.perf_counter()
else:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    t2 = time.perf_counter()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), bench_check.poisoned_allocations("cuda"):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2)
    lse_out = None
torch.cuda.synchronize()
t3 = time.perf_counter()
expect = bench_check.expectation(q, k, v, causal=causal, scale=1 / math.sqrt(shape[-1]),
                                 slices=shape[0] * shape[2])
verdict = expect.judge((out, lse_out))
report = {"torch_ms": (t1 - t0) * 1e3, "import_ms": (t2 - t1) * 1e3, "first_call_ms": (t3 - t2) * 1e3,
          "beyond_torch_ms": (t3 - t1) * 1e3, "check_ok": verdict.ok, "check": verdict.message,
          "dsl_imported": sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "iket"))}
if which == "cutefa":
    import importlib.util, os
    import cutefa.compile as cc
    import cutefa.loader as loader
    import cutefa.profile as prof
    report["origins"] = sorted(loader.loaded_kernels().values())
    phases = {"import cutefa": (t2 - t1) * 1e3, **prof.totals()}
    phases["synchronize"] = (t3 - t_call) * 1e3
    phases["other (validation, allocation, Python)"] = (t3 - t1) * 1e3 - sum(phases.values())
    report["phases"] = phases
    report["bytecode_cached"] = os.path.exists(importlib.util.cache_from_source(cc.__file__))
    report["tvm_ffi_imported"] = "tvm_ffi" in sys.modules
    # The first call's one-time costs against per-kernel ones: a copy of the kernel file loads as a
    # new library, so its first call pays the CUDA module load again but no process-wide set-up.
    import shutil, tempfile
    from pathlib import Path
    from cutefa import ffi
    so_path = next(iter(ffi._LIBRARIES))
    o, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / so_path.name
        shutil.copyfile(so_path, copy)
        t5 = time.perf_counter()
        fn = ffi.load(copy, so_path.stem)
        if cc.takes_sm_count(cc.parse_name(so_path.stem)):
            fn = loader._with_sm_count(fn)
        t6 = time.perf_counter()
        fn(q, k, v, o, lse, 1 / math.sqrt(q.shape[-1]))
        torch.cuda.synchronize()
        t7 = time.perf_counter()
        fn(q, k, v, o, lse, 1 / math.sqrt(q.shape[-1]))
        torch.cuda.synchronize()
        t8 = time.perf_counter()
    report["copy_load_module_ms"] = (t6 - t5) * 1e3
    report["copy_first_call_ms"] = (t7 - t6) * 1e3
    report["copy_second_call_ms"] = (t8 - t7) * 1e3
print(json.dumps(report))
"""


def _startup_run(which: str, problem: list, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_STARTUP_CHILD), json.dumps([*problem, which, str(Path(__file__).parent)])],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{which} start-up process failed:\n{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def startup_phase_lines(runs: list[dict]) -> list[str]:
    """Markdown table of cutefa's start-up phases (CUTEFA_PROFILE=1 in the child): median per phase."""
    names: list[str] = []
    for r in runs:
        names += [n for n in r.get("phases", {}) if n not in names]
    if not names:
        return ["(no start-up phases were reported)"]
    lines = [
        (
            f"Where cutefa's time beyond torch goes (median of {len(runs)} runs, ms; CUTEFA_PROFILE=1; "
            f"bytecode cached: {sorted({str(r.get('bytecode_cached')) for r in runs})}):"
        ),
        "",
        "| phase | ms |",
        "|---|---|",
    ]
    for name in names:
        lines.append(
            f"| {name} | {statistics.median(r.get('phases', {}).get(name, 0.0) for r in runs):.2f} |"
        )
    return lines


def run_startup(args: argparse.Namespace) -> int:
    """Fresh processes timed from `import cutefa` to the first result, with the kernel from a pack
    (CUTEFA_JIT=0 and an empty cache, so nothing else can serve it), beyond torch's own start-up."""
    sh = ENQUEUE_SHAPE
    q, k, v, causal = _tiny_problem(args.dtype[0])
    pack_dir = args.pack if args.pack is not None else args.out / "pack"
    variant = ensure_pack(pack_dir, q, k, causal)
    del q, k, v
    problem = [[sh["batch"], sh["seqlen"], sh["heads"], sh["hdim"]], DTYPE_NAMES[args.dtype[0]], causal]
    runs: dict[str, list[dict]] = {"cutefa": [], "sdpa": []}
    with tempfile.TemporaryDirectory() as empty_cache:
        # PYTHONDONTWRITEBYTECODE would make every child compile cutefa's modules from source
        # again (+15-25 ms on a slow CPU): a user's process writes bytecode once.
        dropped = ("CUTE_DSL_ARCH", "PYTHONDONTWRITEBYTECODE")
        env = {key: val for key, val in os.environ.items() if key not in dropped}
        env |= {
            "CUTEFA_KERNEL_PATH": str(pack_dir.resolve()),
            "CUTEFA_JIT": "0",
            "CUTEFA_CACHE_DIR": empty_cache,
            "CUTEFA_PROFILE": "1",  # the child reports its phases (see cutefa/profile.py)
        }
        for which, timed in runs.items():
            _startup_run(which, problem, env)  # warm the OS file cache and the bytecode cache
            for _ in range(max(1, args.startup_runs)):
                timed.append(_startup_run(which, problem, env))
                print(f"{which}: {timed[-1]}", file=sys.stderr, flush=True)
    cutefa_runs = runs["cutefa"]
    problems = []
    if any(r["dsl_imported"] for r in cutefa_runs):
        problems.append(f"the DSL was imported: {cutefa_runs[0]['dsl_imported']}")
    for which, timed in runs.items():
        wrong = [r["check"] for r in timed if not r.get("check_ok")]
        if wrong:
            problems.append(f"{which}: the first call's result failed its check: {wrong[0]}")
    if any(r["origins"] != [f"pack {pack_dir.resolve()}"] for r in cutefa_runs):
        problems.append(f"the kernel did not come from the pack: {cutefa_runs[0]['origins']}")

    def med(which: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[which])

    meta = environment() | {"shape": sh, "dtype": args.dtype[0], "runs": len(cutefa_runs), "variant": variant}
    lines = [
        "# Start-up: `import cutefa` to the first result from a kernel pack",
        "",
        f"GPU: {meta.get('gpu', '?')}; torch {meta['torch']}; {meta['date']}",
        (
            f"Fresh process each, median of {len(cutefa_runs)} (after one untimed warm-up run); "
            f"b={sh['batch']} s={sh['seqlen']} h={sh['heads']} d={sh['hdim']} causal, {args.dtype[0]}. "
            "torch = import torch, CUDA context and the inputs; beyond torch = from there to the first "
            f"result, synchronized. cutefa runs {variant} from the pack {pack_dir} with CUTEFA_JIT=0 "
            "and an empty cache; torch SDPA (FlashAttention-2 backend) is the same first call without cutefa."
        ),
        "",
        "| what | torch ms | import ms | first call ms | beyond torch ms |",
        "|---|---|---|---|---|",
    ]
    for which, label in (("cutefa", "cutefa from a pack"), ("sdpa", "torch SDPA (FA2)")):
        lines.append(
            f"| {label} | {med(which, 'torch_ms'):.0f} | {med(which, 'import_ms'):.1f} | "
            f"{med(which, 'first_call_ms'):.1f} | {med(which, 'beyond_torch_ms'):.1f} |"
        )
    beyond = med("cutefa", "beyond_torch_ms")
    lines += ["", f"cutefa beyond torch: {beyond:.1f} ms (goal < 50 ms)"]
    lines += ["", *startup_phase_lines(cutefa_runs)]
    if any(r.get("tvm_ffi_imported") for r in cutefa_runs):
        problems.append("the tvm_ffi package was imported (the kernel loader needs only libtvm_ffi.so)")

    def med_of(field: str) -> float:
        return statistics.median(r.get(field, math.nan) for r in cutefa_runs)

    lines += [
        "",
        (
            f"The same kernel file copied and loaded again after the first result: dlopen "
            f"{med_of('copy_load_module_ms'):.2f} ms, its first call (CUDA module load, launch, "
            f"synchronize) {med_of('copy_first_call_ms'):.2f} ms, its second call "
            f"{med_of('copy_second_call_ms'):.2f} ms. The first kernel call above minus this first "
            "call is set-up paid once per process."
        ),
    ]
    lines += [f"PROBLEM: {p}" for p in problems]
    md_text = "\n".join(lines)
    print()
    print(md_text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.md").write_text(md_text + "\n")
    blob = {"meta": meta, "runs": runs, "problems": problems, "beyond_torch_ms": beyond}
    (args.out / "startup.json").write_text(json.dumps(blob, indent=1) + "\n")
    print(f"wrote {args.out / 'startup.md'} and {args.out / 'startup.json'}")
    return 1 if problems else 0
