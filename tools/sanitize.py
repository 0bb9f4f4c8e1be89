"""compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on every default kernel family and
direction: sm80 forward and backward, sm90 forward and backward (16-bit), sm90 e4m3 forward, each at
the chosen head dims (default 64, 128 and 256), at ragged sizes; and on the feature and decode
kernels the dispatcher runs (tools/sanitize_features.py: the sm90 forward over packed sequences and
with a sliding window, the sm80 backward with each, the paged split-KV decode kernel with its
combine), on ragged packed batches with an empty sequence inside.

Each run is one small driver process (this file with ``--drive``: tools/sanitize_drive.py) under one
tool, launching one default kernel (dispatch's default for the family, head dim and target:
``default_spec`` and, where the GPU's shared memory asks for it, ``fitting_variant``) directly on
its cases, bf16 inputs (e4m3: quantized per head; backward: out and lse from a float32 reference, so
that the run launches the backward kernels alone):

- memcheck, synccheck, initcheck: seqlen 1, 17 and 1000 (queries = keys), causal and not; seqlen_q
  1000 over 17 keys (causal: rows with no key) and 17 over 1000; batch 2 with 8 query heads over 2
  key/value heads (GQA) on the last; 2 heads elsewhere;
- racecheck (slow): one launch, batch 1, 200 queries and keys (two tiles or more each way, so the
  pipelines reuse their buffers), 2 query heads over 1 key/value head, causal.

Before the sanitizer runs, every kernel's driver runs once without it (``--no-prepare`` skips
this): that compiles the kernels into the cache (a sanitized run then loads them) and checks each
case's outputs (NaN-poisoned first) against the float32 reference (tools/bench_check.py); a wrong
result is reported beside the sanitizer's. Under the sanitizer the outputs are poisoned too, except
for initcheck (which is to see reads of memory nobody wrote), and nothing is checked (the check's own
kernels would add to the report). torch's caching allocator is off in every run
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), so that each tensor is its own allocation and an access past
its end is out of bounds for memcheck.

Prints one table, kernel x tool: "clean", "N errors (M in cutefa kernels)" (a record is cutefa's
when it names a DSL kernel, ``kernel_cutlass...``), "failed"/"timeout" (no summary); and writes
``DIR/sanitize.json`` (every run: command, exit code, counts, the first records) and
``DIR/sanitize.md``, the logs under ``DIR/logs/``. Runs of an earlier invocation into the same
``--out`` are kept and shown (a run done again replaces its entry), so the work can be split over
several commands. Exit status 1 unless every run is clean.

    python tools/sanitize.py --out DIR                              # everything, on an H100
    python tools/sanitize.py --out DIR --tools memcheck,initcheck   # some tools (others later, same DIR)
    python tools/sanitize.py --out DIR --kernels sm90_bwd --hdim 64,96,128,192,256 --jobs 8
    python tools/sanitize.py --out DIR --kernels features            # the feature and decode groups
    python tools/sanitize.py --out DIR --kernels sm90_fwd_varlen,sm80_decode
    python tools/sanitize.py --plan                                  # list the runs, run nothing

``--kernels`` takes the labels of :data:`KERNELS` and of tools/sanitize_features.py's groups, and
``dense`` / ``features`` for all of either.

``compute-sanitizer`` is taken from ``--sanitizer``, else PATH, else /usr/local/cuda/bin (else the
newest /usr/local/cuda-*/bin); without one the script stops with an error saying so. The H200
machines refuse the sanitizer; run it on an H100.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(Path(__file__).resolve().parent) not in sys.path:  # sanitize_features, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

import sanitize_features
from sanitize_drive import DRIVER_WRONG, drive
from sanitize_features import FEATURE_KERNELS

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# label -> (family, direction, dtype)
KERNELS = {
    "sm80_fwd": ("sm80", "fwd", "bf16"),
    "sm80_bwd": ("sm80", "bwd", "bf16"),
    "sm90_fwd": ("sm90", "fwd", "bf16"),
    "sm90_bwd": ("sm90", "bwd", "bf16"),
    "sm90_fwd_e4m3": ("sm90", "fwd", "e4m3"),
}
ALL_KERNELS = (*KERNELS, *FEATURE_KERNELS)
KERNEL_GROUPS = {"dense": tuple(KERNELS), "features": tuple(FEATURE_KERNELS)}
HDIMS = (64, 128, 256)
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal)
RAGGED = tuple((1, s, s, 2, 2, c) for s in (1, 17, 1000) for c in (False, True)) + (
    (1, 1000, 17, 2, 2, True),
    (2, 17, 1000, 8, 2, False),
)
RACE = ((1, 200, 200, 2, 1, True),)


def cases_for(tool: str, kernel: str | None = None) -> tuple[tuple, ...]:
    """The cases of ``tool`` on ``kernel`` (a dense kernel when None)."""
    if kernel in FEATURE_KERNELS:
        return sanitize_features.cases_for(kernel, tool)
    return RACE if tool == "racecheck" else RAGGED


def prepare_cases(kernel: str) -> tuple[tuple, ...]:
    """Every case of every tool on ``kernel``: what its unsanitized run checks."""
    return tuple(dict.fromkeys(c for tool in TOOLS for c in cases_for(tool, kernel)))


def tool_flags(tool: str) -> list[str]:
    """The sanitizer's options for ``tool``."""
    flags = ["--tool", tool, "--target-processes", "application-only", "--print-limit", "200"]
    if tool == "racecheck":
        flags += ["--racecheck-report", "all"]
    return flags


