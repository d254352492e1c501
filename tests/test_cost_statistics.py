"""controller.cost: the recent-window quantile and the quantile tracker every cost estimate uses."""

from __future__ import annotations

import math

import pytest

from controller.cost import QuantileTracker, RecentWindow, quantile_of


def test_the_quantile_is_a_measured_value_at_rank_floor_q_n():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert quantile_of(values, 0.5) == 3.0  # sorted 1..5, rank floor(2.5) = 2
    assert quantile_of(values, 0.9) == 5.0  # rank floor(4.5) = 4
    assert quantile_of(values, 0.0) == 1.0 and quantile_of(values, 1.0) == 5.0
    assert quantile_of([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0  # rank 2 of 4: no interpolation
    assert quantile_of([], 0.5) == 0.0 and quantile_of([], 0.5, empty=1.0) == 1.0


def test_a_window_forgets_the_oldest_values():
    window = RecentWindow(3)
    for value in (10.0, 1.0, 2.0, 3.0):
        window.append(value)
    assert window.values() == [1.0, 2.0, 3.0] and len(window) == 3
    assert window.median() == 2.0 and window.quantile(1.0) == 3.0
    assert RecentWindow(2).median(empty=7.0) == 7.0
    growing = RecentWindow(3)
    growing.append(1.0)
    assert growing.median() == 1.0
    growing.append(5.0)
    assert growing.quantile(1.0) == 5.0  # read after each append: never a stale answer
    for value in (9.0, 11.0):
        growing.append(value)
    assert growing.median() == 9.0 and growing.quantile(0.0) == 5.0
    with pytest.raises(ValueError, match="at least one value"):
        RecentWindow(0)


def test_the_tracker_moves_its_log_by_step_times_hit_minus_target():
    tracker = QuantileTracker(0.9, step=0.1, bounds=(0.5, 2.0))
    assert tracker.observe(True) == pytest.approx(math.exp(0.1 * 0.1))  # a hit: up by step x (1 - target)
    assert tracker.observe(False) == pytest.approx(math.exp(0.01 - 0.09))  # a miss: down by step x target
    assert tracker.observe(False, target=0.5) == pytest.approx(math.exp(0.01 - 0.09 - 0.05))  # its own target
    for _ in range(100):
        tracker.observe(False)
    assert tracker.value == pytest.approx(0.5)  # held at the lower bound
    still = QuantileTracker(0.05, step=0.0, bounds=(0.67, 3.0))
    assert still.observe(True) == 1.0  # step 0: the factor stays


def test_at_its_fixed_point_a_target_share_hits():
    """As the budget margin: a request within budget (a hit) loosens the margin, which makes the next
    hit less likely; the margin settles where a target share of requests is within budget."""
    tracker = QuantileTracker(0.8, step=0.05, bounds=(0.01, 100.0))
    hits = []
    for i in range(4000):
        allowed = 1.0 + (i * 0.618033988749895) % 1.0  # what each request could take, even over [1, 2)
        hits.append(tracker.value <= allowed)
        tracker.observe(hits[-1])
    assert sum(hits[1000:]) / 3000 == pytest.approx(0.8, abs=0.02)
    assert tracker.value == pytest.approx(1.2, abs=0.05)  # the allowed values' 20th percentile
