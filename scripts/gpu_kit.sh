#!/usr/bin/env bash
# Builds the GPU check kit here: paro's extension for the GPU machine (CPython 3.12, torch 2.11 from PyPI), stripped,
# as paro_torch/_C.cpython-312-x86_64-linux-gnu.so (git-ignored, so the GPU run must carry it); checks that it
# imports and works in a CPython 3.12 / torch 2.11 virtual environment (created if missing: ~5 GB, needs the
# network), then prints the carry list, the bytes that would travel (fails over 60 MiB) and the call to make.
#   PARO_KIT_VENV   the virtual environment (default ~/.cache/paro-torch/kit-py312-torch2.11)
#   PARO_KIT_PYTHON CPython 3.12 to create it with (default: python3.12 on PATH)
# Rust builds go to target/gpu-kit, apart from the development build's.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PARO_KIT_VENV:-$HOME/.cache/paro-torch/kit-py312-torch2.11}
SO=paro_torch/_C.cpython-312-x86_64-linux-gnu.so
if [ ! -x "$VENV/bin/python" ]; then
  PY312=${PARO_KIT_PYTHON:-python3.12}
  "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' ||
    { echo "gpu_kit: needs CPython 3.12 to create $VENV (set PARO_KIT_PYTHON)"; exit 1; }
  echo "== creating $VENV with torch 2.11 (CPython 3.12; ~5 GB from PyPI, a few minutes)"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q 'torch==2.11.*' numpy 'maturin>=1.9,<2'
fi
"$VENV/bin/python" -m maturin --version >/dev/null 2>&1 || "$VENV/bin/python" -m pip install -q 'maturin>=1.9,<2'
read -r PY_VERSION TORCH_VERSION < <("$VENV/bin/python" -W ignore -c 'import sys, torch; print("%d.%d" % sys.version_info[:2], torch.__version__)')
case "$PY_VERSION $TORCH_VERSION" in "3.12 2.11."*) ;; *) echo "gpu_kit: $VENV has Python $PY_VERSION, torch $TORCH_VERSION; the kit needs 3.12 and 2.11"; exit 1 ;; esac

echo "== building paro's extension for CPython 3.12 / torch $TORCH_VERSION (Rust + C++; 3-6 minutes from clean)"
WHEELS=target/gpu-kit/wheels
rm -rf "$WHEELS"
CARGO_TARGET_DIR=$ROOT/target/gpu-kit PYO3_PYTHON=$VENV/bin/python PATH="$VENV/bin:$PATH" \
  "$VENV/bin/python" -m maturin build --release --strip --interpreter "$VENV/bin/python" --out "$WHEELS"
"$VENV/bin/python" - "$WHEELS" "$SO" <<'PY'
import sys, zipfile
from pathlib import Path
wheels, so = Path(sys.argv[1]), sys.argv[2]
(whl,) = wheels.glob("paro_torch-*-cp312-*.whl")
with zipfile.ZipFile(whl) as z:
    Path(so).write_bytes(z.read(so))
print(f"{so}: from {whl.name}")
PY
strip --strip-unneeded "$SO"
ls -l "$SO"

echo "== checking it with $VENV/bin/python (the checkout's paro_torch, not an installed one)"
"$VENV/bin/python" -c "
import sys; sys.path.insert(0, '$ROOT')
import paro_torch, torch
assert paro_torch._C.__file__ == '$ROOT/$SO', paro_torch._C.__file__
print('paro_torch', paro_torch.__file__, 'on torch', torch.__version__)
"
(cd "$ROOT" && "$VENV/bin/python" -c "import sys; sys.path.insert(0, '.'); from paro_torch.cli import main; sys.exit(main())" \
  plan --model llama-65b --nodes 8 --group-size 8 --trainable 1/16 --grad-accum 4 | tail -4)
SMOKE=$(mktemp -d)
cat > "$SMOKE/smoke.py" <<PY
import sys; sys.path.insert(0, "$ROOT")
import torch, torch.distributed as dist, paro_torch
dist.init_process_group("paro")
x = torch.full((3000,), float(dist.get_rank() + 1))
dist.all_reduce(x)
assert torch.equal(x, torch.full((3000,), 10.0)), x[:4]
out = torch.empty(4 * 5)
dist.all_gather_into_tensor(out, torch.full((5,), float(dist.get_rank())))
assert torch.equal(out, torch.arange(4.0).repeat_interleave(5)), out
print(f"rank {dist.get_rank()} ok")
dist.destroy_process_group()
PY
PARO_GROUP_SIZE=2 OMP_NUM_THREADS=1 timeout 180 "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node 4 \
  "$SMOKE/smoke.py" 2>&1 | tail -5
rm -rf "$SMOKE"
echo "== 4 CPU ranks on paro (groups of 2): all_reduce and all_gather_into_tensor ok"

echo "== what travels"
"$VENV/bin/python" tests/gpu/kit.py
cat <<MSG
== the GPU check, as one device call (the check itself stays under 7 minutes):
   command:   bash scripts/gpu_check.sh \$OUT
   carry:     ["$SO"]
   timeout_s: 450
   then read log.txt and summary.json in the returned files. Try it here first:
   PYTHON=$VENV/bin/python bash scripts/gpu_check.sh /tmp/gpu-dry --dry-run
MSG