@dataclass(frozen=True)
class Run:
    """One sanitizer process: ``tool`` over the driver of ``spec`` (a non-causal variant name)."""

    tool: str
    kernel: str
    hdim: int
    spec: str
    cases: tuple

    @property
    def key(self) -> str:
        return f"{self.tool}:{self.spec}"

    @property
    def row(self) -> str:
        return f"{self.kernel} hd{self.hdim}"


def kernel_spec(kernel: str, hdim: int, target: str):
    """The default variant of ``kernel`` (a :data:`KERNELS` label) at ``hdim`` that runs on
    ``target``, non-causal; (None, why) where there is none."""
    from cutefa.model.defaults import default_spec
    from cutefa.model.rules import fitting_variant, why_not_on

    if kernel in FEATURE_KERNELS:
        return sanitize_features.feature_spec(kernel, hdim, target)
    arch, direction, dtype = KERNELS[kernel]
    spec = default_spec(arch, direction, dtype, hdim)
    if spec is None:
        return None, f"no default {arch} {direction} {dtype} kernel at head dim {hdim}"
    spec = fitting_variant(spec, target) or spec
    why = why_not_on(spec, target)
    return (None, why) if why else (spec, None)


def plan(tools, kernels, hdims, target: str) -> tuple[list[Run], list[str]]:
    """The runs (tool-major, then kernel, then head dim) and what was left out, with why."""
    runs, skipped = [], []
    for tool in tools:
        for kernel in kernels:
            for hdim in hdims:
                spec, why = kernel_spec(kernel, hdim, target)
                if spec is None:
                    if tool == tools[0]:
                        skipped.append(f"{kernel} hd{hdim}: {why}")
                    continue
                runs.append(Run(tool, kernel, hdim, spec.name, cases_for(tool, kernel)))
    return runs, skipped


def find_sanitizer(given: str | None = None) -> str:
    """The compute-sanitizer executable: ``given``, else on PATH, else under /usr/local/cuda/bin or
    the newest /usr/local/cuda-*/bin. SystemExit with how to get one otherwise."""
    if given:
        if Path(given).is_file() and os.access(given, os.X_OK):
            return given
        raise SystemExit(f"--sanitizer {given}: not an executable file")
    found = shutil.which("compute-sanitizer")
    candidates = [found] if found else []
    candidates += ["/usr/local/cuda/bin/compute-sanitizer"]
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)
    for path in candidates:
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return path
    raise SystemExit(
        "compute-sanitizer not found: it ships with the CUDA toolkit; put its bin folder on PATH "
        "(e.g. /usr/local/cuda/bin) or pass --sanitizer PATH"
    )


