"""Compiled-code inspection: cubins of a variant, their resource usage and SASS instruction mix.

Works on a machine with no GPU. Cubins come from the CuTe DSL's own dump (``CUTE_DSL_KEEP``), in a
child process set up for the target; ``cuobjdump`` comes from the ``nvidia-cuda-cuobjdump`` wheel
(the ``dev`` extra) or the PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cutefa.model.spec import VariantSpec, parse_name

# Instructions worth counting, per family: the ones that prove the design is in the code.
EXPECTED = {
    "sm80": ("HMMA", "LDSM", "LDGSTS", "MUFU.EX2"),
    "sm90": ("HGMMA", "UTMALDG", "USETMAXREG", "SYNCS"),
    "sm100": ("UTCHMMA", "LDTM", "STTM", "UTMALDG"),
}
# The sm90 fp8 forward: WGMMA with e4m3 operands shows as QGMMA (e.g.
# ``QGMMA.64x128x32.F32.E4M3.E4M3``), the on-chip V transpose as PRMT byte permutes, P's
# conversion as F2FP.SATFINITE.E4M3.F32.PACK_AB.
# The sm100 fp8 forward: tcgen05 kind::f8f6f4 UMMAs show as UTCQMMA (``UTCQMMA gdesc[..], gdesc[..],
# tmem[..]`` for S = Q K^T, ``UTCQMMA tmem[..], gdesc[..], ...`` for O += P V with P in TMEM).
EXPECTED_FP8 = {
    "sm90": ("QGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "PRMT", "F2FP.SATFINITE.E4M3"),
    "sm100": ("UTCQMMA", "LDTM", "STTM", "UTMALDG", "USETMAXREG", "F2FP.SATFINITE.E4M3"),
}
SPILL_OPS = ("LDL", "STL")
_COUNTED = sorted(
    {op for ops in (*EXPECTED.values(), *EXPECTED_FP8.values()) for op in ops}
    | set(SPILL_OPS)
    | {"BAR.SYNC", "SHFL", "STSM", "LDS", "STS"}
)
_RES_RE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass
class SassReport:
    """Resource usage and instruction counts of one kernel cubin."""

    registers: int
    stack_bytes: int
    local_bytes: int
    static_smem_bytes: int
    counts: dict[str, int] = field(default_factory=dict)
    # Every opcode with its modifiers as cuobjdump prints it (e.g. 'UTCHMMA.2CTA'), with its count.
    forms: dict[str, int] = field(default_factory=dict)

    def forms_of(self, op: str) -> dict[str, int]:
        """The printed forms of instruction ``op`` (``op`` itself or ``op.<modifiers>``) and their counts."""
        return {form: n for form, n in self.forms.items() if form == op or form.startswith(op + ".")}

    @property
    def spills(self) -> int:
        return sum(self.counts.get(op, 0) for op in SPILL_OPS) + self.stack_bytes + self.local_bytes

    def missing(self, arch: str, dtype: str | None = None) -> list[str]:
        """Expected instructions of the family (of its fp8 kernels for dtype 'e4m3') that do not appear."""
        expected = EXPECTED_FP8[arch] if dtype == "e4m3" else EXPECTED[arch]
        return [op for op in expected if not self.counts.get(op)]

    def summary(self) -> str:
        ops = " ".join(f"{op}={self.counts.get(op, 0)}" for op in _COUNTED)
        return (
            f"registers={self.registers} stack={self.stack_bytes}B local={self.local_bytes}B "
            f"static_smem={self.static_smem_bytes}B | {ops}"
        )


def find_cuobjdump() -> Path:
    """``cuobjdump`` from the CUDA wheels, else from the PATH. Raises FileNotFoundError naming the fix."""
    try:
        from nvidia import cu13  # type: ignore[import-not-found]

        for root in cu13.__path__:
            candidate = Path(root) / "bin" / "cuobjdump"
            if candidate.is_file():
                return candidate
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if found:
        return Path(found)
    raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def _cuobjdump(cubin: Path, *flags: str) -> str:
    tool = find_cuobjdump()
    env = {**os.environ, "PATH": f"{tool.parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # nvdisasm beside it
    proc = subprocess.run([str(tool), *flags, str(cubin)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump {' '.join(flags)} {cubin} failed: {proc.stderr.strip()}")
    return proc.stdout


def disassemble(cubin: Path) -> str:
    """The SASS text of ``cubin`` (``cuobjdump -sass``)."""
    return _cuobjdump(cubin, "-sass")


def kernel_sections(sass_text: str) -> dict[str, str]:
    """The SASS text of each kernel (``Function : <name>`` header to the next one) by its name."""
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass_text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def kernel_text(sass_text: str, role: str) -> str:
    """The SASS of the one kernel of a variant's cubin traced from its method ``role`` (``kernel``,
    ``preprocess``, ``postprocess``: the DSL names it ``kernel_cutlass_<role>_<variant>...``)."""
    found = [text for name, text in kernel_sections(sass_text).items() if name.startswith(f"kernel_cutlass_{role}_")]
    if len(found) != 1:
        raise RuntimeError(f"expected one {role!r} kernel, found {len(found)}")
    return found[0]


def setmaxnreg_regions(sass_text: str) -> list[tuple[int, int]]:
    """(register budget, highest register index used) per stretch of code that starts at a
    ``USETMAXREG`` and runs to the next one (or the end), in code order."""
    lines = sass_text.splitlines()
    marks = [
        (i, int(m.group(1), 0))
        for i, line in enumerate(lines)
        if (m := re.search(r"USETMAXREG\.\S+\s+(?:UP\d+,\s*)?(0x[0-9a-f]+|\d+)", line))
    ]
    regions = []
    for n, (start, budget) in enumerate(marks):
        end = marks[n + 1][0] if n + 1 < len(marks) else len(lines)
        used = [
            int(r)
            for line in lines[start:end]
            for r in re.findall(r"\bR(\d+)\b", line.split("/*")[1] if "/*" in line else line)
        ]
        regions.append((budget, max(used, default=-1)))
    return regions


def analyze(cubin: Path) -> SassReport:
    """Registers, stack/local bytes and instruction counts of the (single) kernel in ``cubin``."""
    usage = _RES_RE.findall(_cuobjdump(cubin, "-res-usage"))
    if not usage:
        raise RuntimeError(f"no kernel resource usage found in {cubin}")
    reg, stack, shared, local = (int(x) for x in max(usage, key=lambda u: int(u[0])))
    forms = opcode_forms(_cuobjdump(cubin, "-sass"))
    counts = {op: sum(n for o, n in forms.items() if o == op or o.startswith(op + ".")) for op in _COUNTED}
    return SassReport(reg, stack, local, shared, counts, forms)


def opcode_forms(sass_text: str) -> dict[str, int]:
    """Each printed instruction form (opcode with its modifiers, e.g. ``STG.E.128``) of
    ``sass_text`` and how often it occurs."""
    forms: dict[str, int] = {}
    for o in re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass_text, re.MULTILINE):
        forms[o] = forms.get(o, 0) + 1
    return forms


def dump_cubins(specs: list[VariantSpec], target: str, out_dir: Path) -> dict[str, Path]:
    """Compile ``specs`` for ``target`` in a child process and return each variant's cubin path.

    Raises RuntimeError with the child's error output if any variant fails to compile.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "CUTE_DSL_ARCH": target,
        "CUTE_DSL_KEEP": "cubin",
        "CUTE_DSL_DUMP_DIR": str(out_dir),
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [sys.executable, "-m", "cutefa.sass", "--target", target, *(s.name for s in specs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"compiling for {target} failed:\n{tail}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: Path(path) for name, path in found.items()}


def _compile_and_find(names: list[str], target: str) -> dict[str, str]:
    """Child side of :func:`dump_cubins`: compile each variant and locate its dumped cubin."""
    from cutefa.compile import compile_object

    dump_dir = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    found = {}
    for name in names:
        pattern = f"*_{name}Kernel_*.cubin"  # the DSL names dumps after the traced module and class
        for stale in dump_dir.glob(pattern):
            stale.unlink()
        compile_object(parse_name(name), target)
        new = sorted(dump_dir.glob(pattern))
        if len(new) != 1:
            raise RuntimeError(f"expected one new cubin for {name}, found {[p.name for p in new]}")
        found[name] = str(new[0])
    return found


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cutefa.sass", description=_compile_and_find.__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("names", nargs="+")
    args = parser.parse_args(argv)
    print(json.dumps(_compile_and_find(args.names, args.target)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
