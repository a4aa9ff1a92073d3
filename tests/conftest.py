"""The ``ranks`` fixture: a test's case of a shared launch (tests/launch.py, ``Shared``).

A test module lists its shared launches in ``SHARED``, each with its cases keyed by the name of the test that reads
them (``test_x`` or ``test_x[id]``). The first test of a launch that runs starts it with the cases of every test of
the module that this session runs (``-k`` and node ids pick fewer), and the others read their case from it.
"""

from __future__ import annotations

import pytest
from launch import RankResult, Shared

Results = dict[str, list[RankResult]] | AssertionError


@pytest.fixture(scope="module")
def _shared_results() -> dict[int, Results]:
    return {}


@pytest.fixture
def ranks(request: pytest.FixtureRequest, _shared_results: dict[int, Results]) -> list[RankResult]:
    """This test's case, per rank: its exit code and its output, as ``launch`` gives a worker run alone."""
    name = request.node.name
    shared: list[Shared] = request.module.SHARED
    for i, launch in enumerate(shared):
        if name in launch.cases:
            if i not in _shared_results:
                running = {item.name for item in request.session.items if item.path == request.node.path}
                try:
                    _shared_results[i] = launch.run(running)
                except AssertionError as e:  # it hung: every test of it fails with that, without running it again
                    _shared_results[i] = e
            results = _shared_results[i]
            if isinstance(results, AssertionError):
                raise results
            return results[name]
    raise LookupError(f"{name} is a case of none of {request.module.__name__}.SHARED's launches")
