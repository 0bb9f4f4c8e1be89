#!/usr/bin/env bash
# GPU tests, then the side-by-side benchmark, on a CUDA machine. Run from the repository root with
# cutefa importable (PYTHONPATH set, or installed). Installs nothing. Arguments go to tools/bench.py.
# Results land in "${OUT:-bench_out}". Exits non-zero if the tests failed; the bench runs anyway.
set -uo pipefail

out="${OUT:-bench_out}"
mkdir -p "$out"

nvidia-smi -L || echo "nvidia-smi failed"

python3 -m pytest -m gpu tests/gpu -x -q -p no:cacheprovider \
    --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

python3 tools/bench.py --out "$out" "$@" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu tests: exit $tests_rc ($out/gpu-tests.log); bench: exit $bench_rc ($out/bench.log)"
if [ "$tests_rc" -ne 0 ]; then
    exit "$tests_rc"
fi
exit "$bench_rc"
