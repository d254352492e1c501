"""The budget calibration's rules with known latencies (no model runs): which configurations it
times, how it scales an offline range, and what it does when the knobs barely move latency."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from online.calibrate import BudgetReference, calibrate_budget_range, calibration_configs, calibration_rows
from trainer.data import ActionSpace
from trainer.policy import ControllerPolicy, PolicyConfig
from trainer.two_stage import TwoStageConfig, TwoStageController

CROPS, TOP_K, BLOCKS = (2, 6, 12), (4, 8), (12, 14, 16)


def _controller(positions: tuple[int, ...] = (1, 2, 3, 4, 5)) -> TwoStageController:
    space = ActionSpace(tuple(itertools.product(CROPS, TOP_K, BLOCKS)))
    policy = ControllerPolicy(PolicyConfig(lang_feature_dim=5, image_feature_dim=3, budget_min_ms=100.0,
                                           budget_max_ms=300.0), space)
    return TwoStageController(policy, TwoStageConfig(hidden_size=8, token_scale=1.0, num_layers=16,
                                                     insertion_positions=positions))


class FixedLatency:
    """An executor whose requests take the given milliseconds, per forced configuration and row."""

    def __init__(self, ms: dict[str, list[float]], configs) -> None:
        self.ms, (self.fastest, self.slowest) = ms, configs

    def run_fixed(self, rows, force):
        c, _, k, b = force
        ms = self.ms["fastest" if force == self.fastest else "slowest"]
        return [SimpleNamespace(latency_total_ms=ms[r], max_crops=CROPS[c], top_k=TOP_K[k], num_active_blocks=BLOCKS[b])
                for r in rows]


def test_calibration_times_the_extreme_configurations():
    # 12 blocks are allowed after position 1 only (origin table): fastest = 2 crops, p = 1, top-4, 12 blocks;
    # slowest = 12 crops, the first position allowing all 16 blocks (p = 1), top-8, 16 blocks
    assert calibration_configs(_controller()) == ((0, 0, 0, 0), (2, 0, 1, 2))
    # positions 4 and 5 allow only 16 of these block counts: fastest takes 16 blocks too
    assert calibration_configs(_controller((4, 5))) == ((0, 0, 0, 2), (2, 0, 1, 2))
    # position 3 allows 14 blocks, position 5 does not: the fewest blocks of the first position
    assert calibration_configs(_controller((3, 5))) == ((0, 0, 0, 1), (2, 0, 1, 2))


def test_each_end_is_scaled_by_its_configuration_ratio_and_rounded_to_a_tenth():
    ctrl = _controller()
    configs = calibration_configs(ctrl)
    fastest_knobs, slowest_knobs = (2, 4, 12), (12, 8, 16)
    keys = [("ds", "a"), ("ds", "b"), ("ds", "c")]
    recorded = {(*key, *fastest_knobs): 100.0 for key in keys} | {(*key, *slowest_knobs): 400.0 for key in keys}
    reference = BudgetReference(range_ms=(140.0, 500.0), latency_ms=recorded, keys=keys)
    # the fastest at 120, 123.45, 123.45 against 100 recorded: 90th percentiles (of the two runs of each
    # sample) 123.45 against 100; the slowest 0.9 on every row
    executor = FixedLatency({"fastest": [120.0, 123.45, 123.45], "slowest": [360.0, 360.0, 360.0]}, configs)
    assert calibrate_budget_range(executor, ctrl, [0, 1, 2], reference) == (172.8, 450.0)  # 140 x 1.2345 = 172.83


def test_recorded_latencies_of_zero_are_not_ratios():
    ctrl = _controller()
    configs = calibration_configs(ctrl)
    keys = [("ds", "a"), ("ds", "b")]
    recorded = {("ds", "a", 2, 4, 12): 0.0, ("ds", "b", 2, 4, 12): 100.0,
                ("ds", "a", 12, 8, 16): 400.0, ("ds", "b", 12, 8, 16): 400.0}
    reference = BudgetReference(range_ms=(120.0, 500.0), latency_ms=recorded, keys=keys)
    executor = FixedLatency({"fastest": [150.0, 150.0], "slowest": [400.0, 400.0]}, configs)
    # row a's zero is skipped: the fastest ratio is row b's alone, 1.5
    assert calibrate_budget_range(executor, ctrl, [0, 1], reference) == (180.0, 500.0)


def test_a_range_is_kept_when_the_knobs_barely_move_latency():
    ctrl = _controller()
    executor = FixedLatency({"fastest": [200.0, 200.0], "slowest": [205.0, 205.0]}, calibration_configs(ctrl))
    # nothing recorded: the p95s (200, 205) are within 5 %, so the high end becomes 1.5 x the low end
    assert calibrate_budget_range(executor, ctrl, [0, 1], None) == (200.0, 300.0)
    far = FixedLatency({"fastest": [200.0, 200.0], "slowest": [211.0, 211.0]}, calibration_configs(ctrl))
    assert calibrate_budget_range(far, ctrl, [0, 1], None) == (200.0, 211.0)


def test_without_recorded_latencies_the_ends_are_this_machines_p95():
    ctrl = _controller()
    # 20 rows, each run twice: 38 values of 10 ms and 2 of 110 ms; p95 (linear) = 10 + 0.05 x 100
    executor = FixedLatency({"fastest": [10.0] * 19 + [110.0], "slowest": [100.0] * 19 + [300.0]},
                            calibration_configs(ctrl))
    assert calibrate_budget_range(executor, ctrl, list(range(20)), None) == (15.0, 110.0)


class RunByRun:
    """An executor whose requests take the given milliseconds per forced configuration, calibration
    run (the first or the second pass over the rows) and row."""

    def __init__(self, ms: dict[str, list[list[float]]], configs) -> None:
        self.ms, (self.fastest, self.slowest) = ms, configs
        self.calls = {"fastest": 0, "slowest": 0}

    def run_fixed(self, rows, force):
        name = "fastest" if force == self.fastest else "slowest"
        c, _, k, b = force
        ms = self.ms[name][self.calls[name]]
        self.calls[name] += 1
        return [SimpleNamespace(latency_total_ms=ms[r], max_crops=CROPS[c], top_k=TOP_K[k], num_active_blocks=BLOCKS[b])
                for r in rows]


def _flat_reference(rows: int, low_ms: float) -> BudgetReference:
    """Every sample recorded at 100 ms (fastest) and 400 ms (slowest), the offline range low_ms-500."""
    keys = [("ds", f"s{i}") for i in range(rows)]
    recorded = {(*key, 2, 4, 12): 100.0 for key in keys} | {(*key, 12, 8, 16): 400.0 for key in keys}
    return BudgetReference(range_ms=(low_ms, 500.0), latency_ms=recorded, keys=keys)


def test_the_low_end_is_raised_to_what_the_fastest_configuration_meets_here():
    ctrl = _controller()
    # nine samples run the fastest configuration at 120 ms (recorded at 100), the tenth, a long answer,
    # at 300 ms in both runs: the tail ratio (90th percentile of the 20 runs: 120 + 0.1 x 180 = 138
    # against 100) scales the offline low end 110 to 151.8, below the tenth sample's latency; the
    # floor is 1.1 times the 98th percentile of the 20 runs, 300 (the top two values): 330
    fastest = [120.0] * 9 + [300.0]
    executor = RunByRun({"fastest": [fastest, fastest], "slowest": [[400.0] * 10] * 2}, calibration_configs(ctrl))
    assert calibrate_budget_range(executor, ctrl, list(range(10)), _flat_reference(10, 110.0)) == (330.0, 500.0)


def test_a_slow_moment_counts_towards_the_floor():
    ctrl = _controller()
    # every sample at 120 ms but one run, sample 3's second, at 900 ms (the machine was slow then): a
    # served request meets such moments too, so the run counts. Of the 20 runs the 90th percentile is
    # still 120 (ratio 1.2: 110 x 1.2 = 132), the 98th 120 + 0.62 x 780 = 603.6, which with its margin
    # (x 1.1: 663.96) sets the low end; the high end 500 is not above it, so it is 1.5 x 663.96
    first, second = [120.0] * 10, [120.0] * 3 + [900.0] + [120.0] * 6
    executor = RunByRun({"fastest": [first, second], "slowest": [[400.0] * 10] * 2}, calibration_configs(ctrl))
    assert calibrate_budget_range(executor, ctrl, list(range(10)), _flat_reference(10, 110.0)) == (664.0, 995.9)


def test_calibration_rows_are_a_seeded_draw_of_the_training_rows():
    train = list(range(100, 200))
    drawn = calibration_rows(train, 16, seed=0)
    assert len(drawn) == 16 and len(set(drawn)) == 16 and set(drawn) <= set(train)
    assert drawn == sorted(drawn)  # in the training rows' order
    assert drawn != train[:16]  # a draw, not the first rows
    assert calibration_rows(train, 16, seed=0) == drawn
    assert calibration_rows(train, 16, seed=1) != drawn
    assert calibration_rows(train[:10], 16, seed=0) == train[:10]  # fewer rows than asked: all of them
