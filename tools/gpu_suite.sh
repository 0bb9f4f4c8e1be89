#!/usr/bin/env bash
# A GPU run in steps: compile every committed variant and measured alternative that runs on this
# GPU (parallel), the GPU tests, measure the forward and backward variants into fresh dispatch
# tables, the side-by-side benchmark, the fp8 benchmark, the host cost per call and the start-up time. STEPS picks steps (default: all, in this order), so a run can be split
# over several calls on the same machine; the compile cache (CUTEFA_CACHE_DIR) carries over. The
# GPU tests run in full (CUTEFA_FULL_GPU_TESTS=1 unless set: the fuzz test's 200 cases;
# CUTEFA_FUZZ_CASES=N for another count). STEPS=sanitize (not in the default) runs compute-sanitizer
# over the default kernels (tools/sanitize.py, on an H100) into "$OUT/sanitize".
# Run from the repository root with cutefa importable (PYTHONPATH set, or installed). Installs
# nothing. Arguments go to tools/bench.py. Results land in "${OUT:-bench_out}". Exits non-zero if
# the tests failed; the later steps run anyway. The per-call and start-up steps load cutefa's kernel
# from a pack (PACK_DIR), built on first use.
set -uo pipefail

out="${OUT:-bench_out}"
steps="${STEPS:-compile tests tune bench fp8 enqueue startup}"
pack="${PACK_DIR:-/tmp/cutefa-pack}"  # kernel pack for the per-call and start-up measurements
mkdir -p "$out"
jobs="${CUTEFA_JOBS:-$(nproc)}"
tests_rc=0
bench_rc=0
has() { [[ " $steps " == *" $1 "* ]]; }

nvidia-smi -L || echo "nvidia-smi failed"
target=$(python3 -c 'from cutefa.dispatch import current_target; print(current_target())')

if has compile; then
    python3 -m cutefa compile --target "$target" --jobs "$jobs" 2>&1 | tail -n 3 | tee "$out/compile.log"
    # the measured alternatives (tools/alternatives.py, not in generated/): the GPU tests run them too
    for arch in $(python3 -c "from cutefa.model.spec import families_for_target as f; print(*f('$target'))"); do
        python3 tools/alternatives.py --list --arch "$arch" | awk '!/committed/ {print $1}'
    done | xargs -r -P "$jobs" -I{} python3 -m cutefa compile --target "$target" --kernels {} --jobs 1 \
        >> "$out/compile.log" 2>&1
    echo "alternatives compiled: $(grep -cE '(^|[^0-9])1 compiled, 0 failed' "$out/compile.log") (log: $out/compile.log)"
fi
if has tests; then
    CUTEFA_FULL_GPU_TESTS="${CUTEFA_FULL_GPU_TESTS:-1}" \
        python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log" | tail -n 25
    tests_rc=${PIPESTATUS[0]}
fi
if has tune; then
    for arch in $(python3 -c "from cutefa.model.spec import families_for_target as f; print(*f('$target'))"); do
        for direction in fwd bwd; do
            dtypes=fp16,bf16
            [[ $direction == fwd ]] && dtypes=fp16,bf16,e4m3  # the fp8 forward (no fp8 backward)
            python3 -m cutefa tune --arch "$arch" --direction "$direction" --dtype "$dtypes" --out "$out/tuned" 2>&1 |
                tee -a "$out/tune.log" | tail -n 2
        done
    done
    export CUTEFA_TUNED_DIR="$out/tuned"
fi
if has bench; then
    plot=()
    python3 -c 'import matplotlib' 2>/dev/null && plot=(--plot "$out/bench.png")
    python3 tools/bench.py --out "$out" ${plot[@]+"${plot[@]}"} "$@"
    bench_rc=$?
fi
if has fp8; then
    python3 tools/bench_fp8.py 2>&1 | tee "$out/bench_fp8.md" | tail -n 40
fi
if has enqueue; then
    python3 tools/bench.py --enqueue --pack "$pack" --out "$out"
fi
if has startup; then
    python3 tools/bench.py --startup --pack "$pack" --out "$out"
fi
if has sanitize; then
    python3 tools/sanitize.py --out "$out/sanitize" 2>&1 | tail -n 40
fi

echo "gpu tests: exit $tests_rc; bench: exit $bench_rc (steps: $steps)"
if [ "$tests_rc" -ne 0 ]; then
    exit "$tests_rc"
fi
exit "$bench_rc"
