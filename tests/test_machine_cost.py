"""The cost model of the machine: one request's grid from the profile's medians, the request's own cost
and the latency scale; the guard rule on it; its knob view; what a served request records."""

from __future__ import annotations

import math

import pytest
import torch

from controller.cost import LatencyScale
from controller.machine import CostGrid, MachineCost
from pipeline.errors import CtrlError

REFERENCE = {(2, 4, 12): 20.0, (2, 8, 12): 30.0, (6, 8, 14): 50.0}


def test_the_profile_grid_is_each_medians_cost_times_the_scale_with_the_requests_own_cost_in_its_place():
    cost = MachineCost(LatencyScale(REFERENCE, fixed=2.0))
    grid = cost.grid(None, None, 70.0)
    assert grid.source == "profile" and grid.budget_ms == 70.0
    assert [grid.expected(c) for c in REFERENCE] == [40.0, 60.0, 100.0]
    assert grid.base((2, 8, 12)) == 30.0 and grid.expected((10, 8, 16)) == math.inf  # not priced
    assert grid.held((2, 8, 12)) == (2, 8, 12)  # 60 fits 70
    assert grid.held((6, 8, 14)) == (6, 8, 14)  # nothing else at its crops: the fastest there is itself
    # this request's own cost of 2/8/12 is 40 profile ms: 80 here, over the budget; 2/4/12 (40) fits
    own = cost.grid(None, None, 70.0, request_ms={(2, 8, 12): 40.0})
    assert own.expected((2, 8, 12)) == 80.0 and own.expected((2, 4, 12)) == 40.0
    assert own.held((2, 8, 12)) == (2, 4, 12)


def test_the_grid_reads_each_configurations_own_scale():
    scale = LatencyScale(REFERENCE, quantile=0.5)
    for _ in range(5):  # 2/8/12 runs three times its median here, 6/8/14 at its median
        scale.observe((2, 8, 12), 90.0)
    for _ in range(6):
        scale.observe((6, 8, 14), 50.0)
    assert scale.value == 1.0  # the median of five 3.0s and six 1.0s
    grid = MachineCost(scale).grid(None, None, 70.0)
    assert grid.expected((2, 8, 12)) == 90.0  # its own scale, 3.0
    assert grid.expected((6, 8, 14)) == 50.0
    assert grid.expected((2, 4, 12)) == 20.0  # the overall scale where a configuration has too few of its own
    assert grid.held((2, 8, 12)) == (2, 4, 12)


def test_observe_records_the_scales_ratio_only_in_the_profiles_layout():
    cost = MachineCost(LatencyScale(REFERENCE, quantile=0.5))
    grid = cost.grid(None, None, 100.0)
    assert cost.observe(grid, (2, 4, 12), model_ms=30.0, measured_ms=35.0) == 1.5
    assert cost.observe(grid, (2, 4, 12), model_ms=90.0, measured_ms=95.0, insertion_position=1) is None
    assert cost.scale.ratios() == [1.5]
    assert cost.observe(None, (10, 8, 16), model_ms=30.0, measured_ms=35.0) is None  # no median to compare with


class RecordingGuard:
    """A guard with a fixed grid that records what it is told (the protocol the cost model reads)."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float, float | None]] = []

    def grid(self, lang, tiling_crops, budget_ms, prompt_tokens=float("nan")):
        return CostGrid(((2, 4, 12), (6, 8, 16)), torch.tensor([10.0, 50.0]), lambda _config: 2.0, budget_ms, "guard")

    def observe(self, base_ms, measured_ms, expected_ms=None):
        self.seen.append((base_ms, measured_ms, expected_ms))


def test_a_guard_answers_the_grid_and_hears_of_the_requests_it_decided():
    guard = RecordingGuard()
    cost = MachineCost(LatencyScale({}), guard)
    grid = cost.grid(torch.zeros(3), None, 30.0)
    assert grid.source == "guard" and grid.expected((6, 8, 16)) == 100.0
    cost.observe(grid, (6, 8, 16), model_ms=70.0, measured_ms=80.0, insertion_position=1)
    assert guard.seen == [(50.0, 80.0, 100.0)]
    cost.observe(None, (6, 8, 16), model_ms=1.0, measured_ms=1.0)
    assert len(guard.seen) == 1  # a request not decided by a guard's grid tells the guard nothing


def test_the_knob_view_places_each_priced_configuration_and_allows_what_fits():
    grid = CostGrid(((2, 4, 12), (6, 8, 16)), torch.tensor([10.0, 50.0]), lambda _config: 2.0, 30.0, "guard")
    view = grid.over(((2, 6), (4, 8), (12, 16)))
    assert view.expected_ms.shape == (2, 2, 2)
    assert view.expected_ms[0, 0, 0] == 20.0 and view.expected_ms[1, 1, 1] == 100.0
    assert view.base_ms[1, 1, 1] == 50.0
    assert torch.isinf(view.expected_ms).sum() == 6  # the six configurations the grid does not price
    assert view.allowed.nonzero().tolist() == [[0, 0, 0]]
    assert view.crops_allowed.tolist() == [True, False]
    # nothing fits: the configuration expected to be fastest
    tight = CostGrid(grid.configs, grid.base_ms, grid.factor_of, 1.0, "guard").over(((2, 6), (4, 8), (12, 16)))
    assert tight.allowed.nonzero().tolist() == [[0, 0, 0]]
    with pytest.raises(CtrlError, match="prices none"):
        grid.over(((10,), (4,), (12,)))
