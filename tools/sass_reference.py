"""The SASS reference: a sample of dispatchable default kernels, one or more per family and
direction, with a digest of the SASS each compiles to (tests/data/sass_reference.json).

tests/test_sass_reference.py compiles the same sample in the current tree and asserts the same
digests: a change to the variant model, the templates or the compile path that is meant to leave
the kernels alone must leave their SASS instruction-for-instruction the same. The SASS is normalized
first (:func:`normalize`): addresses and the kernel's symbol name go, so a variant renamed with the
same code compares equal. Per variant the reference keeps the sha256 of the normalized instructions,
the sha256 of their encodings (which add the scheduling control bits), the instruction count, the
registers and a histogram of the opcode forms (what the test prints when the digests differ).

It records whatever ``cutefa`` is on the import path, so a reference can be taken from an older
checkout (``PYTHONPATH=<checkout> python tools/sass_reference.py --write``); a sample variant whose
name that tree does not know is compiled under its former name. No GPU is needed: each variant is
compiled for its target in a child process (:func:`cutefa.sass.dump_cubins`).

    python tools/sass_reference.py --write            # record the whole sample into the reference file
    python tools/sass_reference.py --check            # compare this tree against the reference
    python tools/sass_reference.py --check NAME ...   # only these sample variants
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "sass_reference.json"


@dataclass(frozen=True)
class Sample:
    """One sample variant: its name, the target it is compiled for, why it is in the sample, and
    the name it had before a rename (compiled under that name by a tree that does not know the
    new one)."""

    name: str
    target: str
    why: str
    former_name: str | None = None


# fmt: off
SAMPLE: tuple[Sample, ...] = (
    Sample("cutefa_sm80_fwd_bf16_hd128_128x128_s1_w8_causal", "sm_80",
           "sm80 forward: the bf16 hd128 default, causal"),
    Sample("cutefa_sm80_bwd_bf16_hd128_64x128_s1_w8_dqtile", "sm_90a",
           "sm80 backward: the hd128 default (dQ by tile), as Hopper runs it"),
    Sample("cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp", "sm_90a",
           "sm90 16-bit forward: the hd128 default (overlap + ping-pong)"),
    Sample("cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_pp_lpt_erescale_pcvt_lres", "sm_90a",
           "sm90 16-bit forward: a tuned-table hd256 kernel on the longest-first scheduler",
           former_name="cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_pp_erescale_pcvt_lpt_lres"),
    Sample("cutefa_sm90_fwd_e4m3_hd128_128x128_s3_w12_ov_hvt", "sm_90a",
           "sm90 e4m3 forward: the hd128 default (overlap, hoisted V transpose)"),
    Sample("cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_dqbulk", "sm_90a",
           "sm90 backward: the hd128 default (the main template, bulk dQ)"),
    Sample("cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_dqbulk_dqs", "sm_90a",
           "sm90 backward: the hd192 default (K/V-swapped partition, staged dQ)"),
    Sample("cutefa_sm90_bwd_bf16_hd256_64x64_s2_w12_ov_dqbulk", "sm_90a",
           "sm90 backward: the hd256 default (head-dim split)"),
    Sample("cutefa_sm80_fwd_bf16_hd128_16x64_s2_w1_paged_split", "sm_90a",
           "sm80 decode: one token per sequence, a group's query heads in one tile, paged K/V, split-KV"),
    Sample("cutefa_sm90_fwd_bf16_hd576v512_32x64_s2_w8_causal_paged_split", "sm_90a",
           "sm90 MLA decode: 128 query heads over one latent kv head (576/512), paged, split-KV, causal"),
    Sample("cutefa_sm90_fwd_bf16_hd576v512_64x64_s2_w8_paged_split", "sm_90a",
           "sm90 MLA decode with WGMMA (the opt-in variant): 64 packed rows, two warpgroups, paged, split-KV"),
    Sample("cutefa_sm100_fwd_bf16_hd128_256x128_s3_w16_emu25", "sm_100a",
           "sm100 forward: the bf16 hd128 default"),
    Sample("cutefa_sm100_fwd_e4m3_hd128_256x128_s3_w16_causal_emu25", "sm_100a",
           "sm100 e4m3 forward: the hd128 default, causal"),
    Sample("cutefa_sm100_bwd_bf16_hd128_128x128_s1_w4", "sm_100a",
           "sm100 backward: the hd128 default"),
)
# fmt: on

# One instruction of ``cuobjdump -sass``: address, text up to the ';', first encoding word; the
# second encoding word is alone on the next line.
_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
_WORD = re.compile(r"^\s+/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
_OPCODE = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
VARIANT = "<variant>"


@dataclass(frozen=True)
class Normalized:
    """A cubin's SASS with addresses, encodings and the variant's name taken out."""

    text: str  # one line per function header and per instruction
    encodings: str  # the encoding words of the instructions, in order
    count: int
    opcodes: dict[str, int]

    def record(self) -> dict[str, object]:
        return {
            "sha256": hashlib.sha256(self.text.encode()).hexdigest(),
            "encoding_sha256": hashlib.sha256(self.encodings.encode()).hexdigest(),
            "instructions": self.count,
            "opcodes": dict(sorted(self.opcodes.items())),
        }


def normalize(sass_text: str, variant: str) -> Normalized:
    """Normalize the ``cuobjdump -sass`` text of one variant's cubin: each function (sorted by its
    name with ``variant`` replaced by a placeholder) as a header line and its instructions, without
    addresses or encodings, and ``variant`` replaced wherever an instruction names it. Branch
    targets stay: they are offsets within the same code."""
    functions: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    for line in sass_text.splitlines():
        if m := _FUNCTION.match(line):
            name = m.group(1).replace(variant, VARIANT)
            if name in functions:
                raise ValueError(f"function {name!r} appears twice in the SASS of {variant}")
            current = functions[name] = ([], [])
        elif m := _INSN.match(line):
            if current is None:
                raise ValueError(f"an instruction before any function header in the SASS of {variant}")
            current[0].append(" ".join(m.group(2).split()).replace(variant, VARIANT))
            current[1].append(m.group(3))
        elif (m := _WORD.match(line)) and current is not None and current[1]:
            current[1][-1] += " " + m.group(1)
    if not functions or not any(insns for insns, _ in functions.values()):
        raise ValueError(f"no instructions found in the SASS of {variant}")
    text, encodings, opcodes = [], [], {}
    for name in sorted(functions):
        insns, words = functions[name]
        text.append(f"function {name}")
        text += insns
        encodings.append(f"function {name}")
        encodings += words
        for insn in insns:
            op = _OPCODE.match(insn)
            form = op.group(1) if op else insn.split()[0]
            opcodes[form] = opcodes.get(form, 0) + 1
    count = sum(len(insns) for insns, _ in functions.values())
    return Normalized("\n".join(text) + "\n", "\n".join(encodings) + "\n", count, opcodes)


def registers(cubin: Path) -> int:
    """The most registers any function of ``cubin`` uses (``cuobjdump -res-usage``)."""
    from cutefa import sass

    usage = [int(r) for r in re.findall(r"REG:(\d+)", sass._cuobjdump(cubin, "-res-usage"))]
    if not usage:
        raise RuntimeError(f"no resource usage found in {cubin}")
    return max(usage)


def _parse(sample: Sample):
    """The variant of ``sample`` as the tree on the import path names it: its name, else the former."""
    from cutefa.model.spec import parse_name

    try:
        return parse_name(sample.name)
    except ValueError:
        if sample.former_name is None:
            raise
        return parse_name(sample.former_name)


def compile_sample(sample: Sample, work_dir: Path) -> tuple[dict[str, object], Normalized, float]:
    """Compile ``sample`` for its target in a child process: its record (with the name it was
    compiled under and the registers), its normalized SASS and the seconds the compile took."""
    from cutefa import sass

    spec = _parse(sample)
    start = time.perf_counter()
    cubin = sass.dump_cubins([spec], sample.target, work_dir)[spec.name]
    seconds = time.perf_counter() - start
    normalized = normalize(sass.disassemble(cubin), spec.name)
    record = {
        "target": sample.target,
        "why": sample.why,
        "compiled_as": spec.name,
        "registers": registers(cubin),
        **normalized.record(),
    }
    return record, normalized, seconds


def opcode_difference(expected: dict[str, int], found: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The opcode forms whose counts differ: form -> (expected, found)."""
    return {
        form: (expected.get(form, 0), found.get(form, 0))
        for form in sorted(set(expected) | set(found))
        if expected.get(form, 0) != found.get(form, 0)
    }


