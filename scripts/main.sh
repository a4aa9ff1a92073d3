#!/usr/bin/env bash
# The main job: set up, ask the cost model for a plan, then train with PaRO-DP on 4 CPU ranks as 2 groups of 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
echo "== paro plan: LLaMA-65B on 8 nodes x 8 GPUs, full training"
$PY -m paro_torch.cli plan --model llama-65b --nodes 8 --group-size 8 --grad-accum 4
echo "== training a small transformer with PaRO-DP, strategy=auto, on 4 CPU ranks as 2 groups x 2"
PARO_GROUP_SIZE=2 OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 4 \
  examples/train.py --strategy auto --steps 20
