#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): one call on the GPU machine, under 7 minutes, with paro's extension for that
# machine carried beside the working tree (scripts/gpu_kit.sh builds it and prints the call). Writes OUT_DIR/log.txt
# and OUT_DIR/summary.json; stages and checks: tests/gpu/run.py. With --dry-run, the CPU subset here (no GPU needed).
# Needs python3 with torch; no network, no Rust.
#   bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--budget SECONDS]
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--budget SECONDS]" >&2
  exit 2
fi
PY=${PYTHON:-python3}
exec "$PY" tests/gpu/run.py "$@"