def mismatch(name: str, expected: dict, found: dict) -> str | None:
    """None when ``found`` (a record of this tree) has the instructions and encodings of
    ``expected`` (the reference's); else what differs, with the opcode histogram's difference."""
    if expected["sha256"] == found["sha256"] and expected["encoding_sha256"] == found["encoding_sha256"]:
        return None
    if expected["sha256"] == found["sha256"]:
        return f"{name}: the same instructions with other encodings (scheduling control bits differ)"
    counts = f"{expected['instructions']} -> {found['instructions']} instructions"
    lines = [
        f"{name}: SASS differs from the reference ({counts}, registers {expected['registers']} -> {found['registers']})"
    ]
    diff = opcode_difference(expected["opcodes"], found["opcodes"])
    lines += [f"  {form}: {a} -> {b}" for form, (a, b) in diff.items()]
    if not diff:
        lines.append("  same opcode histogram: operands or order differ")
    return "\n".join(lines)


def load_reference(path: Path = REFERENCE) -> dict:
    return json.loads(Path(path).read_text())


def _commit() -> str:
    """The commit of the checkout whose ``cutefa`` is imported, '+dirty' when it has changes."""
    import cutefa

    root = Path(cutefa.__file__).resolve().parent.parent
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--", "cutefa", "templates", "generated"],
        capture_output=True,
        text=True,
        check=False,
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed (from the PATH)"


