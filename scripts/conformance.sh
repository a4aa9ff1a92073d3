#!/usr/bin/env bash
# Conformance: runs PyTorch's own distributed test suite (DistributedTest._DistTestBase of the installed torch's
# torch/testing/_internal/distributed/distributed_test.py, each test spawning its ranks as PyTorch's
# test/distributed/test_distributed_spawn.py does) on 4 CPU ranks, first on gloo, then on paro with
# PARO_GROUP_SIZE=2 (2 groups of 2); writes a per-test pass/fail/skip table for both and lists the tests that
# pass on gloo but fail on paro (exit status 1 if any; a check of the backend's name is the one exception).
# About 20 minutes per backend on 2 cores; -k selects tests (pytest -k).
#
#   bash scripts/conformance.sh [-k PATTERN] [-o RESULTS.md] [-t SECONDS_PER_TEST] [-P] [-g GLOO.xml]
#   -P: leave paro out of torch's profiling allowlists (its tests then check results, not "paro:<op>" profiler events)
#   -g: compare with the gloo results (junit XML) of an earlier run instead of running gloo again
#   PARO_TORCH_PATH=/tmp/conf/site bash scripts/conformance.sh   # import paro_torch from there (default: the repo)
#
# Raw logs and junit XML go to a fresh temp dir (printed); the table to benchmarks/results/conformance.md.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
PATTERN="" OUT="$ROOT/benchmarks/results/conformance.md" PER_TEST=180 PROFILING=1 GLOO_XML=""
while getopts "k:o:t:Pg:" opt; do
    case $opt in
        k) PATTERN=$OPTARG ;;
        o) OUT=$(realpath -m "$OPTARG") ;;
        t) PER_TEST=$OPTARG ;;
        P) PROFILING=0 ;;
        g) GLOO_XML=$(realpath "$OPTARG") ;;
        *) sed -n 9,12p "$0" >&2; exit 2 ;;
    esac
done
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/paro-conformance.XXXXXX")
# Run outside the repo so that PYTHONPATH decides which paro_torch is imported; no bytecode or cache in the repo.
export PYTHONPATH="${PARO_TORCH_PATH:-$ROOT}${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
cd "$LOGS"
$PY -c "import expecttest, pytest_timeout" 2>/dev/null || $PY -m pip install -q expecttest pytest-timeout  # torch.testing
echo "paro_torch: $($PY -c 'import paro_torch; print(paro_torch.__file__)'); logs: $LOGS"

BACKENDS="gloo paro"
if [[ -n $GLOO_XML ]]; then cp "$GLOO_XML" "$LOGS/gloo.xml"; BACKENDS=paro; fi
for backend in $BACKENDS; do
    mkdir -p "$LOGS/$backend"  # each test then makes its own TEMP_DIR and init file; file:// enables timeout tests
    start=$SECONDS rc=0
    # The suite's own per-test timeout (it kills the ranks) and pytest-timeout behind it.
    BACKEND=$backend WORLD_SIZE=4 TEMP_DIR="$LOGS/$backend" INIT_METHOD="file://$LOGS/$backend/shared_init_file" \
        PARO_GROUP_SIZE=2 DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=$PER_TEST PARO_CONFORMANCE_PROFILING=$PROFILING \
        PYTORCH_PRINT_REPRO_ON_FAILURE=0 $PY -m pytest "$ROOT/scripts/conformance.py" -p no:cacheprovider -q -rN \
        --timeout=$((PER_TEST + 360)) -o junit_logging=system-err \
        --junitxml="$LOGS/$backend.xml" ${PATTERN:+-k "$PATTERN"} >"$LOGS/$backend.log" 2>&1 || rc=$?
    echo "$backend: $((SECONDS - start)) s, $(tail -n 1 "$LOGS/$backend.log")"
    # pytest: 0 all passed, 1 some failed; anything else (collection error, no tests, usage) is the harness's fault
    if [[ $rc -gt 1 ]]; then tail -n 30 "$LOGS/$backend.log" >&2; exit "$rc"; fi
done
$PY "$ROOT/scripts/conformance.py" report "$LOGS/gloo.xml" "$LOGS/paro.xml" --out "$OUT"
