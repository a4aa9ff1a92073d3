#!/usr/bin/env bash
# Every test: set up, lint, Rust unit and property tests, then the Python (multi-process) suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
# DeepSpeed (CPU accelerator) for the ZeRO-3-on-paro test; no prebuilt ops
DS_BUILD_OPS=0 $PY -m pip install -q 'deepspeed>=0.18,<0.20'
# schedule-free optimizers (optim="schedule_free_adamw") for the ParoTrainer test
$PY -m pip install -q 'schedulefree>=1.4,<2'
echo "== lint"
cargo fmt --all --check
cargo clippy -p paro-core --all-targets -- -D warnings
$PY -m ruff check .
$PY -m ruff format --check .
echo "== cargo test"
cargo test -p paro-core
echo "== pytest"
$PY -m pytest tests -q --durations=12