def _selected(names: list[str]) -> list[Sample]:
    by_name = {s.name: s for s in SAMPLE}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"not in the sample: {', '.join(unknown)}")
    return [by_name[n] for n in names] if names else list(SAMPLE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="compile the sample and write the reference")
    mode.add_argument(
        "--check", action="store_true", help="compile the sample and compare with the reference"
    )
    parser.add_argument(
        "--reference", type=Path, default=REFERENCE, help=f"the reference file ({REFERENCE.name})"
    )
    parser.add_argument(
        "names", nargs="*", help="with --check: the sample variants to compile (all by default)"
    )
    args = parser.parse_args(argv)
    samples = _selected(args.names)
    if args.write and args.names:
        raise SystemExit("--write records the whole sample: name no variants")

    records, failures = {}, []
    with tempfile.TemporaryDirectory(prefix="sass_reference_") as tmp:
        for sample in samples:
            record, _, seconds = compile_sample(sample, Path(tmp) / sample.name)
            records[sample.name] = record
            print(
                f"{sample.name} ({sample.target}): {record['instructions']} instructions, "
                f"{record['registers']} registers, compiled in {seconds:.1f} s",
                flush=True,
            )
            if args.check:
                expected = load_reference(args.reference)["variants"].get(sample.name)
                problem = (
                    f"{sample.name}: not in the reference"
                    if expected is None
                    else mismatch(sample.name, expected, record)
                )
                if problem:
                    failures.append(problem)
                    print(problem, flush=True)
    if args.check:
        print("all equal" if not failures else f"{len(failures)} of {len(samples)} differ")
        return 1 if failures else 0

    reference = {
        "about": "SASS digests of a sample of dispatchable default kernels (tools/sass_reference.py); "
        "tests/test_sass_reference.py asserts the current tree compiles them to the same SASS.",
        "commit": _commit(),
        "dsl_version": importlib.metadata.version("nvidia-cutlass-dsl"),
        "cuobjdump_version": _version("nvidia-cuda-cuobjdump"),
        "variants": records,
    }
    args.reference.parent.mkdir(parents=True, exist_ok=True)
    args.reference.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {args.reference}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
