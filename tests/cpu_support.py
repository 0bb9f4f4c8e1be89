"""What the CPU test files share: seeded random inputs, a plain attention reference, tracing a
flash_attn_func call under torch.compile on fake CUDA tensors, loading a script of tools/ as a
module, the compile tests' sample of variants, reading the branches and loops of a kernel's SASS,
the sm90 backward's stmatrix / TMA-store checks, an H200 pretended for the call plans on CPU
tensors, and compiling a test module's samples in a child process (:func:`compile_in_child`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

import cutefa


def rand(*shape, seed=0):
    """A float32 tensor of standard normal values, the same for the same shape and seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(q, k, v, causal, scale, dtype=torch.float32):
    """Plain attention in ``dtype`` with grouped heads and bottom-right causal masking:
    (out (b, sq, hq, d), lse (b, hq, sq)). A row that attends no key gets out 0 and lse -inf."""
    group = q.shape[2] // k.shape[2]
    k, v = k.to(dtype).repeat_interleave(group, 2), v.to(dtype).repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
        s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def trace_attention_block(q, k, v, q_descale=None, k_descale=None, v_descale=None, v_mean=None):
    """Compile ``out * 2, lse.exp()`` of a causal flash_attn_func call with torch.compile
    (fullgraph=True) and run it on q, k, v, the descales and v_mean (fake CUDA tensors: no GPU needed).
    Dynamo must trace exactly one graph. Returns (out, lse) and the targets that graph calls."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=capture)
    def attention_block(q, k, v, qd, kd, vd, v_mean):
        out, lse = cutefa.flash_attn_func(
            q, k, v, causal=True, return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd, v_mean=v_mean
        )
        return out * 2, lse.exp()

    torch._dynamo.reset()
    result = attention_block(q, k, v, q_descale, k_descale, v_descale, v_mean)
    (graph,) = graphs
    return result, [n.target for n in graph.graph.nodes if n.op == "call_function"]


def load_tool(name: str):
    """The script tools/<name>.py as a module, loaded once under its own key in sys.modules."""
    key = f"cutefa_tools_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


# The compile tests (marker ``compile``) check a fixed sample of the variants they name by default and
# every one with CUTEFA_FULL_COMPILE_TESTS=1 (pyproject.toml's markers, .ci/run).
FULL_COMPILE_TESTS = os.environ.get("CUTEFA_FULL_COMPILE_TESTS", "") not in ("", "0")


def variant_traits(spec) -> set[tuple[str, object]]:
    """What a compiled variant stands for in a sample: its template, dtype, mask, head dim, tile and
    the value of each field of its option record."""
    from cutefa import codegen

    traits = {
        ("template", codegen.template_name(spec)), ("dtype", spec.dtype), ("mask", spec.mask),
        ("head_dim", spec.head_dim), ("tile", (spec.tile_m, spec.tile_n, spec.stages, spec.warps)),
    }  # fmt: skip
    return traits | {(f.name, getattr(spec.options, f.name)) for f in dataclasses.fields(spec.options)}


def compile_sample(specs: Iterable, *, keep: Iterable = ()) -> list:
    """The variants of ``specs`` a compile test compiles: all of them with CUTEFA_FULL_COMPILE_TESTS=1;
    otherwise ``keep`` (those of them in ``specs``) and, picked greedily in the order given, as few
    more as make every template, dtype, mask, head dim, tile and option value of ``specs`` appear
    at least once (:func:`variant_traits`). The same specs give the same sample; order is kept."""
    specs = list(dict.fromkeys(specs))
    if FULL_COMPILE_TESTS:
        return specs
    traits = {s: variant_traits(s) for s in specs}
    chosen = [s for s in dict.fromkeys(keep) if s in traits]
    needed = set().union(*traits.values()) - set().union(*(traits[s] for s in chosen))
    while needed:
        best = max(specs, key=lambda s: len(traits[s] & needed))
        chosen.append(best)
        needed -= traits[best]
    return [s for s in specs if s in chosen]


def assert_not_an_option(arch: str, direction: str, dtype: str, **option: object) -> None:
    """The option record of the (arch, direction, dtype) family has no field ``option`` names: the
    record refuses it, and a spec of the family refuses another family's record."""
    from cutefa.model.options import Options, options_class
    from cutefa.model.spec import VariantSpec

    ((name, value),) = option.items()
    cls = options_class(arch, direction, dtype)
    assert name not in {f.name for f in dataclasses.fields(cls)}, f"{cls.__name__} has {name}"
    with pytest.raises(TypeError, match=name):
        cls(**option)
    owner = next(c for c in _option_records(Options) if name in {f.name for f in dataclasses.fields(c)})
    with pytest.raises(TypeError, match=cls.__name__):
        VariantSpec(arch, direction, dtype, 128, 128, 64, 2, 8, options=owner(**{name: value}))


def _option_records(base: type) -> list[type]:
    return [c for sub in base.__subclasses__() for c in (sub, *_option_records(sub))]