def driver_command(spec: str, cases, *, poison: bool, check: bool) -> list[str]:
    payload = {"spec": spec, "cases": [_listed(c) for c in cases], "poison": poison, "check": check}
    return [sys.executable, str(Path(__file__).resolve()), "--drive", json.dumps(payload)]


def _listed(case) -> list:
    """A case as JSON takes it: tuples (a packed batch's lengths) as lists."""
    return [_listed(x) if isinstance(x, (tuple, list)) else x for x in case]


def supported(flags: list[str], help_text: str | None) -> list[str]:
    """``flags`` (option, value pairs after ``--tool``'s) without the options ``help_text`` (the
    sanitizer's --help) does not name: an older sanitizer then runs with its defaults there."""
    if help_text is None:
        return flags
    kept, i = [], 0
    while i < len(flags):
        option, value = flags[i], flags[i + 1]
        if option == "--tool" or re.search(rf"(^|\s){re.escape(option)}\b", help_text):
            kept += [option, value]
        i += 2
    return kept


def sanitizer_command(sanitizer: str, run: Run, log: Path, extra: list[str] | None = None,
                      help_text: str | None = None) -> list[str]:  # fmt: skip
    """The full command of one run: the sanitizer, its options, the log file, then the driver."""
    driver = driver_command(run.spec, run.cases, poison=run.tool != "initcheck", check=False)
    flags = supported(tool_flags(run.tool), help_text)
    return [sanitizer, *flags, "--log-file", str(log), *(extra or []), *driver]


