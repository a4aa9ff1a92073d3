"""The Rust core as Python sees it: strategies, topology errors, layout, plans."""

import json

import pytest

import paro_torch
from paro_torch import _C


def test_fourteen_strategies_and_aliases() -> None:
    assert len(paro_torch.STRATEGIES) == 14
    assert [s.code for s in paro_torch.Strategy.all()] == paro_torch.STRATEGIES
    pairs = [("ddp", "NNN"), ("zero1", "NNG"), ("zero2", "NGG"), ("zero3", "GGG"), ("fsdp", "GGG"), ("mics", "III")]
    pairs += [("hsdp", "III"), ("hsdp_zero2", "NII"), ("PaRO-IIG", "IIG"), ("iig", "IIG")]
    for alias, code in pairs:
        assert paro_torch.Strategy(alias).code == code
    s = paro_torch.Strategy("IIG")
    assert (s.p, s.g, s.os, s.known_as) == ("I", "I", "G", None)


@pytest.mark.parametrize("code,better", [("INN", "INI"), ("GGI", "GGG"), ("NGN", "NGG")])
def test_eliminated_strategies_name_what_dominates_them(code: str, better: str) -> None:
    with pytest.raises(paro_torch.InvalidStrategyError, match=f"{better} dominates"):
        paro_torch.Strategy(code)


def test_unknown_strategy_lists_the_aliases() -> None:
    with pytest.raises(ValueError, match="zero3=GGG"):
        paro_torch.Strategy("zero4")


def test_group_size_must_divide_world() -> None:
    with pytest.raises(paro_torch.TopologyError, match="world size 6 is not divisible by group size 4"):
        _C.check_topology(6, 4)


def test_nested_layout() -> None:
    # 2 groups x 2: rank 3 = (group 1, local 1) holds I-shard 6..12 and, inside it, G-shard 9..12
    assert _C.padded_numel(10, 4) == 12
    assert _C.shard_range(10, 4, 2, "I", 3) == (6, 12)
    assert _C.shard_range(10, 4, 2, "G", 3) == (9, 12)
    assert _C.shard_range(10, 4, 2, "N", 3) == (0, 12)


def test_subgroup_shapes() -> None:
    assert _C.subgroup_shape([0, 1, 2, 3], 2) == ((4, 2), None)
    assert _C.subgroup_shape([1, 3], 2) == ((2, 1), None)
    shape, why = _C.subgroup_shape([0, 1, 2], 2)
    assert shape is None and "same number" in why


def test_plan_bytes_for_a_ring_all_gather() -> None:
    # S = 8 ranks x 16 elements x 4 bytes; inter (g-1)/g*S/m, intra (m-1)/m*S per rank
    plan = json.loads(_C.describe_plan("all_gather", 8, 4, 5, 16))
    inter = sum(s["bytes"] for s in plan["steps"] if s["level"] == "Inter")
    intra = sum(s["bytes"] for s in plan["steps"] if s["level"] == "Intra")
    s = 8 * 16 * 4
    assert (inter, intra) == (s // 2 // 4, 3 * s // 4)
