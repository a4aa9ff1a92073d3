#!/usr/bin/env bash
# Installs what paro-torch needs (torch only if missing; the hf and lightning extras for the examples, ParoTrainer and
# ParoStrategy) and builds it in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Any torch from 2.11 to 2.15 already installed is kept (2.11 is the GPU machine's); otherwise 2.15 is installed.
if ! $PY -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(not (2, 11) <= v <= (2, 15))' 2>/dev/null; then
  echo "== installing torch 2.15 (a few minutes)"
  $PY -m pip install -q 'torch>=2.15,<2.16'
fi
$PY -m pip install -q 'maturin>=1.9,<2' 'pytest>=8' 'pytest-timeout>=2' 'ruff>=0.6'
command -v cargo >/dev/null || { echo "paro-torch needs a Rust toolchain (https://rustup.rs)"; exit 1; }
echo "== building paro-torch (Rust + C++ backend; 2-3 minutes from clean)"
PATH="$($PY -c 'import sys, os; print(os.path.dirname(sys.executable))'):$PATH" \
  $PY -m pip install -q --no-build-isolation -e ".[hf,lightning]"  # the tested transformers, accelerate, peft, lightning
