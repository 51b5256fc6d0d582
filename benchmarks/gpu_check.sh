#!/usr/bin/env bash
# The CUDA backend on a real GPU, in one timed run (issue 40): device, GPU-marked tests, a few
# training steps beside NumPy, compute-sanitizer, the op / gradient / training-feature / model
# suites with backend="cuda", and the GPU benchmark (benchmarks/gpu_bench.py) with what time is
# left; a summary table last (summary.txt, after the environment).
#
#   bash benchmarks/gpu_check.sh                 # from the repository root (or a copy of it)
#   DRY=1 bash benchmarks/gpu_check.sh           # without a GPU: the script's own plumbing, GPU parts skip
#
# Environment: OUT (where logs go; 8 files are written there), WHEELS (a folder of wheels
# to install into /tmp/site first, e.g. cffi and pycparser), TOTAL (seconds for the whole run,
# default 400: each section's cap is cut to what is left), JOBS (pytest-xdist workers, default
# the CPU count), SUITES (test paths, default below), K (pytest -k, default "cuda").
# Sections run under `timeout`, so one hang costs only its own cap; the suites run in the
# background beside the short sections (they are nvcc-bound, the others GPU-bound).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/symgrad-gpu-check}
mkdir -p "$OUT"
TOTAL=${TOTAL:-400}
JOBS=${JOBS:-$(nproc)}
K=${K:-cuda}
DRY=${DRY:-}
MODELS=${MODELS:-A,B,gpt,lenet,resnet}   # benchmarks/gpu_steps.py's models, also under the sanitizer
BACKEND=${BACKEND:-$([ -n "$DRY" ] && echo c || echo cuda)}   # the steps' backend: c in a dry run
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export SYMGRAD_CACHE_DIR=${SYMGRAD_CACHE_DIR:-/tmp/symgrad-gpu-cache}   # shared by the workers (locked per key)
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=${PYTHONPATH:-}${PYTHONPATH:+:}$ROOT:$ROOT/tests
PYTEST=(python3 -m pytest -p no:cacheprovider -o addopts= -rfE)
SUITES=${SUITES:-"tests/nn tests/api/test_cnn_ops.py tests/test_attention.py tests/ir/test_ops.py tests/optim/test_optim.py
  tests/step/test_accumulate.py tests/step/test_checkpoint.py tests/api/test_custom_ops.py tests/test_errors.py
  tests/tools/test_gradcheck.py tests/api/test_indexing_ops.py tests/api/test_indices.py tests/api/test_pointwise_ops.py
  tests/test_reliability_graphs.py tests/test_reliability_numbers.py tests/test_reliability_shared_state.py
  tests/api/test_seeds.py tests/test_softmax_regression.py tests/test_gradients_torch.py tests/test_finite_differences.py"}

left() { echo $((TOTAL - ($(date +%s) - START))); }
cap() {  # cap WANTED RESERVE: WANTED seconds, or what is left after RESERVE, at least 5
    local c; c=$(( $(left) - $2 )); [ "$c" -gt "$1" ] && c=$1; [ "$c" -lt 5 ] && c=5; echo "$c"
}
declare -A RC SECS
section() {  # section NAME CAP COMMAND...: output to $OUT/NAME.log, exit status and seconds kept
    local name=$1 limit=$2 t0 rc; shift 2
    t0=$(date +%s)
    echo "=== $name (cap ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    RC[$name]=$rc; SECS[$name]=$(( $(date +%s) - t0 ))
    echo "=== $name: exit $rc in ${SECS[$name]}s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')"
}

{
    echo "date: $(date -u)"; uname -a
    nvidia-smi -L || echo "nvidia-smi: none"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || true
    nvcc --version | tail -2 || echo "nvcc: none"
    which compute-sanitizer || echo "compute-sanitizer: none"
    python3 -c "import sys, numpy, cffi, sympy, torch; print(sys.version.split()[0], 'numpy', numpy.__version__,
        'cffi', cffi.__version__, 'sympy', sympy.__version__, 'torch', torch.__version__)"
    python3 -c "import xdist; print('xdist', xdist.__version__)" || echo "no pytest-xdist"
    python3 -c "from symgrad.backends import cuda; print('devices', cuda.device_count(), 'arch', cuda.device_arch(),
        'flags', cuda.nvcc_flags())"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
XDIST=(-n "$JOBS")
python3 -c "import xdist" 2>/dev/null || XDIST=()