def all_variants(arch: str, direction: str | None = None) -> list:
    """The committed variants of ``arch`` (in ``direction``) and the measured alternatives beside
    them (tools/alternatives.py: they are not in generated/ and render on demand), sorted."""
    return load_tool("alternatives").all_variants(arch, direction)


def skipped_fmuls(sass_text: str) -> list[int]:
    """For each forward conditional branch of the SASS text (``cuobjdump -sass``): the FMULs it jumps
    over, where the stretch it skips holds at least one (the lazy O rescale's branches)."""
    lines = [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"^\s+/\*([0-9a-f]+)\*/\s+([^;]*);", sass_text, re.MULTILINE)
    ]
    found = []
    for i, (addr, ins) in enumerate(lines):
        m = re.match(r"@!?P\d+\s+BRA\s+0x([0-9a-f]+)", ins)
        if not m or int(m.group(1), 16) <= addr:
            continue
        target = int(m.group(1), 16)
        skipped = [x for a, x in lines[i + 1 :] if a < target]
        fmuls = sum(x.split()[0].startswith("FMUL") for x in skipped if not x.startswith("@"))
        if fmuls:
            found.append(fmuls)
    return found


# One SASS instruction of ``cuobjdump -sass``: address, opcode (after any predicate), operands.
_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def step_loop(text: str, issues: int) -> list[str]:
    """The shortest back-branch loop of the SASS text whose body holds at least ``issues`` WGMMA
    instructions (HGMMA or QGMMA), as "OPCODE operands" strings."""
    ins = [
        (int(m.group(1), 16), m.group(2), m.group(3))
        for line in text.splitlines()
        if (m := _INSN.match(line))
    ]
    at = {addr: i for i, (addr, _, _) in enumerate(ins)}
    best = None
    for i, (addr, op, rest) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target is None or int(target.group(1), 16) >= addr or int(target.group(1), 16) not in at:
            continue
        body = ins[at[int(target.group(1), 16)] : i + 1]
        if sum(o.startswith(("HGMMA", "QGMMA")) for _, o, _ in body) >= issues and (
            best is None or len(body) < len(best)
        ):
            best = body
    assert best is not None, f"no loop issues {issues} WGMMAs"
    return [f"{op}{rest}" for _, op, rest in best]


def assert_sm90_bwd_stores(report, main_forms: dict, spec) -> None:
    """The sm90 backward (templates/bwd_sm90.py.j2) main kernel's stores: stmatrix for dS^T (64 keys
    x tile_m queries per consumer warpgroup, four 8x8 matrices per warp and instruction: tile_m /
    16) and for the dK/dV staging once per key block (64 keys x head_dim each: head_dim / 16 each),
    then TMA stores of dK and dV (the producer warp, two call sites: after each later key block's
    release and after the last) and no per-thread global store. ``report``: sass.analyze of the
    cubin; ``main_forms``: sass.opcode_forms of the main kernel's SASS."""
    stsm = spec.tile_m // 16 + 2 * spec.head_dim // 16
    assert report.forms_of("STSM") == {"STSM.16.M88.4": stsm}, report.forms_of("STSM")
    assert main_forms.get("UTMASTG.4D", 0) > 0 and main_forms["UTMASTG.4D"] % 4 == 0, main_forms
    assert not [f for f in main_forms if f.startswith("STG")], main_forms


def replace_in(monkeypatch, modules, name, value):
    """``monkeypatch.setattr(module, name, value)`` for each of ``modules``: a function that several
    modules import by name (``from cutefa.loader import get_kernel``) is replaced in every module that
    looks it up."""
    for module in modules:
        assert hasattr(module, name), f"{module.__name__} has no {name}"
        monkeypatch.setattr(module, name, value)


def pretend_h200(monkeypatch):
    """flash_attn_func as on an H200 for CPU tensors: CPU accepted, the sm_90a target and the H200's
    tuned table, no device switch. Dispatch caches are cleared."""
    from cutefa import dispatch
    from cutefa.api import validate

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "device_target", lambda device=None: ("sm_90a", "NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    dispatch.clear_caches()


def compile_in_child(out: Path, arch: str, child: str, tests: Path) -> dict:
    """Run ``child`` (a Python source with a ``{tests}`` placeholder for the tests folder) in a fresh
    process that compiles for ``arch`` and keeps its cubins under ``out``; return the JSON its last
    line prints. A fresh process: the DSL's architecture is read once per process."""
    env = {
        **os.environ,
        "CUTE_DSL_ARCH": arch,
        "CUTE_DSL_KEEP": "cubin",
        "CUTE_DSL_DUMP_DIR": str(out),
        "CUTEFA_CACHE_DIR": str(out / "cache"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(tests.parent), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(
        [sys.executable, "-c", child.format(tests=str(tests))],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"compiling the samples for {arch} failed:\n" + (proc.stdout + proc.stderr)[-4000:]
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])
