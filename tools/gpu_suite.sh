#!/usr/bin/env bash
# One GPU session: compile the default variants for this GPU (parallel), run the GPU tests, measure
# the variants into a fresh dispatch table (CUTEFA_TUNE=1), then the side-by-side benchmark.
# Run from the repository root with cutefa importable (PYTHONPATH set, or installed). Installs
# nothing. Arguments go to tools/bench.py. Results land in "${OUT:-bench_out}". Exits non-zero if
# the tests failed; the later steps run anyway.
set -uo pipefail

out="${OUT:-bench_out}"
mkdir -p "$out"
jobs="${CUTEFA_JOBS:-$(nproc)}"

nvidia-smi -L || echo "nvidia-smi failed"
target=$(python3 -c 'from cutefa.dispatch import current_target; print(current_target())')

python3 -m cutefa compile --arch sm80 --target "$target" --jobs "$jobs" 2>&1 | tail -n 3 | tee "$out/compile.log"

python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log" | tail -n 15
tests_rc=${PIPESTATUS[0]}

if [ "${CUTEFA_TUNE:-0}" = 1 ]; then
    python3 -m cutefa tune --arch sm80 --out "$out" 2>&1 | tee "$out/tune.log" | tail -n 3
    export CUTEFA_TUNED_DIR="$out"
fi

python3 tools/bench.py --out "$out" "$@" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu tests: exit $tests_rc ($out/gpu-tests.log); bench: exit $bench_rc ($out/bench.log)"
if [ "$tests_rc" -ne 0 ]; then
    exit "$tests_rc"
fi
exit "$bench_rc"
