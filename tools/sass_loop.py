"""Per-class SASS statistics of a kernel's main loop (the innermost loop that holds every HGMMA).

Compiles each named variant for a target (sm_90a by default) on any machine (no GPU needed),
finds the main kernel in its cubin (the function with the most HGMMA/UTCHMMA instructions), takes
the innermost back-branch loop whose body holds all of them, and prints its instruction count by
class, plus the kernel's registers, its spill instructions and, per setmaxnreg region, the budget
and the highest register used. ``--keep DIR`` keeps the cubins, their SASS and each loop body
(NAME.loop.txt); ``--json FILE`` writes the numbers (by class and by opcode).

    python tools/sass_loop.py cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_dqbulk [more names]
    python tools/sass_loop.py --cubin path/to/x.cubin       # an already dumped cubin
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cutefa.model.spec import parse_name
from cutefa.sass import _cuobjdump, disassemble, dump_cubins, setmaxnreg_regions

# Opcodes of the tensor-core MMAs whose loop is the main loop (HMMA: the sm80 family).
_MMA_OPS = ("HGMMA", "QGMMA", "UTCHMMA", "HMMA")

# One SASS instruction line of ``cuobjdump -sass``: address, predicate, opcode, operands.
_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")

# (class, base opcodes): an instruction counts in the first class that lists its opcode's base
# name (the part before the first dot); anything else is 'other'.
# fmt: off
CLASSES = (
    ("HGMMA", ("HGMMA", "WARPGROUP", "QGMMA")),
    ("HMMA", ("HMMA",)),
    ("fp32 math", ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK", "FMAX", "FMIN")),
    ("MUFU", ("MUFU",)),
    ("conversion", ("F2FP", "F2F", "I2F", "F2I")),
    ("integer/address", (
        "IMAD", "IADD3", "IADD", "LEA", "LOP3", "SHF", "ISETP", "SEL", "MOV", "IMNMX", "VIMNMX",
        "UIMAD", "UIADD3", "ULEA", "ULOP3", "USHF", "UISETP", "USEL", "UMOV", "UIMNMX", "UPRMT",
        "VIADD", "VIADDMNMX", "UVIADD", "R2UR", "S2R", "S2UR", "CS2R", "LDC", "ULDC", "PLOP3", "UPLOP3", "P2R", "R2P", "PRMT",
        "IABS", "FLO", "POPC", "BREV", "UFLO", "UPOPC", "VOTEU", "VOTE", "ISCADD",
    )),
    ("shared LDS/STS", ("LDS", "STS", "LDSM", "STSM")),
    ("global/bulk", ("LDG", "STG", "REDG", "RED", "UBLKRED", "UTMALDG", "UBLKCP", "UTMASTG", "ATOM", "LDGSTS")),
    ("barriers/sync", ("BAR", "SYNCS", "MEMBAR", "FENCE", "DEPBAR", "ARRIVES", "WARPSYNC", "NANOSLEEP", "UCGABAR", "ERRBAR", "CCTL")),
    ("branches", ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "BRX", "JMP", "YIELD", "ELECT", "NOP")),
    ("spill", ("LDL", "STL")),
)
# fmt: on


def classify(op: str) -> str:
    base = op.split(".")[0]
    for name, prefixes in CLASSES:
        if base in prefixes:
            return name
    return "other"


def functions(sass: str) -> dict[str, list[tuple[int, str, str, str]]]:
    """Per function: (address, predicate, opcode, operands) of each instruction."""
    out: dict[str, list] = {}
    current = None
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        m = _INSN.match(line)
        if m and current is not None:
            out[current].append((int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4)))
    return out


def main_loop(insns):
    """The innermost loop [head, back branch] holding every HGMMA of ``insns``."""
    mma = [a for a, _, op, _ in insns if op.startswith(_MMA_OPS)]
    if not mma:
        raise RuntimeError("no MMA in this function")
    lo, hi = min(mma), max(mma)
    best = None
    for addr, _, op, rest in insns:
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", rest)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target <= lo and addr >= hi and (best is None or addr - target < best[1] - best[0]):
            best = (target, addr)
    if best is None:
        raise RuntimeError("no loop holds every HGMMA")
    return [i for i in insns if best[0] <= i[0] <= best[1]]


def loop_stats(sass: str) -> dict:
    funcs = functions(sass)
    name = max(funcs, key=lambda f: sum(op.startswith(_MMA_OPS) for _, _, op, _ in funcs[f]))
    body = main_loop(funcs[name])
    by_class: dict[str, int] = {}
    by_op: dict[str, int] = {}
    for _, _, op, _ in body:
        by_class[classify(op)] = by_class.get(classify(op), 0) + 1
        base = op.split(".")[0]
        by_op[base] = by_op.get(base, 0) + 1
    spills = sum(op.startswith(("LDL", "STL")) for f in funcs.values() for _, _, op, _ in f)
    return {
        "function": name,
        "kernel_total": len(funcs[name]),
        "loop_total": len(body),
        "loop_start": hex(body[0][0]),
        "loop_end": hex(body[-1][0]),
        "by_class": by_class,
        "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
        "spill_insns": spills,
    }


def registers(cubin: Path) -> dict[str, int]:
    out = {}
    for m in re.finditer(
        r"Function (\S+):\s*\n?\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)",
        _cuobjdump(cubin, "-res-usage"),
    ):
        out[m.group(1)] = {"reg": int(m.group(2)), "stack": int(m.group(3)), "local": int(m.group(5))}
    return out


def report(label: str, cubin: Path, show_ops: int) -> dict:
    sass = disassemble(cubin)
    stats = loop_stats(sass)
    res = registers(cubin).get(stats["function"], {})
    stats["resources"] = res
    stats["setmaxnreg_regions"] = setmaxnreg_regions(sass)
    stats["body"] = [
        f"/*{a:04x}*/ {pred + ' ' if pred else ''}{op}{rest};"
        for a, pred, op, rest in main_loop(functions(sass)[stats["function"]])
    ]
    print(f"== {label}")
    print(
        f"   main kernel {stats['kernel_total']} insns, loop {stats['loop_total']} "
        f"[{stats['loop_start']}..{stats['loop_end']}], {res}, STL/LDL {stats['spill_insns']}, "
        f"(setmaxnreg budget, highest register) {stats['setmaxnreg_regions']}"
    )
    order = [c for c, _ in CLASSES] + ["other"]
    print("   " + "  ".join(f"{c}={stats['by_class'].get(c, 0)}" for c in order if stats["by_class"].get(c)))
    if show_ops:
        print("   ops: " + " ".join(f"{k}={v}" for k, v in list(stats["by_op"].items())[:show_ops]))
    return stats


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*")
    p.add_argument("--target", default="sm_90a")
    p.add_argument("--cubin", action="append", default=[])
    p.add_argument("--keep", help="folder for the cubins and their SASS (default: a temporary one)")
    p.add_argument("--ops", type=int, default=30, help="show this many opcodes by count (0: none)")
    p.add_argument("--json", help="write the statistics to this file")
    args = p.parse_args(argv)
    results = {}
    for path in args.cubin:
        results[path] = report(path, Path(path), args.ops)
    if args.names:
        out = Path(args.keep or tempfile.mkdtemp(prefix="sass_loop_"))
        cubins = dump_cubins([parse_name(n) for n in args.names], args.target, out)
        for name, cubin in cubins.items():
            if args.keep:
                (out / f"{name}.sass").write_text(disassemble(cubin))
            results[name] = report(name, cubin, args.ops)
            if args.keep:
                (out / f"{name}.loop.txt").write_text("\n".join(results[name]["body"]) + "\n")
    if args.json:
        Path(args.json).write_text(
            json.dumps({k: {f: v for f, v in r.items() if f != "body"} for k, r in results.items()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(_main())
