"""`benchmarks/repredict.py`: the installed cost model, asked again for a recorded benchmark's cells."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# an interleaved LoRA run at 2 x 2 / 1 Gbit/s (auto and three strategies), recorded by the cost model and the probe as
# they are now (96d1e01): every paro cell and auto's pick must come out as recorded, the overlap figures derived again
# from the probe's recorded loops. A change to the model or the probe records it again (as root, ~4 min), then copy
# the raw record here (cp benchmarks/results/raw/training-2x2-1gbit-rec.json tests/data/):
#   python3 benchmarks/training.py --nodes 2 --per-node 2 --rate 1gbit --scenarios lora \
#     --only 'paro:auto,paro:NNN,paro:IIG,paro:NGG' --interleave --repeats 1 --steps 8 --suffix rec
RECORDED = ROOT / "tests" / "data" / "training-2x2-1gbit-rec.json"


def repredict(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "repredict.py"), str(RECORDED), "--out-dir", str(tmp_path), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    out = tmp_path / RECORDED.name
    return done, json.loads(out.read_text()) if out.exists() else {}


def test_the_installed_model_reproduces_a_recorded_run(tmp_path: Path) -> None:
    done, again = repredict(tmp_path, "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = json.loads(RECORDED.read_text())
    for old, new in zip(recorded["runs"], again["runs"], strict=True):
        assert old.get("extra", {}).get("auto_choice") == new.get("extra", {}).get("auto_choice")


def test_a_changed_figure_changes_the_predictions_and_check_fails(tmp_path: Path) -> None:
    done, again = repredict(tmp_path, "--set", "intra_bandwidth=1e6", "--check")
    assert done.returncode == 1 and "does not reproduce" in done.stderr, done.stdout + done.stderr
    recorded = json.loads(RECORDED.read_text())
    slower = [
        new["extra"]["predicted"]["step"]["step_s"] > old["extra"]["predicted"]["step"]["step_s"]
        for old, new in zip(recorded["runs"], again["runs"], strict=True)
        if "predicted" in old.get("extra", {})
    ]
    assert slower and all(slower), slower
