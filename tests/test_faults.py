"""Faults lose nothing (docs/checkpoints.md, "When a rank dies"): a rank killed with SIGKILL in forward, backward,
the optimizer step or a checkpoint save ends the job with an error on every other rank within the process-group
timeout, and the last complete checkpoint resumes training exactly as an uninterrupted run; under
``torchrun --max-restarts 1`` the example resumes by itself."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from launch import free_port, launch, torchrun_command
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 20  # faults.py's process-group timeout


@pytest.mark.parametrize("engine", ["paro", "ddp"])
def test_a_killed_rank_fails_the_job_and_the_last_checkpoint_resumes_it_exactly(engine: str, tmp_path: Path) -> None:
    env = {"PARO_GROUP_SIZE": "2"}
    # DDP communicates in backward only (and in the save): a kill in its forward or optimizer step shows as in backward
    phases = ("forward", "backward", "optimizer", "save") if engine == "paro" else ("backward", "save")
    for phase in phases:  # each job saves its checkpoints in a folder of its own
        (tmp_path / phase).mkdir()
        start = time.monotonic()
        results = launch("faults.py", 4, env=env, args=(engine, phase, str(tmp_path / phase)), timeout=180)
        assert results[1].returncode == -signal.SIGKILL, results[1].output[-2000:]
        for r in results[:1] + results[2:]:  # each survivor raised an error that names what broke
            assert r.returncode == 1, f"{phase}: rank {r.rank} exited {r.returncode}:\n{r.output[-3000:]}"
            assert "DistBackendError" in r.output and "paro: " in r.output, f"{phase}:\n{r.output[-3000:]}"
            assert "Connection closed by peer" in r.output or "Connection reset by peer" in r.output, r.output[-3000:]
        # launch's own start-up (imports, rendezvous) included
        assert time.monotonic() - start < TIMEOUT_S + 60, f"{phase}: the survivors took {time.monotonic() - start}s"
    # one job resumes from the last complete checkpoint of each (the save's kill leaves a partial save beside it)
    resumed = ("backward", "save")
    args = (engine, "resume", *(str(tmp_path / phase) for phase in resumed))
    for r in launch("faults.py", 4, env=env, args=args, timeout=180):
        for phase in resumed:
            said = f"{phase}: resumed at step 2, equal to"
            assert r.returncode == 0 and said in r.output, f"{phase}: rank {r.rank}:\n{r.output[-3000:]}"


def _rank_pid(rank: int, script: str) -> int | None:
    """The pid of torchrun's first-attempt worker ``rank`` running ``script``."""
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if script.encode() in cmd and f"RANK={rank}".encode() in env and b"TORCHELASTIC_RESTART_COUNT=0" in env:
            return int(proc.name)
    return None


def _torchrun_example(ckpt: Path, *extra: str) -> subprocess.Popen:
    # torch 2.15's torchrun shares its rendezvous store with the workers; a restarted attempt then reads the dead
    # attempt's Gloo addresses and fails ("connectFullMesh failed ... Connection refused"). This switch gives every
    # attempt a store of its own (docs/checkpoints.md, "Restarting under torchrun").
    env = dict(os.environ, PARO_GROUP_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    args = ("--strategy", "IIG", "--steps", "30", "--save-every", "2", "--layers", "2", "--dim", "32", "--seq", "16",
            "--micro-batch", "2", "--checkpoint", str(ckpt))  # fmt: skip
    cmd = torchrun_command(ROOT / "examples" / "train.py", *args, options=(f"--master-port={free_port()}", *extra))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _weights(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(ckpt, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def test_torchrun_restarts_the_example_after_a_killed_rank_and_it_resumes_exactly(tmp_path: Path) -> None:
    reference = _torchrun_example(tmp_path / "reference")
    out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out[-3000:]

    job = _torchrun_example(tmp_path / "ckpt", "--max-restarts", "1")
    killed = False
    deadline = time.monotonic() + 300
    while job.poll() is None and not killed and time.monotonic() < deadline:
        pid = _rank_pid(1, "examples/train.py")
        if pid is not None and (tmp_path / "ckpt" / "paro.json").exists():
            os.kill(pid, signal.SIGKILL)  # after the first complete save, at any point of a step or a save
            killed = True
        time.sleep(0.05)
    out, _ = job.communicate(timeout=300)
    assert killed, "the job ended before a rank could be killed:\n" + out[-3000:]
    assert job.returncode == 0, out[-3000:]
    assert "resumed from" in out, out[-3000:]
    want = _weights(tmp_path / "reference", tmp_path / "reference.pt")
    got = _weights(tmp_path / "ckpt", tmp_path / "ckpt.pt")
    assert want.keys() == got.keys() and len(want) > 10
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs by {(want[k] - got[k]).abs().max()}"
