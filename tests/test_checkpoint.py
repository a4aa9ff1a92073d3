"""Sharded checkpoints (torch.distributed.checkpoint): resharding across strategies and world sizes, atomic saves."""

from pathlib import Path

import pytest
import torch
from launch import assert_ok, launch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = pytest.mark.multiproc


def _contents(ckpt: Path) -> dict:
    out = ckpt.with_suffix(".pt")
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)


def test_saved_on_4_ranks_loads_into_other_strategies_and_world_sizes(tmp_path: Path) -> None:
    """IIG on 2 x 2 saves; GGG on 2 ranks and NNN on 1 load it: the same parameters and optimizer states, and
    training continues exactly as without the checkpoint."""
    assert_ok(launch("checkpoint.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=("train-save", str(tmp_path), "IIG")))
    assert_ok(launch("checkpoint.py", 2, env={"PARO_GROUP_SIZE": "1"}, args=("load-train", str(tmp_path), "GGG")))
    assert_ok(launch("checkpoint.py", 1, env={"PARO_GROUP_SIZE": "1"}, args=("load-train", str(tmp_path), "NNN")))
    saved = _contents(tmp_path / "ckpt")
    assert any(k.endswith(".exp_avg_sq") for k in saved) and "optim.param_groups" in saved
    assert any(k.startswith("model.embed") for k in saved)  # frozen parameters are saved too
    for world in (2, 1):  # loaded and saved again: every entry equal, bit for bit
        again = _contents(tmp_path / f"resaved-{world}")
        assert again.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(again[k], v) if torch.is_tensor(v) else again[k] == v, k
    final = torch.load(tmp_path / "final-4.pt")
    for world in (2, 1):
        resumed = torch.load(tmp_path / f"final-{world}.pt")
        worst = max((resumed[k] - final[k]).abs().max().item() for k in final)
        assert worst < 1e-6, f"training resumed on {world} ranks differs by {worst}"
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "ckpt.safetensors")
    assert exported.keys() == {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert all(torch.equal(v, saved[f"model.{k}"]) for k, v in exported.items())


def test_torch_dcp_state_dict_api_saves_and_reshards(tmp_path: Path) -> None:
    """torch's own get_state_dict / dcp.save on IIG over 2 x 2, then dcp.load / set_state_dict into GGG on 2 ranks:
    training continues exactly as on the 4 ranks."""
    assert_ok(launch("checkpoint.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=("dcp-save", str(tmp_path), "IIG")))
    assert_ok(launch("checkpoint.py", 2, env={"PARO_GROUP_SIZE": "1"}, args=("dcp-load", str(tmp_path), "GGG")))
    want, got = torch.load(tmp_path / "final-dcp-4.pt"), torch.load(tmp_path / "final-dcp-2.pt")
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-6, f"training resumed through torch's DCP API on 2 ranks differs by {worst}"


def test_interrupted_save_never_loads_as_complete(tmp_path: Path) -> None:
    """A rank dies while saving over a checkpoint: the job fails, the earlier checkpoint still loads as it was,
    and the partial one is refused; a checkpoint of another model is refused with the names that differ; a shard
    file cut short or with one byte changed is refused, naming the file."""
    results = launch("checkpoint.py", 2, env={"PARO_GROUP_SIZE": "1"}, args=("interrupt", str(tmp_path)), timeout=120)
    assert results[1].returncode == 3, results[1].output[-2000:]
    assert results[0].returncode != 0 and "Error" in results[0].output, results[0].output[-2000:]
    assert (tmp_path / "interrupted.partial").is_dir()
    out = assert_ok(launch("checkpoint.py", 1, args=("verify", str(tmp_path), "NNN"), timeout=120))
    assert "not a complete paro_torch checkpoint" in out and "does not match the model" in out
    assert "is truncated" in out and "is corrupted" in out and ".distcp" in out  # damaged files, by name


def test_torch_state_dict_apis_see_the_trained_model_for_every_strategy(tmp_path: Path) -> None:
    """All 14 strategies on 2 x 2, shapes that do not divide the ranks (empty shards, a 0-dim parameter):
    full_tensor(), get/set_model_state_dict (full and sharded) equal full_state_dict(); DCP checkpoints of the
    sharded state dict load into a plain module on 1 and on 2 ranks."""
    assert_ok(launch("state_dict_api.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=("check", str(tmp_path)), timeout=400))
    for world in (1, 2):
        assert_ok(launch("state_dict_api.py", world, args=("load", str(tmp_path)), timeout=200))
