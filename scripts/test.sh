#!/usr/bin/env bash
# Every test: set up, lint, Rust unit and property tests, then the Python (multi-process) suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
echo "== lint"
cargo fmt --all --check
cargo clippy -p paro-core --all-targets -- -D warnings
$PY -m ruff check paro_torch tests benchmarks examples
$PY -m ruff format --check paro_torch tests benchmarks examples
echo "== cargo test"
cargo test -p paro-core
echo "== pytest"
$PY -m pytest tests -q
