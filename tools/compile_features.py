"""Compile the shipped feature variants (cutefa/model/feature_sets.py) of some families into the
cache, in parallel, so that GPU tests of the feature calls do not compile one kernel at a time.

    python tools/compile_features.py --target sm_90a --families sm90:fwd,sm80:fwd,sm80:bwd \
        [--head-dims 64,128] [--dtypes bf16,fp16] [--jobs 16] [--dense]

``--dense`` adds the committed (dense) variants of the same families and directions. Prints one
line per failure and a count; exits 1 when any variant failed to compile.
"""

from __future__ import annotations

import argparse
import sys

from cutefa.compile import compile_variants
from cutefa.model.committed import default_variants
from cutefa.model.feature_sets import feature_variants
from cutefa.model.spec import DTYPES, HEAD_DIMS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--families", default="sm90:fwd,sm80:fwd,sm80:bwd", help="arch:direction, comma-separated")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--dense", action="store_true", help="also the committed dense variants")
    args = parser.parse_args(argv)
    head_dims = {int(h) for h in args.head_dims.split(",")}
    dtypes = set(args.dtypes.split(",")) & set(DTYPES)
    specs = []
    for pair in args.families.split(","):
        arch, direction = pair.split(":")
        found = feature_variants(arch, direction)
        if args.dense:
            found += default_variants(arch, direction)
        specs += [s for s in found if s.head_dim in head_dims and s.dtype in dtypes and s.runs_on(args.target)]
    specs = sorted(set(specs))
    results = compile_variants(specs, target=args.target, jobs=args.jobs, progress=False)
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"FAILED {r.spec.name}: {(r.error or '').strip()[-600:]}")
    print(f"compiled {len(results) - len(failed)} of {len(results)} variants for {args.target}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
