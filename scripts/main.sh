#!/usr/bin/env bash
# The main job: set up, ask the cost model for a plan, then train on 4 CPU ranks as 2 groups of 2 over `paro`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
echo "== paro plan: LLaMA-65B on 8 nodes x 8 GPUs, full training"
$PY -m paro_torch.cli plan --model llama-65b --nodes 8 --group-size 8 --grad-accum 4
echo "== training on 4 ranks (2 groups x 2) with FSDP2 HSDP over the paro backend"
PARO_GROUP_SIZE=2 OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 4 \
  examples/train_on_paro.py --steps 8
