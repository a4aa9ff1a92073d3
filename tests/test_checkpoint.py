"""Sharded checkpoints (torch.distributed.checkpoint): resharding across strategies and world sizes, atomic saves."""

from pathlib import Path

import pytest
import torch
from launch import Case, RankResult, Shared, assert_ok, launch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

G1, G2 = {"PARO_GROUP_SIZE": "1"}, {"PARO_GROUP_SIZE": "2"}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Every worker run of the tests this session runs, by "<test>:<run>", and their folder (one per test).

    Start-up dominates on 2 cores: the runs on 4 ranks share one launch, and so do those on 2 and on 1
    (tests/launch.py, Shared), in the order each test needs them: every save before its loads. The interrupted
    save runs alone (a rank dies in it). The loads into plain modules run first on their ranks, before anything
    imports paro_torch there.
    """
    tmp = tmp_path_factory.mktemp("checkpoint")
    tests = {item.originalname for item in request.session.items if item.path == request.node.path}
    d = {t: str(tmp / t) for t in tests}
    four: dict[str, Case] = {}
    two: dict[str, Case] = {}
    one: dict[str, Case] = {}
    state_dict = "test_torch_state_dict_apis_see_the_trained_model_for_every_strategy"
    if state_dict in tests:
        four[f"{state_dict}:check"] = Case("state_dict_api.py", ("check", d[state_dict]), G2, 400)
        two[f"{state_dict}:load-2"] = Case("state_dict_api.py", ("load", d[state_dict]), limit_s=200)
        one[f"{state_dict}:load-1"] = Case("state_dict_api.py", ("load", d[state_dict]), limit_s=200)
    saved = "test_saved_on_4_ranks_loads_into_other_strategies_and_world_sizes"
    if saved in tests:
        four[f"{saved}:save"] = Case("checkpoint.py", ("train-save", d[saved], "IIG"), G2)
        two[f"{saved}:load-2"] = Case("checkpoint.py", ("load-train", d[saved], "GGG"), G1)
        one[f"{saved}:load-1"] = Case("checkpoint.py", ("load-train", d[saved], "NNN"), G1)
    dcp = "test_torch_dcp_state_dict_api_saves_and_reshards"
    if dcp in tests:
        four[f"{dcp}:save"] = Case("checkpoint.py", ("dcp-save", d[dcp], "IIG"), G2)
        two[f"{dcp}:load-2"] = Case("checkpoint.py", ("dcp-load", d[dcp], "GGG"), G1)
    results: dict[str, list[RankResult]] = {}
    interrupted = "test_interrupted_save_never_loads_as_complete"
    for t in tests:
        Path(d[t]).mkdir()
    if interrupted in tests:
        args = ("interrupt", d[interrupted])
        results[f"{interrupted}:interrupt"] = launch("checkpoint.py", 2, env=G1, args=args, timeout=120)
        one[f"{interrupted}:verify"] = Case("checkpoint.py", ("verify", d[interrupted], "NNN"), limit_s=120)
    # the workers skip the interpreter's teardown after their checks, as checkpoint.py's own main does
    for world, cases in ((4, four), (2, two), (1, one)):
        results |= Shared(world, cases, hard_exit=True).run(set(cases))
    return tmp, results


def _contents(ckpt: Path) -> dict:
    out = ckpt.with_suffix(".pt")
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)


def test_saved_on_4_ranks_loads_into_other_strategies_and_world_sizes(runs: tuple[Path, dict]) -> None:
    """IIG on 2 x 2 saves; GGG on 2 ranks and NNN on 1 load it: the same parameters and optimizer states, and
    training continues exactly as without the checkpoint."""
    tmp, results = runs
    name = "test_saved_on_4_ranks_loads_into_other_strategies_and_world_sizes"
    for run in ("save", "load-2", "load-1"):  # IIG on 4 ranks, GGG on 2, NNN on 1
        assert_ok(results[f"{name}:{run}"])
    tmp_path = tmp / name
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


def test_torch_dcp_state_dict_api_saves_and_reshards(runs: tuple[Path, dict]) -> None:
    """torch's own get_state_dict / dcp.save on IIG over 2 x 2, then dcp.load / set_state_dict into GGG on 2 ranks:
    training continues exactly as on the 4 ranks."""
    tmp, results = runs
    name = "test_torch_dcp_state_dict_api_saves_and_reshards"
    for run in ("save", "load-2"):
        assert_ok(results[f"{name}:{run}"])
    tmp_path = tmp / name
    want, got = torch.load(tmp_path / "final-dcp-4.pt"), torch.load(tmp_path / "final-dcp-2.pt")
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-6, f"training resumed through torch's DCP API on 2 ranks differs by {worst}"


def test_interrupted_save_never_loads_as_complete(runs: tuple[Path, dict]) -> None:
    """A rank dies while saving over a checkpoint: the job fails, the earlier checkpoint still loads as it was,
    and the partial one is refused; a checkpoint of another model is refused with the names that differ; a shard
    file cut short or with one byte changed is refused, naming the file."""
    tmp, results = runs
    name = "test_interrupted_save_never_loads_as_complete"
    interrupted = results[f"{name}:interrupt"]
    assert interrupted[1].returncode == 3, interrupted[1].output[-2000:]
    assert interrupted[0].returncode != 0 and "Error" in interrupted[0].output, interrupted[0].output[-2000:]
    assert (tmp / name / "interrupted.partial").is_dir()
    out = assert_ok(results[f"{name}:verify"])
    assert "not a complete paro_torch checkpoint" in out and "does not match the model" in out
    assert "is truncated" in out and "is corrupted" in out and ".distcp" in out  # damaged files, by name


def test_torch_state_dict_apis_see_the_trained_model_for_every_strategy(runs: tuple[Path, dict]) -> None:
    """All 14 strategies on 2 x 2, shapes that do not divide the ranks (empty shards, a 0-dim parameter):
    full_tensor(), get/set_model_state_dict (full and sharded) equal full_state_dict(); DCP checkpoints of the
    sharded state dict load into a plain module on 1 and on 2 ranks."""
    _, results = runs
    name = "test_torch_state_dict_apis_see_the_trained_model_for_every_strategy"
    for run in ("check", "load-1", "load-2"):
        assert_ok(results[f"{name}:{run}"])