def run_env() -> dict:
    """The runs' environment: torch's caching allocator off, this checkout importable."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "PYTHONPATH": path}


# ---------------------------------------------------------------------------------------------
# reading a sanitizer's report


_PREFIX = "========="
_NOT_RECORDS = (
    "COMPUTE-SANITIZER",
    "ERROR SUMMARY",
    "RACECHECK SUMMARY",
    "LEAK SUMMARY",
    "Target application",
)


def parse_report(text: str) -> dict:
    """The counts and records of a sanitizer log: ``errors`` (ERROR SUMMARY; racecheck's error count
    when it prints no ERROR SUMMARY; None without either), ``warnings`` (racecheck), ``records``
    (each a headline and its detail lines), ``cutefa`` (records that name a DSL kernel)."""
    errors = warnings = None
    m = re.search(r"ERROR SUMMARY:\s*(\d+)\s+error", text)
    if m:
        errors = int(m.group(1))
    r = re.search(
        r"RACECHECK SUMMARY:\s*\d+\s+hazards?\s+displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)", text
    )
    if r:
        warnings = int(r.group(2))
        errors = int(r.group(1)) if errors is None else errors
    records: list[dict] = []
    for line in text.splitlines():
        if not line.startswith(_PREFIX):
            continue
        body = line[len(_PREFIX) :]
        if not body.strip():
            continue
        if body.startswith(" ") and body[1:2].isspace():  # an indented detail line
            if records:
                records[-1]["detail"].append(body.strip())
            continue
        head = body.strip()
        if head.startswith(_NOT_RECORDS):
            continue
        records.append({"headline": head, "detail": []})
    for rec in records:
        blob = " ".join([rec["headline"], *rec["detail"]])
        rec["cutefa"] = "kernel_cutlass" in blob or "cutefa" in blob
    return {
        "errors": errors, "warnings": warnings, "records": records,
        "cutefa": sum(1 for rec in records if rec["cutefa"]),
    }  # fmt: skip


@dataclass
class Outcome:
    """What one run gave."""

    key: str
    tool: str
    kernel: str
    hdim: int
    spec: str
    cases: list
    command: list
    exit_code: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    errors: int | None = None
    warnings: int | None = None
    cutefa_records: int = 0
    records: list = field(default_factory=list)
    log: str = ""

    @property
    def status(self) -> str:
        if self.timed_out:
            return "timeout"
        if self.errors is None:
            return f"failed (exit {self.exit_code}, no summary)"
        if self.errors == 0 and self.exit_code != 0:
            return f"0 errors, but the driver exited {self.exit_code}"
        if self.errors == 0:
            return "clean" + (f" ({self.warnings} warnings)" if self.warnings else "")
        return f"{self.errors} errors ({self.cutefa_records} in cutefa kernels)"

    @property
    def clean(self) -> bool:
        return not self.timed_out and self.errors == 0 and self.exit_code == 0


def outcome_of(run: Run, command: list, log_text: str, exit_code: int | None, seconds: float,
               timed_out: bool, log: Path) -> Outcome:  # fmt: skip
    found = parse_report(log_text)
    return Outcome(
        run.key, run.tool, run.kernel, run.hdim, run.spec, [list(c) for c in run.cases], command, exit_code,
        round(seconds, 1), timed_out, found["errors"], found["warnings"], found["cutefa"], found["records"][:20],
        str(log),
    )  # fmt: skip


def sanitize_one(sanitizer: str, run: Run, logs: Path, timeout: float, extra: list[str],
                  help_text: str | None = None) -> Outcome:  # fmt: skip
    log = logs / f"{run.tool}-{run.spec}.log"
    log.unlink(missing_ok=True)
    command = sanitizer_command(sanitizer, run, log, extra, help_text)
    start = time.monotonic()
    timed_out, code = False, None
    with open(logs / f"{run.tool}-{run.spec}.out", "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=run_env(), timeout=timeout,
                                  check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            timed_out = True
    text = log.read_text(errors="replace") if log.exists() else ""
    return outcome_of(run, command, text, code, time.monotonic() - start, timed_out, log)


def prepare_one(spec: str, cases, logs: Path, timeout: float) -> tuple[str, str]:
    """The driver of ``spec`` once without the sanitizer on ``cases`` (:func:`prepare_cases`),
    checked: (spec, "ok" | what went wrong)."""
    try:
        proc = subprocess.run(driver_command(spec, cases, poison=True, check=True), capture_output=True, text=True,
                              env=run_env(), timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return spec, f"timeout after {timeout:.0f} s"
    (logs / f"prepare-{spec}.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode == 0:
        return spec, "ok"
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    what = "WRONG" if proc.returncode == DRIVER_WRONG else f"failed (exit {proc.returncode})"
    return spec, f"{what}: {lines[-1] if lines else ''}"


# ---------------------------------------------------------------------------------------------
# the summary


def table(outcomes: list[Outcome], prepared: dict[str, str]) -> str:
    """kernel x tool, one line per (kernel, head dim, variant), and the prepare run's check."""
    rows: dict[tuple, dict[str, str]] = {}
    for o in outcomes:
        rows.setdefault((ALL_KERNELS.index(o.kernel) if o.kernel in ALL_KERNELS else 99, o.hdim, o.kernel, o.spec), {})[
            o.tool
        ] = o.status  # fmt: skip
    tools = [t for t in TOOLS if any(o.tool == t for o in outcomes)]
    head = ["kernel", "variant", *tools, "outputs checked"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (_, hdim, kernel, spec), by_tool in sorted(rows.items()):
        cells = [f"{kernel} hd{hdim}", spec, *(by_tool.get(t, "") for t in tools), prepared.get(spec, "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_previous(path: Path) -> tuple[dict[str, Outcome], dict[str, str]]:
    if not path.is_file():
        return {}, {}
    blob = json.loads(path.read_text())
    outcomes = {
        o["key"]: Outcome(**{k: v for k, v in o.items() if k != "status" and k != "clean"})
        for o in blob["runs"]
    }
    return outcomes, blob.get("prepared", {})


def write_summary(out: Path, outcomes: dict[str, Outcome], prepared: dict[str, str], meta: dict) -> str:
    text = table(list(outcomes.values()), prepared)
    runs = [asdict(o) | {"status": o.status, "clean": o.clean} for o in outcomes.values()]
    (out / "sanitize.json").write_text(
        json.dumps({"meta": meta, "prepared": prepared, "runs": runs}, indent=1) + "\n"
    )
    (out / "sanitize.md").write_text(f"# compute-sanitizer\n\n{meta.get('gpu', '')}\n\n{text}\n")
    return text


# ---------------------------------------------------------------------------------------------
# the command line


def _list(text: str, allowed, what: str) -> list:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in allowed]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"{what} takes a list of {list(allowed)}, got {text!r}")
    return list(dict.fromkeys(values))


def _kernels(text: str) -> list[str]:
    """``--kernels``: labels of :data:`ALL_KERNELS` and groups (:data:`KERNEL_GROUPS`), expanded."""
    chosen = _list(text, (*ALL_KERNELS, *KERNEL_GROUPS), "--kernels")
    return list(dict.fromkeys(k for c in chosen for k in KERNEL_GROUPS.get(c, (c,))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sanitize.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("sanitize_out"), help="results folder (sanitize_out/)")
    p.add_argument("--tools", type=lambda t: _list(t, TOOLS, "--tools"), default=list(TOOLS))
    p.add_argument(
        "--kernels", type=_kernels, default=list(ALL_KERNELS),
        help=f"labels or groups ({', '.join(KERNEL_GROUPS)}); default every one",
    )  # fmt: skip
    p.add_argument(
        "--hdim", type=lambda t: [int(x) for x in _list(t, ("64", "96", "128", "192", "256"), "--hdim")],
        default=list(HDIMS), help="head dims (default 64,128,256; every one: 64,96,128,192,256)",
    )  # fmt: skip
    p.add_argument(
        "--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)), help="runs at once"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    p.add_argument("--sanitizer", default=None, help="the compute-sanitizer executable (default: found)")
    p.add_argument("--sanitizer-args", default="", help="more options for compute-sanitizer, quoted as one")
    p.add_argument("--target", default=None, help="compile target (default: this GPU's; --plan: sm_90a)")
    p.add_argument("--no-prepare", action="store_true", help="skip the unsanitized compile-and-check runs")
    p.add_argument("--plan", action="store_true", help="print the runs and exit")
    p.add_argument("--drive", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    return args


def _target(given: str | None, plan_only: bool) -> str:
    if given:
        return given
    try:
        import torch

        if torch.cuda.is_available():
            from cutefa.dispatch import current_target

            return current_target()
    except ImportError:
        pass
    if plan_only:
        return "sm_90a"
    raise SystemExit("no CUDA GPU: the sanitizer runs need one (--plan lists the runs without)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drive is not None:
        return drive(json.loads(args.drive))
    target = _target(args.target, args.plan)
    runs, skipped = plan(args.tools, args.kernels, args.hdim, target)
    if args.plan:
        for run in runs:
            print(
                f"{run.tool:10} {run.row:22} {run.spec}  ({len(run.cases)} case{'s' * (len(run.cases) > 1)})"
            )
        for why in skipped:
            print(f"left out: {why}")
        print(f"{len(runs)} runs for {target}")
        return 0
    sanitizer = find_sanitizer(args.sanitizer)
    extra = args.sanitizer_args.split() if args.sanitizer_args else []
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    outcomes, prepared = load_previous(args.out / "sanitize.json")
    helped = subprocess.run([sanitizer, "--help"], capture_output=True, text=True, check=False)
    help_text = (helped.stdout + helped.stderr) or None
    with ThreadPoolExecutor(args.jobs) as pool:
        if not args.no_prepare:
            specs = {run.spec: prepare_cases(run.kernel) for run in runs}
            for spec, how in pool.map(lambda s: prepare_one(s, specs[s], logs, args.timeout), specs):
                prepared[spec] = how
                print(f"prepared {spec}: {how}", flush=True)
        for o in pool.map(lambda r: sanitize_one(sanitizer, r, logs, args.timeout, extra, help_text), runs):
            outcomes[o.key] = o
            print(f"{o.tool:10} {o.kernel} hd{o.hdim} {o.spec}: {o.status} ({o.seconds:.0f} s)", flush=True)
    for why in skipped:
        print(f"left out: {why}")
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, check=False).stdout
    meta = {"target": target, "sanitizer": sanitizer, "version": version.strip().splitlines()[-1:] or [""]}
    try:
        import torch

        meta["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    except ImportError:
        meta["gpu"] = ""
    text = write_summary(args.out, outcomes, prepared, meta)
    print()
    print(text)
    print(f"\nwrote {args.out / 'sanitize.md'} and {args.out / 'sanitize.json'} (logs: {logs})")
    clean = all(o.clean for o in outcomes.values()) and all(v == "ok" for v in prepared.values())
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