# The suites, in the background: nvcc-bound, most of the run.
SUITE_CAP=$(cap 100000 15)
echo "=== suites (cap ${SUITE_CAP}s, -k '$K', ${#XDIST[@]} xdist args) in the background"
(
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout -k 10 "$SUITE_CAP" "${PYTEST[@]}" -v "${XDIST[@]}" -k "$K" $SUITES > "$OUT/suites.log" 2>&1
    echo "$? $(( $(date +%s) - t0 ))" > /tmp/gpu_check_suites.rc
) &
SUITES_PID=$!

# The CUDA backend's own tests but the nvcc-only ones (CI runs those): the GPU tests and the host side.
section gpu_tests "$(cap 150 60)" "${PYTEST[@]}" -v ${XDIST:+-n 4} -m "not nvcc" tests/backends/test_backend_cuda.py \
    tests/backends/test_rowwise.py tests/backends/test_cuda_kernels.py
section steps "$(cap 150 60)" python3 benchmarks/gpu_steps.py --models "$MODELS" --steps 3 --backend "$BACKEND"
SANITIZER=(compute-sanitizer --error-exitcode 99 --print-limit 20)
STEPS=(python3 benchmarks/gpu_steps.py --models "$MODELS" --steps 2 --no-reference --backend "$BACKEND")
if [ -n "$DRY" ]; then SANITIZER=(echo DRY compute-sanitizer); fi
section memcheck "$(cap 150 40)" "${SANITIZER[@]}" --tool memcheck "${STEPS[@]}"
section racecheck "$(cap 90 25)" "${SANITIZER[@]}" --tool racecheck "${STEPS[@]}"
section initcheck "$(cap 90 15)" "${SANITIZER[@]}" --tool initcheck "${STEPS[@]}"

wait "$SUITES_PID"
read -r SRC SSECS < /tmp/gpu_check_suites.rc || { SRC=?; SSECS=?; }
RC[suites]=$SRC; SECS[suites]=$SSECS
echo "=== suites: exit $SRC in ${SSECS}s$([ "$SRC" = 124 ] && echo ' (TIMED OUT)')"

# The benchmark last, alone on the machine, in what time is left (its rows print as they end).
BENCH=${BENCH:-gpt-small,gpt-nanogpt,resnet,lenet,A64,B128,C512}
if [ -n "$DRY" ]; then
    section bench 5 echo DRY gpu_bench --models "$BENCH"
else
    section bench "$(cap 400 5)" python3 benchmarks/gpu_bench.py --models "$BENCH" --steps 20 --compile
fi

# ---- summary ----
count() { grep -cE "$1" "$2" 2>/dev/null || true; }
{
    echo
    echo "device: $(nvidia-smi -L 2>/dev/null | head -1)"
    printf '%-24s %6s %6s %6s %6s %6s %6s\n' section exit secs passed failed skipped errors
    for name in gpu_tests suites; do
        f=$OUT/$name.log
        printf '%-24s %6s %6s %6s %6s %6s %6s\n' "$name" "${RC[$name]}" "${SECS[$name]}" \
            "$(count ' PASSED' "$f")" "$(count ' FAILED' "$f")" "$(count ' SKIPPED' "$f")" "$(count ' ERROR' "$f")"
    done
    for group in tests/nn/ tests/test_cnn_ops tests/test_attention tests/ir/ tests/optim/ tests/test_gradients_torch \
            tests/test_finite_differences; do
        printf '  %-22s %6s %6s %6s %6s %6s %6s\n' "$group" "" "" "$(count " PASSED $group" "$OUT/suites.log")" \
            "$(count " FAILED $group" "$OUT/suites.log")" "$(count " SKIPPED $group" "$OUT/suites.log")" ""
    done
    printf '%-16s %6s %6s %s\n' steps "${RC[steps]}" "${SECS[steps]}" \
        "$(grep -c ' ok$' "$OUT/steps.log") ok, $(grep -c 'FAIL$' "$OUT/steps.log") FAIL"
    for tool in memcheck racecheck initcheck; do
        printf '%-16s %6s %6s %s\n' "$tool" "${RC[$tool]}" "${SECS[$tool]}" "$(grep -m1 'SUMMARY' "$OUT/$tool.log")"
    done
    printf '%-16s %6s %6s\n' bench "${RC[bench]}" "${SECS[bench]}"
    grep -v -i -E 'warn|^W[0-9]{4} |interp.py' "$OUT/bench.log" | tail -20
    echo "total $(( $(date +%s) - START ))s"
    echo "--- failures:"
    grep -hE '^(FAILED|ERROR) ' "$OUT/gpu_tests.log" "$OUT/suites.log" | cut -c1-220 | head -40
    grep -h 'FAIL$\|Error\|error' "$OUT/steps.log" | head -10
} | tee -a "$OUT/summary.txt"
